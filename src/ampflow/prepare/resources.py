"""Cluster resources of the prepare rules as functions of their input size.

Each figure is what one job was measured to need on the mm10 genome (150k contacts a
cell, resolutions 1 Mb, 500 kb, 100 kb; scripts/bench_prepare.py) times a margin, so a
scheduler neither kills the job nor holds a node's memory for nothing. profiles/README.md
states the same formulas for people.
"""

from __future__ import annotations

import math
import os

MARGIN = 1.5
# a binning worker: interpreter, numpy/pandas/cooler, one cell's contacts (~25 bytes a
# contact, ~12 contacts a compressed kilobyte of pairs)
WORKER_MB = 350
PAIRS_MB_FACTOR = 40  # MB of a worker's memory per MB of the largest pairs.gz
# binning speed of one worker: compressed MB of pairs a second, three resolutions written
BIN_MB_PER_S = 3.0
# gathering block .scool files: compressed chunks copied as they are
GATHER_MB_PER_S = 50.0


def size_mb(paths) -> list[float]:
    return [os.path.getsize(p) / 1e6 for p in paths]


def bin_block_mem_mb(pairs, threads: int) -> int:
    """mem_mb of a bin_block job: ``(300 + threads x (350 + 40 x largest pairs MB)) x 1.5``."""
    largest = max(size_mb(pairs), default=0.0)
    return math.ceil((300 + threads * (WORKER_MB + PAIRS_MB_FACTOR * largest)) * MARGIN)


def bin_block_runtime(pairs, threads: int) -> int:
    """runtime (minutes) of a bin_block job: ``5 + total pairs MB / (3 MB/s x threads) / 60 x 1.5``."""
    total = sum(size_mb(pairs))
    return 5 + math.ceil(total / (BIN_MB_PER_S * threads) / 60 * MARGIN)


def gather_runtime(input_mb: float) -> int:
    """runtime (minutes) of gather_blocks: ``5 + block .scool MB / (50 MB/s) / 60 x 1.5``."""
    return 5 + math.ceil(input_mb / GATHER_MB_PER_S / 60 * MARGIN)
