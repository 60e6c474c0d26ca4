"""Bin the cells of a sheet into single-cell coolers.

Two ways in: :func:`bin_block` bins one block of a sheet straight into per-resolution
.scool files (the workflow scatters a large sheet into such blocks, one job each, so a
grown sheet re-runs only the blocks whose cells changed, and a cluster spreads them over
nodes); :func:`bin_cells` bins a whole (small) sheet through a per-cell cache, so a
grown sheet bins only its new cells (the embedding of new cells uses it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator, Mapping
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import pandas as pd

from ..base.atomic import atomic_path
from ..base.progress import Progress
from ..io.genome import ChromNamer, bin_offsets, make_bins
from ..io.pairs import read_pairs
from .binning import bin_contacts

log = logging.getLogger(__name__)

# 2: compressed, delta-coded pixel keys (version 1 held raw int64 columns, 4.4 MB a cell)
CACHE_VERSION = 2
STAT_COLUMNS = ("total", "cis", "trans", "dropped_unknown_chrom", "dropped_excluded")
# cells handed to cooler per append: bounds memory by a few cells, not by the block
WRITE_BATCH = 16


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


def bin_one(pairs: str, opts: ParseOptions) -> tuple[np.ndarray, dict[int, pd.DataFrame]]:
    """Parse one pairs file; its contact stats (:data:`STAT_COLUMNS`) and its pixels at
    every resolution."""
    genome = opts.genome
    # a worker bins many cells: loading the compiled scanner once pays off
    contacts = read_pairs(pairs, opts.namer(), genome, keep=opts.keep, columns=opts.columns, engine="compiled")
    stats = np.array([contacts.stats[c] for c in STAT_COLUMNS], dtype=np.int64)
    return stats, {res: bin_contacts(contacts, genome, res) for res in opts.resolutions}


def _bin_job(job):
    cell, pairs, opts = job
    return (cell, *bin_one(pairs, opts))


def binned(cells, pairs, opts: ParseOptions, threads: int = 1) -> Iterator[tuple[str, np.ndarray, dict]]:
    """``(cell, stats, {resolution: pixels})`` for every cell, in the given order, parsed
    by ``threads`` worker processes (at most a few cells ahead of the consumer)."""
    jobs = [(c, p, opts) for c, p in zip(cells, pairs)]
    if threads <= 1:
        yield from map(_bin_job, jobs)
        return
    with ProcessPoolExecutor(max_workers=threads, mp_context=get_context("spawn")) as pool:
        ahead = 2 * threads
        futures = [pool.submit(_bin_job, j) for j in jobs[:ahead]]
        for i in range(len(jobs)):
            result = futures[i].result()
            futures[i] = None  # the pixels are the consumer's now
            if i + ahead < len(jobs):
                futures.append(pool.submit(_bin_job, jobs[i + ahead]))
            yield result


class ScoolWriter:
    """Append cells to one .scool per resolution, a batch at a time (cooler's own
    ``create_scool`` in append mode: it keeps the root bins and hard-links them)."""

    def __init__(self, paths: dict[int, Path], genome: dict[str, int]):
        self.paths = paths
        self.genome = genome
        self.batch: dict[int, dict[str, pd.DataFrame]] = {res: {} for res in paths}
        self.bins = {res: make_bins(genome, res) for res in paths}
        self.started = False

    def add(self, cell: str, pixels: dict[int, pd.DataFrame]) -> None:
        for res in self.paths:
            self.batch[res][cell] = pixels[res]
        if len(self.batch[next(iter(self.paths))]) >= WRITE_BATCH:
            self.flush()

    def flush(self) -> None:
        import cooler

        for res, path in self.paths.items():
            if not self.batch[res] and self.started:
                continue
            cooler.create_scool(
                str(path),
                self.bins[res],
                self.batch[res],
                mode="a" if self.started else "w",
                ordered=True,
                symmetric_upper=True,
                dtypes={"count": np.int64},
                metadata={"resolution": res, "producer": "ampflow"},
            )
            self.batch[res] = {}
        self.started = True


def bin_block(cells, pairs, opts: ParseOptions, out_scool: dict[int, str], stats_out, threads: int = 1) -> pd.DataFrame:
    """Bin ``cells`` (their ``pairs`` files) into one .scool per resolution and their
    contact stats into a TSV; every output appears under its final name only when all
    are complete. Memory is a few cells', not the block's."""
    cells, pairs = list(cells), list(pairs)
    progress = Progress(len(cells), "cells", log, verb="binned and written")
    rows = []
    with ExitStack() as outputs:
        tmps = {res: outputs.enter_context(atomic_path(path)) for res, path in out_scool.items()}
        stats_tmp = outputs.enter_context(atomic_path(stats_out))
        writer = ScoolWriter(tmps, opts.genome)
        for cell, stats, pixels in binned(cells, pairs, opts, threads):
            writer.add(cell, pixels)
            rows.append(stats)
            progress.update()
        writer.flush()
        table = pd.DataFrame(np.vstack(rows), columns=list(STAT_COLUMNS), index=pd.Index(cells, name="cell_id"))
        table.to_csv(stats_tmp, sep="\t")
    return table


# ------------------------------------------------------------------ per-cell cache
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


def _encode(px: pd.DataFrame, n_bins: int) -> dict[str, np.ndarray]:
    """Pixels as deltas of their sorted keys lo * n + hi (small numbers, which zlib
    packs to a byte or two) and counts as uint32."""
    keys = px["bin1_id"].to_numpy() * n_bins + px["bin2_id"].to_numpy()
    return {"dkey": np.diff(keys, prepend=0), "count": px["count"].to_numpy().astype(np.uint32)}


def _decode(dkey: np.ndarray, count: np.ndarray, n_bins: int) -> pd.DataFrame:
    keys = np.cumsum(dkey)
    return pd.DataFrame({"bin1_id": keys // n_bins, "bin2_id": keys % n_bins, "count": count.astype(np.int64)})


def bin_one_cell(cell: str, pairs: str, opts: ParseOptions, cache_dir) -> tuple[str, bool]:
    """Parse and bin one cell into its cache file unless a valid cache exists.

    Returns (cell, binned) where ``binned`` is False if the cache was reused.
    """
    key = _cache_key(pairs, opts)
    path = cache_path(cache_dir, cell)
    if _cache_valid(path, key):
        return cell, False
    stats, pixels = bin_one(pairs, opts)
    arrays: dict[str, np.ndarray] = {"key": np.array(key), "stats": stats}
    for res, px in pixels.items():
        for name, arr in _encode(px, int(bin_offsets(opts.genome, res)[-1])).items():
            arrays[f"{res}/{name}"] = arr
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as fh:
            np.savez_compressed(fh, **arrays)
    return cell, True


class CachedPixels(Mapping):
    """Read-only ``{cell: pixels DataFrame}`` view over the cache, loaded one cell at a
    time so that writing a .scool never holds every cell in memory."""

    def __init__(self, cells, cache_dir, resolution: int, n_bins: int):
        self.cells = list(cells)
        self.cache_dir = cache_dir
        self.resolution = resolution
        self.n_bins = n_bins
        self.progress = Progress(len(self.cells), "cells", log, verb=f"written at {resolution} bp")

    def __getitem__(self, cell):
        self.progress.update()
        with np.load(cache_path(self.cache_dir, cell)) as z:
            return _decode(z[f"{self.resolution}/dkey"], z[f"{self.resolution}/count"], self.n_bins)

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
    """Write all cells at ``resolution`` into one .scool from the cache, atomically."""
    import cooler

    bins = make_bins(opts.genome, resolution)
    with atomic_path(path) as tmp:
        cooler.create_scool(
            str(tmp),
            bins,
            CachedPixels(cells, cache_dir, resolution, len(bins)),
            ordered=True,
            symmetric_upper=True,
            dtypes={"count": np.int64},
            metadata={"resolution": resolution, "producer": "ampflow"},
        )
