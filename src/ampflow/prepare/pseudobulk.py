"""Pseudobulk .mcool from the given cells (HiGlass-viewable; feeds graph contact edges).

The workflow pools the training cells only: the graph is fitted, so held-out cells stay out.

Built with cooler's own streaming tools, so memory is bounded by buffer sizes and not by
the number of cells or pixels:

1. the cells of the finest resolution are merged (cooler's k-way merge, ``mergebuf``
   records per epoch) block by block into temporary coolers, then the blocks into
   ``resolutions/{finest}``;
2. resolutions that are multiples of a level already written are coarsened from it
   (cooler's coarsener, in chunks); others are merged from their own .scool;
3. every level is balanced out of core (``cooler.balance_cooler`` over pixel chunks,
   through the ``map`` given: a process pool's when there are threads to spare).

Every step writes progress lines, so a long run is never silent.
"""

from __future__ import annotations

import logging
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from ..base.atomic import atomic_path
from ..base.errors import InputError
from ..base.progress import Progress

log = logging.getLogger(__name__)

#: pixel records held at once: per merge epoch, per coarsening chunk, per balancing chunk
CHUNK = 2_000_000
#: cells merged per first-level block (see write_mcool for the measurement behind it)
BLOCK = 64
MCOOL_FORMAT = {"format": "HDF5::MCOOL", "format-version": 2}


class _Logged:
    """Pass a cooler pixel-chunk iterator through, logging rows done (bin1) at most every few seconds."""

    def __init__(self, chunks, n_bins: int, label: str, every: float = 5.0):
        self.chunks = chunks
        self.progress = Progress(n_bins, "bins", log, every=every, verb=label)

    def __iter__(self):
        for chunk in self.chunks:
            if len(chunk["bin1_id"]):
                self.progress.update(int(chunk["bin1_id"][-1]) + 1 - self.progress.done)
            yield chunk
        if self.progress.done < self.progress.total:
            self.progress.update(self.progress.total - self.progress.done)


def _create(uri: str, bins, chunks, mode: str) -> None:
    from cooler.create import create  # the writer behind cooler.create_cooler, taking chunk iterators

    create(uri, bins, chunks, columns=["count"], dtypes={"count": np.int64}, symmetric_upper=True, mode=mode)


def merge(out_uri: str, uris: list[str], label: str, mode: str = "w", mergebuf: int = CHUNK) -> None:
    """Sum the coolers at ``uris`` (same bins) into ``out_uri`` with cooler's k-way merge.

    This is what ``cooler.merge_coolers`` does, with the merge's chunks passed through a
    progress logger (the merge has no hook of its own) and int64 counts.
    """
    import cooler
    from cooler._reduce import CoolerMerger  # the engine of cooler.merge_coolers

    clrs = [cooler.Cooler(u) for u in uris]
    bins = clrs[0].bins()[["chrom", "start", "end"]][:]
    chunks = CoolerMerger(clrs, mergebuf=mergebuf, columns=["count"])
    with warnings.catch_warnings():
        # a single bin1 row of all inputs together may exceed mergebuf: a few records over, expected
        warnings.filterwarnings("ignore", message=r".*merge epochs will require buffering", category=UserWarning)
        _create(out_uri, bins, _Logged(chunks, len(bins), label), mode)


def merge_cells(out_uri: str, scool: str, cells: list[str], workdir, label: str, mode: str = "w", block: int = BLOCK, mergebuf: int = CHUNK) -> None:
    """Sum ``cells`` of ``scool`` into ``out_uri``: one merge when they fit in a block,
    else blocks of ``block`` cells into temporary coolers under ``workdir``, then those.

    A k-way merge reads a slice of every input per epoch, so one merge of thousands of
    cells pays thousands of small reads per epoch; blocks keep k small at both levels.
    """
    uris = [f"{scool}::/cells/{c}" for c in cells]
    if len(uris) <= block:
        merge(out_uri, uris, f"{label}: merged", mode, mergebuf)
        return
    starts = range(0, len(uris), block)
    progress = Progress(len(uris), "cells", log, every=0.0, verb=f"{label}: merged")
    parts = []
    for i in starts:
        part = str(Path(workdir) / f"block{i // block:05d}.cool")
        merge(part, uris[i : i + block], f"{label}: block {i // block + 1}/{len(starts)} merged", "w", mergebuf)
        parts.append(part)
        progress.update(len(uris[i : i + block]))
    merge(out_uri, parts, f"{label}: merged {len(parts)} blocks", mode, mergebuf)
    for part in parts:
        Path(part).unlink()


def coarsen(mcool: str, src: int, dst: int, chunksize: int = CHUNK) -> None:
    """Write ``resolutions/{dst}`` of ``mcool`` by coarsening ``resolutions/{src}`` (``dst``
    a multiple of ``src``) with cooler's coarsener, ``chunksize`` pixels at a time."""
    from cooler._reduce import CoolerCoarsener  # the engine of cooler.coarsen_cooler

    chunks = CoolerCoarsener(f"{mcool}::resolutions/{src}", dst // src, chunksize, columns=["count"], agg=None, batchsize=1)
    _create(f"{mcool}::resolutions/{dst}", chunks.new_bins, _Logged(chunks, len(chunks.new_bins), f"{dst} bp: coarsened from {src} bp"), "r+")


class _PassMap:
    """A ``map`` for ``cooler.balance_cooler`` that logs passes over the pixels and
    chunks within a pass, at most every ``every`` seconds."""

    def __init__(self, base_map, label: str, n_chunks: int, max_passes: int, every: float = 5.0, clock=time.monotonic):
        self.base_map = base_map
        self.label = label
        self.n_chunks = n_chunks
        self.max_passes = max_passes
        self.every = every
        self.clock = clock
        self.passes = 0
        self.start = self._last = clock()

    def __call__(self, func, spans):
        self.passes += 1
        for i, out in enumerate(self.base_map(func, spans), 1):
            now = self.clock()
            if now - self._last >= self.every:
                self._last = now
                rate = self.passes / max(now - self.start, 1e-9)
                log.info(
                    "%s: pass %d (at most %d), chunk %d/%d, %.2f passes/s",
                    self.label, self.passes, self.max_passes, i, self.n_chunks, rate,
                )  # fmt: skip
            yield out


def balance_level(uri: str, label: str, map=map, chunksize: int = CHUNK) -> dict:
    """ICE-balance the cooler at ``uri`` out of core (cooler defaults, genome-wide as
    before), store ``weight``; the entry for the report. Not converging (sparse data) or
    failing is logged and recorded, not raised."""
    import cooler

    clr = cooler.Cooler(uri)
    nnz = int(clr.info["nnz"])
    max_iters = 200  # cooler's default, passed to bound the passes in the log lines
    n_chunks = max(1, -(-nnz // chunksize))
    pass_map = _PassMap(map, f"{label}: balancing", n_chunks, max_iters + 2)
    entry = {"balanced": False}
    try:
        _, stats = cooler.balance_cooler(clr, chunksize=chunksize, map=pass_map, store=True, cis_only=False, max_iters=max_iters)
        entry["balanced"] = bool(stats.get("converged", False))
    except Exception as e:  # noqa: BLE001 - balancing is best effort by design
        log.warning("balancing %s failed: %s", uri, e)
        entry["balance_error"] = str(e)
    log.info("%s: balanced=%s after %d passes over %d pixels", label, entry["balanced"], pass_map.passes, nnz)
    return entry


def plan_levels(scools: dict[int, str], extra=()) -> dict[int, int | None]:
    """Each resolution's source: the coarsest finer level it is a multiple of, or None
    (merged from its own .scool: the finest, and any not a multiple of a finer one)."""
    base = min(scools)
    bad = [r for r in extra if r % base]
    if bad:
        raise InputError(f"extra pseudobulk resolutions must be multiples of the finest ({base})", key="pseudobulk.resolutions", value=bad)
    plan: dict[int, int | None] = {}
    for res in sorted(set(scools) | set(extra)):
        finer = [r for r in plan if res % r == 0]
        plan[res] = max(finer) if finer else None
    return plan


def write_mcool(path, scools: dict[int, str], cells: list[str], balance: bool = True, extra=(), map=map, block: int = BLOCK, chunksize: int = CHUNK) -> dict:
    """Write ``path`` with one ``resolutions/{res}`` cooler per entry of ``scools``,
    plus coarser ``extra`` resolutions (multiples of the finest: zoom levels).

    Parameters
    ----------
    path
        Output .mcool (written under a temporary name, renamed when complete).
    scools
        Resolution (bp) -> .scool path holding ``cells`` at that resolution.
    cells
        Cell names to pool (their counts are summed, int64).
    balance
        ICE-balance every level (cooler defaults); sparse data may not converge, which
        is logged and recorded in the report, not fatal.
    extra
        Further resolutions, each a multiple of the finest.
    map
        Map over pixel chunks used by balancing (e.g. a ``multiprocessing.Pool``'s).
    block
        Cells per first-level merge block. One k-way merge of many cells reads a slice of
        every cell per epoch: 1,196 cells of 40k contacts at 100 kb took 196 s in one
        merge, 37 s in blocks of 64 (then one merge of the 19 blocks); blocks of 16 or
        128 were no faster.
    chunksize
        Pixel records held at once: merge epoch, coarsening chunk, balancing chunk.

    Returns
    -------
    dict
        Per resolution: pixels, contacts, balanced (and balance_error when it failed).
    """
    import cooler
    import h5py

    if not cells:
        raise InputError("no cell to pool", key="cells", value=cells)
    plan = plan_levels(scools, extra)
    report = {}
    path = Path(path)
    with atomic_path(path) as tmp, tempfile.TemporaryDirectory(dir=path.parent, prefix=f".tmp-blocks-{path.name}-") as work:
        for i, (res, src) in enumerate(plan.items()):
            uri = f"{tmp}::resolutions/{res}"
            t0 = time.monotonic()
            if src is None:
                merge_cells(uri, scools[res], cells, work, f"{res} bp", mode="w" if i == 0 else "r+", block=block, mergebuf=chunksize)
            else:
                coarsen(str(tmp), src, res, chunksize)
            clr = cooler.Cooler(uri)
            entry = {"pixels": int(clr.info["nnz"]), "contacts": int(clr.info["sum"]), "balanced": False}
            log.info("pseudobulk %d bp: %d contacts in %d pixels (%s, %.1f s)", res, entry["contacts"], entry["pixels"],
                     "merged from its .scool" if src is None else f"coarsened from {src} bp", time.monotonic() - t0)  # fmt: skip
            if balance:
                entry.update(balance_level(uri, f"{res} bp", map=map, chunksize=chunksize))
            report[int(res)] = entry
        with h5py.File(tmp, "r+") as f:
            f.attrs.update(MCOOL_FORMAT)
    return report
