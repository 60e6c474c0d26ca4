"""The RNA model file: passing cells, rounded counts, genes placed on the genome, HVGs
(chosen from the training cells when some are held out)."""

from __future__ import annotations

import logging

import anndata as ad
import numpy as np
import pandas as pd

from ..base.errors import InputError
from ..contract.layout import SPLIT_COLUMN, SPLIT_VALUES, TRAIN

log = logging.getLogger(__name__)


def place_genes(var_names: pd.Index, genes: pd.DataFrame) -> pd.DataFrame:
    """Annotation rows (chrom, start, end, strand, gene_id) for each RNA gene, by symbol
    first and Ensembl id (version stripped) second; unplaced genes get NaN."""
    by_name = genes.drop_duplicates("name").set_index("name")
    by_id = genes.assign(gid=genes["gene_id"].str.split(".").str[0]).drop_duplicates("gid").set_index("gid")
    cols = ["chrom", "start", "end", "strand", "gene_id"]
    placed = by_name.reindex(var_names)[cols]
    missing = placed["chrom"].isna().to_numpy()
    if missing.any():
        ids = pd.Index([str(v).split(".")[0] for v in var_names[missing]])
        placed.loc[missing, cols] = by_id.reindex(ids)[cols].to_numpy()
    placed.index = var_names
    return placed


def build_rna(counts: ad.AnnData, cells: list[str], genes: pd.DataFrame, n_top_genes: int, obs=None, split=None) -> ad.AnnData:
    """Subset ``counts`` (cells x genes, rounded) to ``cells`` and to HVGs on the genome.

    HVGs: scanpy's ``seurat`` flavour on log1p(library-normalised) counts, among genes
    with an annotation position and nonzero counts in the fitted cells.

    ``split`` (one of ``train`` / ``heldout`` per cell of ``cells``) holds cells out of
    the gene choice: the genes are chosen from the training cells alone, every cell stays
    in the file, and ``obs["split"]`` records the split. None: every cell is fitted on.
    """
    import scanpy as sc

    a = _cells(counts, cells)
    fit = np.ones(len(cells), dtype=bool) if split is None else np.asarray(split) == TRAIN
    placed = place_genes(a.var_names, genes)
    on_genome = placed["chrom"].notna().to_numpy()
    expressed = np.asarray(a.X[fit].sum(axis=0)).ravel() > 0
    log.info(
        "genes: %d in matrix, %d placed on the genome, %d of those expressed in the %d %s cells",
        a.n_vars,
        int(on_genome.sum()),
        int((on_genome & expressed).sum()),
        int(fit.sum()),
        "passing" if split is None else "training",
    )
    if not (on_genome & expressed).any():
        raise InputError("no expressed RNA gene matches a gene of the annotation (by symbol or id)", key="genes")
    a = a[:, on_genome & expressed].copy()
    for c in ("chrom", "strand", "gene_id"):
        a.var[c] = placed.loc[a.var_names, c].astype(str).to_numpy()
    for c in ("start", "end"):
        a.var[c] = placed.loc[a.var_names, c].astype(np.int64).to_numpy()

    norm = a[fit].copy()
    sc.pp.normalize_total(norm, target_sum=1e4)
    sc.pp.log1p(norm)
    n_top = min(n_top_genes, a.n_vars)
    sc.pp.highly_variable_genes(norm, n_top_genes=n_top, flavor="seurat")
    hvg = norm.var["highly_variable"].to_numpy()
    a = _finish(a[:, hvg].copy(), counts, obs, split)
    a.uns["ampflow"]["hvg"] = {"flavor": "seurat", "n_top_genes": int(n_top_genes), "n_selected": int(hvg.sum())}
    if split is not None:
        a.uns["ampflow"]["hvg"]["fitted_cells"] = int(fit.sum())
    log.info("rna: %d cells x %d HVGs", a.n_obs, a.n_vars)
    return a


def all_genes_rna(counts: ad.AnnData, cells: list[str], obs=None) -> ad.AnnData:
    """``counts`` (cells x genes, rounded) subset to ``cells``, every gene kept.

    The RNA file of cells to embed with a trained model: nothing is chosen from these
    cells (no HVGs, no annotation filter); the model's genes are picked out by name when
    embedding. The counts, ``obs`` and ``uns`` are those :func:`build_rna` writes, so a
    cell's counts on a gene are the same in both files.
    """
    a = _finish(_cells(counts, cells), counts, obs, None)
    a.uns["ampflow"]["hvg"] = {"flavor": "none", "n_selected": int(a.n_vars)}
    log.info("rna: %d cells x %d genes (all genes kept: nothing fitted)", a.n_obs, a.n_vars)
    return a


def _cells(counts: ad.AnnData, cells: list[str]) -> ad.AnnData:
    missing = [c for c in cells if c not in counts.obs_names]
    if missing:
        raise InputError("cells passed QC but are missing from the RNA counts", key="cells", value=missing[:5])
    return counts[cells].copy()


def _finish(a: ad.AnnData, counts: ad.AnnData, obs, split) -> ad.AnnData:
    """The counts layer, ``obs`` (QC metadata, split) and ``uns["ampflow"]`` of an RNA file."""
    a.layers["counts"] = a.X.copy()
    if obs is not None:
        extra = obs.drop(columns=[c for c in obs.columns if c in a.obs.columns or c == "cell_id"])
        a.obs = a.obs.join(extra, how="left")
    if split is not None:
        a.obs[SPLIT_COLUMN] = pd.Categorical(np.asarray(split).astype(str), categories=list(SPLIT_VALUES))
    a.obs.index.name = "cell_id"
    a.uns["ampflow"] = {
        "modality": "rna",
        "prob_model": "NB",
        "counts_layer": "counts",
        "rounding": dict(counts.uns.get("ampflow", {}).get("rounding", {})),
    }
    return a
