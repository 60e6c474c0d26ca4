"""Single-modality baselines: what plain PCA of each modality's counts gets without the model.

A joint embedding is worth training only if it separates cell types better than
the standard pipeline of either modality alone. Both baselines embed every cell of
the data folder, and learn what they learn (genes, scaling, principal axes) from
training cells only, as the model does, so that held-out cells are new to them too:

* :func:`rna_baseline`: scanpy's pipeline on ``rna.h5ad`` counts: ``normalize_total``
  (1e4 per cell), ``log1p``, ``highly_variable_genes`` (``seurat`` flavour), PCA;
* :func:`hic_baseline`: scHiCluster-style PCA of the strata features of ``hic.h5ad``:
  counts / cell total, ``log1p``, each stratum scaled to unit root mean square, PCA;
* :func:`bandnorm_baseline`: BandNorm-style PCA of the same features: each band
  divided by the cell's band mean and multiplied by the population's, ``log1p``, PCA 20.

:func:`load_baselines` reads the data folder (:class:`~ampflow.contract.layout.DataFolder`)
and returns both embeddings row-aligned with the embeddings file's cells; they are
then clustered and scored exactly like the model's latents.
"""

from __future__ import annotations

import logging

import anndata as ad
import numpy as np
import pandas as pd
import scipy.sparse as sp

from ..base.errors import InputError, require_file
from ..contract.layout import DataFolder, strata_from_names
from .groups import SPLIT_KEY, fit_mask, split_labels

log = logging.getLogger(__name__)

#: Highly variable genes kept by the RNA baseline (scanpy tutorials' choice).
N_TOP_GENES = 2000

#: Principal components of each baseline (scanpy's default).
N_COMPS = 50

#: Per-cell library size the RNA baseline normalises to (as the prepare step does).
RNA_TARGET_SUM = 1e4


def counts_matrix(adata: ad.AnnData) -> sp.csr_matrix:
    """The raw counts of a model file: the layer ``uns["ampflow"]["counts_layer"]`` names, else ``X``."""
    layer = adata.uns.get("ampflow", {}).get("counts_layer", "counts")
    x = adata.layers[layer] if layer in adata.layers else adata.X
    return sp.csr_matrix(x, dtype=np.float64)


def strata_counts(adata: ad.AnnData, path=None) -> tuple[sp.csr_matrix, np.ndarray]:
    """The counts of a strata file and each feature's stratum (``var["stratum"]``, or
    inferred from the feature names)."""
    x = counts_matrix(adata)
    if "stratum" in adata.var.columns:
        return x, adata.var["stratum"].to_numpy().astype(np.int64)
    return x, strata_from_names(adata.var_names.to_numpy(), path, "var_names")[0]


def pca_fit_transform(x, fit: np.ndarray, n_comps: int, seed: int = 0) -> np.ndarray:
    """Principal axes learned from the rows ``fit`` of ``x``, every row projected on them.

    Parameters
    ----------
    x
        ``(n_cells, n_features)``, dense or sparse. Sparse input is centred implicitly
        (ARPACK), so a wide strata matrix is never densified.
    fit
        Boolean ``(n_cells,)``: rows the axes and the centre are learned from.
    n_comps
        Components wanted; fewer when the fit rows or the features cannot give them.
    seed
        Random state of the ARPACK start vector.

    Returns
    -------
    numpy.ndarray
        ``(n_cells, k)`` float32 coordinates, ``k = min(n_comps, n_fit - 1, n_features - 1)``.
    """
    from sklearn.decomposition import PCA

    n_fit = int(fit.sum())
    k = min(n_comps, n_fit - 1, x.shape[1] - 1)
    if k < 1:
        raise InputError(f"PCA needs at least 2 fit cells and 2 features, got {n_fit} cells and {x.shape[1]} features")
    pca = PCA(n_components=k, svd_solver="arpack", random_state=seed).fit(x[fit])
    log.info("PCA: %d components from %d cells, %.1f%% of their variance", k, n_fit, 100 * pca.explained_variance_ratio_.sum())
    return np.asarray(pca.transform(x), dtype=np.float32)


def rna_baseline(adata: ad.AnnData, fit: np.ndarray, n_top_genes: int = N_TOP_GENES, n_comps: int = N_COMPS, seed: int = 0):
    """scanpy's standard RNA embedding of every cell, genes and axes learned from ``fit`` cells.

    Parameters
    ----------
    adata
        ``rna.h5ad``: cells x genes with counts (see :func:`counts_matrix`).
    fit
        Boolean ``(n_cells,)``: the training cells.
    n_top_genes
        Highly variable genes kept (all genes when there are fewer).
    n_comps
        Principal components.
    seed
        Random state of the PCA.

    Returns
    -------
    embedding, info
        ``(n_cells, k)`` float32 PCA coordinates, and a dict saying how it was made.
    """
    import scanpy as sc

    norm = ad.AnnData(X=counts_matrix(adata))
    sc.pp.normalize_total(norm, target_sum=RNA_TARGET_SUM)  # per cell only: no other cell involved
    sc.pp.log1p(norm)
    n_top = min(n_top_genes, norm.n_vars)
    train = norm[fit].copy()
    # genes with no count in the training cells have no dispersion to rank
    seen = np.asarray(train.X.sum(axis=0)).ravel() > 0
    train = train[:, seen].copy()
    sc.pp.highly_variable_genes(train, n_top_genes=min(n_top, train.n_vars), flavor="seurat")
    genes = np.flatnonzero(seen)[train.var["highly_variable"].to_numpy()]
    log.info("RNA baseline: %d highly variable genes of %d, chosen on %d training cells", len(genes), norm.n_vars, int(fit.sum()))
    emb = pca_fit_transform(norm.X[:, genes], fit, n_comps, seed)
    info = {
        "steps": "normalize_total (1e4 per cell), log1p, highly_variable_genes (seurat), PCA",
        "n_genes": int(norm.n_vars),
        "n_top_genes": int(n_top_genes),
        "n_hvg": int(len(genes)),
        "n_comps": int(emb.shape[1]),
    }
    return emb, info


def hic_baseline(adata: ad.AnnData, fit: np.ndarray, n_comps: int = N_COMPS, seed: int = 0, path=None):
    """scHiCluster-style embedding of every cell's strata features, scaling and axes from ``fit`` cells.

    Each cell's counts are divided by its total and multiplied by the training cells'
    median total (so ``log1p`` sees counts of a typical cell's depth), then
    ``log1p``. Near-diagonal strata hold most contacts (distance decay); without a
    per-stratum scale they would decide the principal axes alone, so each stratum is
    divided by its root mean square over the training cells and every stratum's
    features weigh alike.

    Parameters
    ----------
    adata
        ``hic.h5ad``: cells x strata features with counts; ``var["stratum"]``, or
        feature names ``chrom:start-end[-k]`` to infer it from.
    fit
        Boolean ``(n_cells,)``: the training cells.
    n_comps
        Principal components.
    seed
        Random state of the PCA.
    path
        The file, named in errors.

    Returns
    -------
    embedding, info
        ``(n_cells, k)`` float32 PCA coordinates, and a dict saying how it was made.
    """
    x, stratum = strata_counts(adata, path)
    total = np.asarray(x.sum(axis=1)).ravel()
    depth = float(np.median(total[fit]))
    empty = total <= 0
    if empty.any():
        log.warning("Hi-C baseline: %d cells without contacts stay at the origin", int(empty.sum()))
    x = sp.diags(np.where(empty, 0.0, depth / np.where(empty, 1.0, total))) @ x
    x = x.tocsr()
    x.data = np.log1p(x.data)  # log1p(0) = 0: sparsity kept
    sq = np.asarray(x[fit].power(2).sum(axis=0)).ravel()
    n_strata = int(stratum.max()) + 1 if len(stratum) else 0
    per_stratum = np.bincount(stratum, weights=sq, minlength=n_strata)
    size = np.bincount(stratum, minlength=n_strata) * int(fit.sum())
    rms = np.sqrt(np.divide(per_stratum, size, out=np.zeros(n_strata), where=size > 0))
    scale = np.divide(1.0, rms, out=np.zeros(n_strata), where=rms > 0)[stratum]
    x = (x @ sp.diags(scale)).tocsr()
    log.info("Hi-C baseline: %d features in %d strata, %d training cells (median %.0f contacts)", x.shape[1], n_strata, int(fit.sum()), depth)
    emb = pca_fit_transform(x, fit, n_comps, seed)
    info = {
        "steps": "counts / cell total x median total, log1p, each stratum / its RMS, PCA",
        "n_features": int(x.shape[1]),
        "n_strata": n_strata,
        "median_total": depth,
        "n_comps": int(emb.shape[1]),
    }
    return emb, info


#: Principal components of the BandNorm-style baseline (as its authors' example uses).
BANDNORM_COMPS = 20


def bandnorm_baseline(
    adata: ad.AnnData, fit: np.ndarray, n_comps: int = BANDNORM_COMPS, seed: int = 0, log1p: bool = True, max_stratum: int | None = None, path=None
):
    """BandNorm-style embedding (Zheng et al. 2022): band normalisation, ``log1p``, PCA.

    Strata k >= 1 only (the diagonal holds self-ligations and intra-bin contacts), up to
    ``max_stratum`` (None: all). Each
    cell's band k is divided by the cell's mean over that band and multiplied by the
    training cells' mean of those band means, which removes each cell's distance decay
    and depth while keeping the population's; then ``log1p`` (``log1p=False``: none) and
    PCA with axes and centre from the ``fit`` cells.

    Returns
    -------
    embedding, info
        ``(n_cells, k)`` float32 PCA coordinates, and a dict saying how it was made.
    """
    x, stratum = strata_counts(adata, path)
    keep = (stratum >= 1) & (stratum <= (max_stratum if max_stratum is not None else stratum.max()))
    if not keep.any():
        read = "strata k >= 1" if max_stratum is None else f"strata 1 <= k <= {max_stratum}"
        raise InputError(f"the BandNorm baseline needs {read}; the file has strata {int(stratum.min())}-{int(stratum.max())}", path=path)
    x, stratum = x[:, keep].tocsr(), stratum[keep]
    n_strata = int(stratum.max()) + 1
    size = np.bincount(stratum, minlength=n_strata).astype(np.float64)
    band_sum = (x @ sp.csr_matrix((np.ones(len(stratum)), (np.arange(len(stratum)), stratum)), shape=(len(stratum), n_strata))).toarray()
    band_mean = band_sum / np.maximum(size, 1.0)  # (n_cells, L)
    population = band_mean[fit].mean(axis=0)  # (L,)
    factor = np.divide(population, band_mean, out=np.zeros_like(band_mean), where=band_mean > 0)
    y = x.multiply(factor[:, stratum]).tocsr()
    if log1p:
        y.data = np.log1p(y.data)
    emb = pca_fit_transform(y, fit, n_comps, seed)
    info = {
        "steps": f"strata 1 <= k <= {int(stratum.max())}, band / cell's band mean x training cells' band mean, " + ("log1p, " if log1p else "") + "PCA",
        "n_features": int(y.shape[1]),
        "n_strata": n_strata,
        "n_comps": int(emb.shape[1]),
    }
    return emb, info


def _aligned(data: ad.AnnData, cells: pd.Index, path) -> None:
    missing = cells.difference(data.obs_names)
    if len(missing):
        raise InputError(f"{len(missing)} embedded cells are missing from this data file", path=path, value=", ".join(map(str, missing[:5])))


def load_baselines(data_dir, cells, split: pd.Series | None = None, seed: int = 0, n_top_genes: int = N_TOP_GENES, n_comps: int = N_COMPS):
    """Both baselines from a data folder, row-aligned with the embedded cells.

    Parameters
    ----------
    data_dir
        ``data/{cfg}``, with ``rna.h5ad`` and ``hic.h5ad`` (Hi-C only: ``hic.h5ad``
        alone, and only the Hi-C baseline is built).
    cells
        The embeddings' cell ids (``obs_names``), in their order.
    split
        The embeddings' ``obs["split"]`` as strings (see
        :func:`~.groups.split_labels`), or None: baselines then learn from all cells.
    seed
        Random state of the PCAs.
    n_top_genes, n_comps
        See :func:`rna_baseline` and :func:`hic_baseline`.

    Returns
    -------
    embeddings, info
        ``{"rna_baseline": (n, k), "hic_baseline": (n, k)}`` with rows in the order of
        ``cells``, and ``{"rna": {...}, "hic": {...}}`` saying how each was made
        (file, cells embedded, cells learned from, settings).

    Raises
    ------
    InputError
        If a file is missing or unreadable, lacks an embedded cell, or its split
        disagrees with the embeddings'.
    """
    folder = DataFolder(data_dir)
    cells = pd.Index(cells)
    out, info = {}, {}
    # a Hi-C-only folder (no rna.h5ad) has the Hi-C baseline alone
    for name in ("rna", "hic") if folder.has_rna else ("hic",):
        path = require_file(folder.modality(name), f"{name} data file")
        log.info("%s baseline: reading %s", name, path)
        try:
            data = ad.read_h5ad(path)
        except (OSError, KeyError, ValueError) as exc:
            raise InputError(f"not a readable h5ad file ({exc})", path=path) from exc
        _aligned(data, cells, path)
        data_split = split_labels(data.obs, path)
        fit = fit_mask(data.obs_names, split, data_split, path)
        if fit.sum() < 3:
            raise InputError(f"a baseline needs at least 3 training cells, got {int(fit.sum())}", path=path, key=f"obs/{SPLIT_KEY}")
        if name == "rna":
            emb, how = rna_baseline(data, fit, n_top_genes=n_top_genes, n_comps=n_comps, seed=seed)
        else:
            emb, how = hic_baseline(data, fit, n_comps=n_comps, seed=seed, path=path)
            band, band_how = bandnorm_baseline(data, fit, seed=seed, path=path)
            out["bandnorm_baseline"] = band[data.obs_names.get_indexer(cells)]
            info["bandnorm"] = {"file": str(path), "n_cells_fit": int(fit.sum()), **band_how}
        out[f"{name}_baseline"] = emb[data.obs_names.get_indexer(cells)]
        info[name] = {
            "file": str(path),
            "n_cells_embedded": int(data.n_obs),
            "n_cells_fit": int(fit.sum()),
            "fit_on": "all" if split is None and data_split is None else "train",
            **how,
        }
    return out, info
