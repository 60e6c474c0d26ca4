"""The strata file: cells x (bin, bin + k) features, stratum-major, as AnnData.

A feature is a cis bin pair (i, i + k) on one chromosome; k is its stratum (0 = the
diagonal, whose features are the anchors). Features of strata k >= 1 are kept only if
seen in at least ``min_cells`` cells with at least ``min_count`` contacts in total,
counted over the training cells when some are held out.

The file is built in two passes over the cells of the ``.scool``, so memory is bounded
by one cell, one HDF5 chunk and the feature index, never by the number of cells: the
first pass counts, per candidate feature, the cells it is seen in and its contacts (the
filter); the second streams the kept features' counts, cell by cell, into the ``X`` of
the ``.h5ad`` (:func:`write_strata`). The counts are stored once, in ``X``.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass

import anndata as ad
import h5py
import numpy as np
import pandas as pd
import scipy.sparse as sp

from ..base.errors import InputError
from ..base.progress import Progress
from ..contract.layout import SPLIT_COLUMN, SPLIT_VALUES, TRAIN, feature_names
from ..io.cool import cell_bins
from ..io.h5ad import HDF5_ERRORS, damaged

log = logging.getLogger(__name__)

#: Cells read per opening of the ``.scool`` (see :func:`_cell_rows`).
BLOCK_CELLS = 32

#: Elements per HDF5 chunk of ``X/data`` and ``X/indices`` (1 MiB of float32): also the
#: write buffer of :func:`write_strata`.
CHUNK_ELEMENTS = 1 << 18


def candidate_index(bins: pd.DataFrame, chroms: list[str], n_strata: int) -> tuple[np.ndarray, pd.DataFrame]:
    """Enumerate every possible feature before filtering.

    Returns
    -------
    lut : (n_strata, n_bins) int64
        Candidate feature index of (anchor bin b, stratum k), or -1 where b is not on a
        kept chromosome or b + k leaves b's chromosome.
    var : DataFrame
        One row per candidate: chrom, start, end (of the anchor bin), anchor, stratum.
    """
    n_bins = len(bins)
    chrom = bins["chrom"].astype(str).to_numpy()
    kept = np.isin(chrom, chroms)
    anchor_of_bin = np.full(n_bins, -1, dtype=np.int64)
    anchor_of_bin[kept] = np.arange(int(kept.sum()))
    lut = np.full((n_strata, n_bins), -1, dtype=np.int64)
    frames = []
    offset = 0
    for k in range(n_strata):
        valid = kept.copy()
        if k:
            valid[n_bins - k :] = False
            valid[: n_bins - k] &= chrom[k:] == chrom[: n_bins - k]
        idx = np.nonzero(valid)[0]
        lut[k, idx] = offset + np.arange(len(idx))
        offset += len(idx)
        frames.append(
            pd.DataFrame(
                {
                    "chrom": chrom[idx],
                    "start": bins["start"].to_numpy()[idx],
                    "end": bins["end"].to_numpy()[idx],
                    "anchor": anchor_of_bin[idx],
                    "stratum": k,
                }
            )
        )
    return lut, pd.concat(frames, ignore_index=True)


@contextmanager
def _open(scool):
    try:
        f = h5py.File(scool, "r")
    except HDF5_ERRORS as e:
        raise damaged(scool, e, "cannot open") from None
    with f:
        yield f


def _pixels(f, scool, cell: str, n_bins: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``bin1_id, bin2_id, count`` (int64) of one cell, checked: a damaged .scool is an
    InputError naming it (HDF5 keeps no checksum of what it stores uncompressed)."""
    try:
        grp = f["cells"]
    except HDF5_ERRORS as e:
        raise damaged(scool, e, "no cells group") from None
    if cell not in grp:
        raise InputError("cell is not in the .scool", path=scool, key="cells", value=cell)
    try:
        px = grp[cell]["pixels"]
        b1, b2, n = (px[c][:].astype(np.int64, copy=False) for c in ("bin1_id", "bin2_id", "count"))
    except HDF5_ERRORS as e:
        raise damaged(scool, e, f"cannot read pixels of cell {cell!r}") from None
    bad = (b1 < 0) | (b1 >= n_bins) | (b2 < b1) | (b2 >= n_bins) | (n < 0)
    if len(b1) != len(b2) or len(b1) != len(n) or bad.any():
        raise InputError("pixels are damaged (bin ids off the bin table, or negative counts)", path=scool, key=cell)
    return b1, b2, n


def _cell_rows(scool: str, cells: list[str], table: np.ndarray, block: int):
    """Per cell of ``cells``, its ``(columns, counts)`` under ``table``.

    ``table`` is (n_strata, n_bins): the column of (stratum k, anchor bin b), -1 for none,
    like :func:`candidate_index`'s ``lut``. Columns come ascending and unique, counts
    int64. The file is opened again every ``block`` cells: while it is open HDF5 keeps
    metadata of every group visited (about 60 kB per cell), which would otherwise grow
    with the cell count.
    """
    if block < 1:
        raise InputError("must be >= 1", key="block", value=block)
    n_strata, n_bins = table.shape
    for start in range(0, len(cells), block):
        with _open(scool) as f:
            for cell in cells[start : start + block]:
                b1, b2, n = _pixels(f, scool, cell, n_bins)
                k = b2 - b1
                sel = (k >= 0) & (k < n_strata)
                # the table is -1 where b + k leaves b's chromosome: trans pixels drop out here
                col = table[k[sel], b1[sel]]
                ok = col >= 0
                col, n = col[ok], n[sel][ok]
                order = np.argsort(col, kind="stable")
                col, n = col[order], n[order]
                if len(col) > 1 and not (np.diff(col) > 0).all():
                    # a pixel listed twice: its counts add up (a valid cooler has none)
                    col, inverse = np.unique(col, return_inverse=True)
                    n = np.bincount(inverse, weights=n, minlength=len(col)).astype(np.int64)
                yield col, n


@dataclass
class StrataFeatures:
    """What the counting pass decides: the features and where each pixel goes.

    Attributes
    ----------
    resolution
        Bin size of the ``.scool`` (bp).
    columns
        (n_strata, n_bins) int64: the column of ``X`` for (stratum k, anchor bin b), -1
        where that candidate is not a feature (off the chromosomes, or filtered out).
    var
        The kept features (n_features rows), named by :func:`~ampflow.contract.layout.feature_names`.
    n_candidates
        Candidate features before the filter.
    nnz
        Stored entries of ``X`` over every cell.
    filter_cells
        Cells the filter counted (the training cells, or every cell without a split).
    """

    resolution: int
    columns: np.ndarray
    var: pd.DataFrame
    n_candidates: int
    nnz: int
    filter_cells: int


def count_features(
    scool: str,
    cells: list[str],
    chroms: list[str],
    n_strata: int,
    min_cells: int = 1,
    min_count: int = 1,
    split=None,
    block: int = BLOCK_CELLS,
) -> StrataFeatures:
    """First pass: count every candidate feature over the cells and choose the kept ones.

    Memory holds one cell's pixels and three (n_candidates,) int64 counters: the cells a
    candidate has a non-zero count in and its total contacts (training cells only when
    ``split`` is given), and its stored entries over every cell (the size of ``X``).
    Parameters as :func:`build_strata`.
    """
    if n_strata < 1:
        raise InputError("must be >= 1", key="strata", value=n_strata)
    if not cells:
        raise InputError("no cells to build the strata file from (did every cell fail QC?)", path=scool)
    bins, resolution = cell_bins(scool, cells[0])
    lut, cand = candidate_index(bins, chroms, n_strata)
    train = np.ones(len(cells), dtype=bool) if split is None else np.asarray(split) == TRAIN

    n_cand = len(cand)
    n_cells_seen = np.zeros(n_cand, dtype=np.int64)
    totals = np.zeros(n_cand, dtype=np.int64)
    entries = np.zeros(n_cand, dtype=np.int64)
    progress = Progress(len(cells), "cells", log, verb="counted")
    for i, (f, n) in enumerate(_cell_rows(scool, cells, lut, block)):
        entries[f] += 1  # f is unique within a cell
        if train[i]:
            n_cells_seen[f[n > 0]] += 1
            totals[f] += n
        progress.update()

    keep = (cand["stratum"].to_numpy() == 0) | ((n_cells_seen >= min_cells) & (totals >= min_count))
    column_of = np.full(n_cand + 1, -1, dtype=np.int64)  # the extra last -1 maps lut's -1
    column_of[np.flatnonzero(keep)] = np.arange(int(keep.sum()))
    var = cand[keep].reset_index(drop=True)
    var.index = pd.Index(feature_names(var), name="feature")
    return StrataFeatures(
        resolution=resolution,
        columns=column_of[lut],
        var=var,
        n_candidates=n_cand,
        nnz=int(entries[keep].sum()),
        filter_cells=int(train.sum()),
    )


def _rows(scool: str, cells: list[str], feats: StrataFeatures, block: int, verb: str):
    """Second pass: per cell, the ``(indices int32, data float32)`` of its kept features."""
    progress = Progress(len(cells), "cells", log, verb=verb)
    for f, n in _cell_rows(scool, cells, feats.columns, block):
        yield f.astype(np.int32), n.astype(np.float32)
        progress.update()


def _obs(cells: list[str], obs: pd.DataFrame | None, split) -> pd.DataFrame:
    obs_df = pd.DataFrame(index=pd.Index(cells, name="cell_id"))
    if obs is not None:
        obs_df = obs_df.join(obs.drop(columns=[c for c in ("cell_id",) if c in obs.columns]), how="left")
    if split is not None:
        obs_df[SPLIT_COLUMN] = pd.Categorical(np.asarray(split).astype(str), categories=list(SPLIT_VALUES))
    return obs_df


def _uns(feats: StrataFeatures, chroms, n_strata, min_cells, min_count, split) -> dict:
    per_stratum = np.bincount(feats.var["stratum"].to_numpy(), minlength=n_strata)
    uns = {
        "modality": "hic",
        "prob_model": "HiCZINB",
        "resolution": feats.resolution,
        "n_strata": int(n_strata),
        "n_anchors": int(per_stratum[0]),
        "features_per_stratum": per_stratum.astype(np.int64),
        "chromosomes": list(chroms),
        "min_cells": int(min_cells),
        "min_count": int(min_count),
    }
    if split is not None:
        uns["filter_cells"] = feats.filter_cells
    log.info(
        "strata: %d features (%s per stratum), %d of %d candidates kept, %d non-zeros",
        len(feats.var),
        ",".join(map(str, per_stratum)),
        len(feats.var),
        feats.n_candidates,
        feats.nnz,
    )
    return uns


def build_strata(
    scool: str,
    cells: list[str],
    chroms: list[str],
    n_strata: int,
    min_cells: int = 1,
    min_count: int = 1,
    obs: pd.DataFrame | None = None,
    split=None,
    block: int = BLOCK_CELLS,
) -> ad.AnnData:
    """Read ``cells`` from a .scool and build the strata AnnData in memory.

    :func:`write_strata` writes the same file without holding the matrix; this returns
    it, for callers that want it at hand.

    Parameters
    ----------
    scool
        Path of the .scool written by the binning step.
    cells
        Cell names to include, in the order of the output's rows.
    chroms
        Chromosomes whose bins become anchors.
    n_strata
        Number of strata L (k = 0 .. L-1).
    min_cells, min_count
        Feature filter for strata k >= 1.
    obs
        Optional per-cell metadata (indexed by cell id) joined into ``obs``.
    split
        Optional ``train`` / ``heldout`` per cell of ``cells``: the feature filter counts
        the training cells only (held-out cells stay in the file) and ``obs["split"]``
        records the split. None: the filter counts every cell.
    block
        Cells read per opening of the .scool.

    Returns
    -------
    AnnData
        ``X`` (n_cells, n_features) float32 CSR of the raw counts; ``var`` chrom, start,
        end, anchor, stratum; ``uns["ampflow"]`` modality, prob_model, resolution,
        n_strata, n_anchors, features_per_stratum, chromosomes, min_cells, min_count
        (and filter_cells with a split).
    """
    feats = count_features(scool, cells, chroms, n_strata, min_cells, min_count, split, block)
    indices, data = zip(*_rows(scool, cells, feats, block, "read"))
    indptr = np.zeros(len(cells) + 1, dtype=np.int64)
    np.cumsum([len(i) for i in indices], out=indptr[1:])
    X = sp.csr_matrix((np.concatenate(data), np.concatenate(indices), indptr), shape=(len(cells), len(feats.var)))
    adata = ad.AnnData(X=X, obs=_obs(cells, obs, split), var=feats.var)
    adata.uns["ampflow"] = _uns(feats, chroms, n_strata, min_cells, min_count, split)
    return adata


class _ChunkedAppend:
    """Fill a preallocated 1-d dataset from the front, in whole chunks but the last (so
    each chunk is compressed once), buffering less than a chunk between appends."""

    def __init__(self, ds: h5py.Dataset, chunk: int):
        self.ds, self.chunk, self.pos = ds, chunk, 0
        self.pending: list[np.ndarray] = []
        self.n_pending = 0

    def append(self, a: np.ndarray) -> None:
        if self.n_pending + len(a) < self.chunk:
            self.pending.append(a)
            self.n_pending += len(a)
            return
        if self.n_pending:
            head = self.chunk - self.n_pending
            self._write(np.concatenate([*self.pending, a[:head]]))
            a = a[head:]
        bulk = len(a) - len(a) % self.chunk
        if bulk:
            self._write(a[:bulk])
        self.pending = [a[bulk:]]
        self.n_pending = len(a) - bulk

    def close(self) -> None:
        if self.n_pending:
            self._write(np.concatenate(self.pending))
        self.pending, self.n_pending = [], 0
        if self.pos != len(self.ds):
            raise RuntimeError(f"{self.ds.name}: {self.pos} entries written, {len(self.ds)} counted; did the .scool change?")

    def _write(self, buf: np.ndarray) -> None:
        if self.pos + len(buf) > len(self.ds):
            raise RuntimeError(f"{self.ds.name}: more entries than the counting pass found ({len(self.ds)}); did the .scool change?")
        self.ds[self.pos : self.pos + len(buf)] = buf
        self.pos += len(buf)


def write_strata(
    scool: str,
    cells: list[str],
    chroms: list[str],
    n_strata: int,
    out,
    min_cells: int = 1,
    min_count: int = 1,
    obs: pd.DataFrame | None = None,
    split=None,
    block: int = BLOCK_CELLS,
    chunk: int = CHUNK_ELEMENTS,
    compression: str | None = "gzip",
) -> dict:
    """Write the strata ``.h5ad`` of ``cells`` to ``out``, streaming the counts.

    The file holds what :func:`build_strata` returns, laid out as ``anndata`` writes it
    (``X`` a ``csr_matrix`` group: ``data`` float32, ``indices`` int32, ``indptr`` int32,
    or int64 from 2**31 non-zeros on), so ``anndata.read_h5ad`` reads it back. Peak
    memory is one cell, one chunk and the feature index; only ``indptr`` (8 bytes a cell)
    grows with the cells. ``out`` is written in place: for an atomic file pass a
    temporary path (:func:`ampflow.base.atomic.atomic_path`).

    Parameters
    ----------
    out
        The ``.h5ad`` to write.
    chunk
        Elements per HDF5 chunk of ``X/data`` and ``X/indices``.
    compression
        HDF5 filter of every dataset (``gzip``, ``lzf`` or None).
    Other parameters as :func:`build_strata`.

    Returns
    -------
    dict
        ``uns["ampflow"]`` of the file.
    """
    if chunk < 1:
        raise InputError("must be >= 1", key="chunk", value=chunk)
    feats = count_features(scool, cells, chroms, n_strata, min_cells, min_count, split, block)
    n_cells, n_features = len(cells), len(feats.var)
    uns = _uns(feats, chroms, n_strata, min_cells, min_count, split)
    # obs, var and uns as anndata writes them; X is added below
    skeleton = ad.AnnData(obs=_obs(cells, obs, split), var=feats.var)
    skeleton.uns["ampflow"] = uns
    skeleton.write_h5ad(out, compression=compression)
    del skeleton

    indptr = np.zeros(n_cells + 1, dtype=np.int64)
    with h5py.File(out, "r+") as f:
        g = f.create_group("X")
        g.attrs["encoding-type"] = "csr_matrix"
        g.attrs["encoding-version"] = "0.1.0"
        g.attrs["shape"] = np.array([n_cells, n_features], dtype=np.int64)
        kw = {"compression": compression} if compression else {}
        chunks = (max(1, min(feats.nnz, chunk)),)
        data = _ChunkedAppend(g.create_dataset("data", shape=(feats.nnz,), dtype=np.float32, chunks=chunks, **kw), chunk)
        indices = _ChunkedAppend(g.create_dataset("indices", shape=(feats.nnz,), dtype=np.int32, chunks=chunks, **kw), chunk)
        for i, (row_indices, row_data) in enumerate(_rows(scool, cells, feats, block, "written")):
            indptr[i + 1] = indptr[i] + len(row_indices)
            indices.append(row_indices)
            data.append(row_data)
        data.close()
        indices.close()
        g.create_dataset("indptr", data=indptr.astype(np.int32 if feats.nnz < 2**31 else np.int64), **kw)
    log.info("wrote %d cells x %d features (%d non-zeros) to %s", n_cells, n_features, feats.nnz, out)
    return uns
