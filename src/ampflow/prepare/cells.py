"""Bin every cell of a sheet, in parallel, with a per-cell cache so that new cells
are the only ones binned again when the sheet grows."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import pandas as pd

from ..io.atomic import atomic_path
from ..io.genome import ChromNamer, make_bins
from ..io.pairs import read_pairs
from ..progress import Progress
from .binning import bin_contacts

log = logging.getLogger(__name__)

CACHE_VERSION = 1
STAT_COLUMNS = ("total", "cis", "trans", "dropped_unknown_chrom", "dropped_excluded")


@dataclass(frozen=True)
class ParseOptions:
    """Everything besides the pairs file itself that decides a cell's binned contacts."""

    chromsizes: tuple[tuple[str, int], ...]
    keep: tuple[str, ...] | None
    strip_prefix: str
    chr_prefix: str
    columns: str | None
    resolutions: tuple[int, ...]

    @property
    def genome(self) -> dict[str, int]:
        return dict(self.chromsizes)

    def namer(self) -> ChromNamer:
        return ChromNamer(tuple(n for n, _ in self.chromsizes), self.strip_prefix, self.chr_prefix)


def _cache_key(pairs: str, opts: ParseOptions) -> str:
    st = os.stat(pairs)
    blob = json.dumps(
        {"v": CACHE_VERSION, "file": os.path.abspath(pairs), "size": st.st_size, "mtime": st.st_mtime_ns, **asdict(opts)},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def cache_path(cache_dir, cell: str) -> Path:
    return Path(cache_dir) / f"{cell}.npz"


def _cache_valid(path: Path, key: str) -> bool:
    try:
        with np.load(path) as z:
            return str(z["key"]) == key
    except (OSError, KeyError, ValueError, EOFError):
        return False


def bin_one_cell(cell: str, pairs: str, opts: ParseOptions, cache_dir) -> tuple[str, bool]:
    """Parse and bin one cell into its cache file unless a valid cache exists.

    Returns (cell, binned) where ``binned`` is False if the cache was reused.
    """
    key = _cache_key(pairs, opts)
    path = cache_path(cache_dir, cell)
    if _cache_valid(path, key):
        return cell, False
    genome = opts.genome
    # a worker bins many cells: loading the compiled scanner once pays off
    contacts = read_pairs(pairs, opts.namer(), genome, keep=opts.keep, columns=opts.columns, engine="compiled")
    arrays: dict[str, np.ndarray] = {"key": np.array(key)}
    arrays["stats"] = np.array([contacts.stats[c] for c in STAT_COLUMNS], dtype=np.int64)
    for res in opts.resolutions:
        px = bin_contacts(contacts, genome, res)
        for col in ("bin1_id", "bin2_id", "count"):
            arrays[f"{res}/{col}"] = px[col].to_numpy()
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as fh:
            np.savez(fh, **arrays)
    return cell, True


class CachedPixels(Mapping):
    """Read-only ``{cell: pixels DataFrame}`` view over the cache, loaded one cell at a
    time so that writing a .scool never holds every cell in memory."""

    def __init__(self, cells, cache_dir, resolution: int):
        self.cells = list(cells)
        self.cache_dir = cache_dir
        self.resolution = resolution

    def __getitem__(self, cell):
        with np.load(cache_path(self.cache_dir, cell)) as z:
            return pd.DataFrame({c: z[f"{self.resolution}/{c}"] for c in ("bin1_id", "bin2_id", "count")})

    def __iter__(self):
        return iter(self.cells)

    def __len__(self):
        return len(self.cells)


def cached_stats(cells, cache_dir) -> pd.DataFrame:
    rows = []
    for cell in cells:
        with np.load(cache_path(cache_dir, cell)) as z:
            rows.append(z["stats"])
    df = pd.DataFrame(np.vstack(rows), columns=list(STAT_COLUMNS), index=pd.Index(list(cells), name="cell_id"))
    return df


def bin_cells(sheet: pd.DataFrame, opts: ParseOptions, cache_dir, threads: int = 1) -> pd.DataFrame:
    """Bin every cell in ``sheet`` (columns ``cell_id``, ``pairs``) into the cache.

    Runs ``threads`` worker processes; cells whose cache is valid (same file size and
    mtime, same options) are not parsed again. Returns per-cell contact stats.
    """
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    cells = list(sheet["cell_id"])
    pairs = list(sheet["pairs"])
    progress = Progress(len(cells), "cells", log, verb="binned or reused")
    n_new = 0
    if threads <= 1:
        for c, p in zip(cells, pairs):
            n_new += bin_one_cell(c, p, opts, cache_dir)[1]
            progress.update()
    else:
        with ProcessPoolExecutor(max_workers=threads, mp_context=get_context("spawn")) as pool:
            futures = [pool.submit(bin_one_cell, c, p, opts, cache_dir) for c, p in zip(cells, pairs)]
            for fut in futures:
                n_new += fut.result()[1]
                progress.update()
    log.info("binning: %d cell(s) binned now, %d reused from cache (%s)", n_new, len(cells) - n_new, cache_dir)
    return cached_stats(cells, cache_dir)


def write_scool(path, cells, cache_dir, opts: ParseOptions, resolution: int) -> None:
    """Write all cells at ``resolution`` into one .scool, atomically."""
    import cooler

    bins = make_bins(opts.genome, resolution)
    with atomic_path(path) as tmp:
        cooler.create_scool(
            str(tmp),
            bins,
            CachedPixels(cells, cache_dir, resolution),
            ordered=True,
            symmetric_upper=True,
            dtypes={"count": np.int64},
            metadata={"resolution": resolution, "producer": "ampflow"},
        )
