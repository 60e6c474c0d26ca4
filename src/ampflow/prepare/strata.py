"""The strata file: cells x (bin, bin + k) features, stratum-major, as AnnData.

A feature is a cis bin pair (i, i + k) on one chromosome; k is its stratum (0 = the
diagonal, whose features are the anchors). Features of strata k >= 1 are kept only if
seen in at least ``min_cells`` cells with at least ``min_count`` contacts in total,
counted over the training cells when some are held out.
"""

from __future__ import annotations

import logging

import anndata as ad
import numpy as np
import pandas as pd
import scipy.sparse as sp

from ..io.cool import cell_bins, cell_pixels
from ..io.errors import InputError
from ..progress import Progress
from ..spec.layout import SPLIT_COLUMN, SPLIT_VALUES, TRAIN, feature_names

log = logging.getLogger(__name__)


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


def build_strata(
    scool: str,
    cells: list[str],
    chroms: list[str],
    n_strata: int,
    min_cells: int = 1,
    min_count: int = 1,
    obs: pd.DataFrame | None = None,
    split=None,
) -> ad.AnnData:
    """Read ``cells`` from a .scool and build the strata AnnData.

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
    """
    if n_strata < 1:
        raise InputError("must be >= 1", key="strata", value=n_strata)
    if not cells:
        raise InputError("no cells to build the strata file from (did every cell fail QC?)", path=scool)
    bins, resolution = cell_bins(scool, cells[0])
    lut, cand = candidate_index(bins, chroms, n_strata)
    chrom_of_bin = bins["chrom"].astype(str).to_numpy()

    rows, cols, vals = [], [], []
    progress = Progress(len(cells), "cells", log, verb="stratified")
    for i, cell in enumerate(cells):
        px = cell_pixels(scool, cell, len(bins))
        b1 = px["bin1_id"].to_numpy()
        b2 = px["bin2_id"].to_numpy()
        k = b2 - b1
        sel = (k < n_strata) & (chrom_of_bin[b1] == chrom_of_bin[b2])
        f = lut[k[sel], b1[sel]]
        ok = f >= 0
        cols.append(f[ok])
        vals.append(px["count"].to_numpy()[sel][ok])
        rows.append(np.full(int(ok.sum()), i, dtype=np.int64))
        progress.update()
    X = sp.csr_matrix(
        (np.concatenate(vals).astype(np.float32), (np.concatenate(rows), np.concatenate(cols))),
        shape=(len(cells), len(cand)),
    )
    X.sum_duplicates()

    fit = X if split is None else X[np.flatnonzero(np.asarray(split) == TRAIN)]
    n_cells_seen = np.asarray((fit > 0).sum(axis=0)).ravel()
    totals = np.asarray(fit.sum(axis=0)).ravel()
    keep = (cand["stratum"].to_numpy() == 0) | ((n_cells_seen >= min_cells) & (totals >= min_count))
    X = X[:, np.nonzero(keep)[0]].tocsr()
    var = cand[keep].reset_index(drop=True)
    var.index = pd.Index(feature_names(var), name="feature")
    per_stratum = np.bincount(var["stratum"].to_numpy(), minlength=n_strata)

    obs_df = pd.DataFrame(index=pd.Index(cells, name="cell_id"))
    if obs is not None:
        obs_df = obs_df.join(obs.drop(columns=[c for c in ("cell_id",) if c in obs.columns]), how="left")
    if split is not None:
        obs_df[SPLIT_COLUMN] = pd.Categorical(np.asarray(split).astype(str), categories=list(SPLIT_VALUES))
    adata = ad.AnnData(X=X, obs=obs_df, var=var)
    adata.layers["counts"] = X.copy()
    adata.uns["ampflow"] = {
        "modality": "hic",
        "prob_model": "HiCZINB",
        "resolution": resolution,
        "n_strata": int(n_strata),
        "n_anchors": int(per_stratum[0]),
        "features_per_stratum": per_stratum.astype(np.int64),
        "chromosomes": list(chroms),
        "min_cells": int(min_cells),
        "min_count": int(min_count),
        "counts_layer": "counts",
    }
    if split is not None:
        adata.uns["ampflow"]["filter_cells"] = int(fit.shape[0])
    log.info(
        "strata: %d cells x %d features (%s per stratum), %d of %d candidates kept",
        adata.n_obs,
        adata.n_vars,
        ",".join(map(str, per_stratum)),
        int(keep.sum()),
        len(cand),
    )
    return adata
