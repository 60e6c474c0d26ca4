"""Cluster resources of the prepare rules as functions of their input size.

The constants come from scripts/bench_prepare.py on the mm10 genome (150k contacts a
cell, 25,000 genes; configurations 1 Mb x 10, 500 kb x 20 and 100 kb x 30 strata), at 300
and 1,000 cells on 2 cores: a job's memory there is a base (interpreter, libraries, the
feature index, bounded buffers) plus at most 0.15 MB a cell, so the base and a term in
the input's size, times :data:`MARGIN`, cover a 7,500-cell dataset too. Runtimes are
the measured rate slowed down 3-fold (a busy node, a slow shared file system), plus 5
minutes. profiles/README.md states the same formulas for people.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

MARGIN = 1.5
START_MIN = 5  # minutes every job gets on top: queueing on the node, imports, file system


@dataclass(frozen=True)
class Need:
    """A rule's memory and time as functions of its input's size.

    mem_mb = (base_mb + threads x mb_per_thread + mb_per_input_mb x input MB) x 1.5
    runtime = 5 + input MB / (input_mb_per_s x threads) / 60 x 3   (minutes)
    """

    base_mb: float
    mb_per_input_mb: float
    input_mb_per_s: float
    mb_per_thread: float = 0.0

    def mem_mb(self, input_mb: float, threads: int = 1) -> int:
        return math.ceil((self.base_mb + threads * self.mb_per_thread + self.mb_per_input_mb * input_mb) * MARGIN)

    def runtime(self, input_mb: float, threads: int = 1) -> int:
        return START_MIN + math.ceil(input_mb / (self.input_mb_per_s * max(threads, 1)) / 60 * 3)


#: Measured at 1,000 cells (peak RSS of the job's processes; input MB/s of wall):
#: bin_block 821 MB with 2 threads, 17 MB/s of pairs.gz; load_rna 309 MB for a 4.9 MB
#: matrix (306 MB for the real HiRES brain matrix, 3.3 MB); pseudobulk 926 MB with 2
#: threads, 5 MB/s of .scool; strata 334 MB (100 kb x 30), 7 MB/s; rna_data 459 MB;
#: graph 457 MB (100 kb, 200 MB of inputs); qc_cells and split_cells 117 MB.
NEEDS = {
    "bin_block": Need(base_mb=300, mb_per_input_mb=0.0, input_mb_per_s=8.0, mb_per_thread=350),
    "gather_blocks": Need(base_mb=500, mb_per_input_mb=0.0, input_mb_per_s=50.0),
    "load_rna": Need(base_mb=250, mb_per_input_mb=30.0, input_mb_per_s=1.0),
    "qc_cells": Need(base_mb=500, mb_per_input_mb=2.0, input_mb_per_s=1.0),
    "split_cells": Need(base_mb=500, mb_per_input_mb=2.0, input_mb_per_s=1.0),
    "pseudobulk": Need(base_mb=600, mb_per_input_mb=0.1, input_mb_per_s=2.0, mb_per_thread=200),
    "strata": Need(base_mb=400, mb_per_input_mb=0.25, input_mb_per_s=2.0),
    "rna_data": Need(base_mb=400, mb_per_input_mb=30.0, input_mb_per_s=1.0),
    "graph": Need(base_mb=400, mb_per_input_mb=1.0, input_mb_per_s=5.0),
}
#: A binning worker parses one pairs file at a time: MB of its memory per MB of the
#: largest pairs.gz of the block (~12 contacts a compressed kB, ~25 bytes a contact held)
PAIRS_MB_FACTOR = 40


def size_mb(paths) -> list[float]:
    return [os.path.getsize(p) / 1e6 for p in paths]


def bin_block_mem_mb(pairs, threads: int) -> int:
    """mem_mb of a bin_block job: the table's, plus ``threads x 40 x`` the largest pairs file's MB."""
    largest = max(size_mb(pairs), default=0.0)
    need = NEEDS["bin_block"]
    return need.mem_mb(0.0, threads) + math.ceil(threads * PAIRS_MB_FACTOR * largest * MARGIN)
