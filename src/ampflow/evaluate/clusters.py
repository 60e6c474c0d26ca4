"""Leiden clustering scores of a latent against cell labels, and checks on the latents.

The trainer writes ``embeddings.h5ad``: cells in ``obs`` (optionally with a
``cell_type`` column) and three latents in ``obsm``: ``X_rna`` and ``X_hic`` (one
per modality, in a shared space) and ``X_joint``. :func:`check_embeddings` says
clearly what is missing or unusable before any scoring starts.
:func:`leiden_search` reports ARI and NMI of Leiden clusters of any
representation against the cell labels, with the resolution chosen the way scIB
does (the best NMI over a grid); :func:`cluster_scores` applies it to one latent
together with FOSCTTM between ``X_rna`` and ``X_hic`` (see :mod:`.foscttm`).
"""

from __future__ import annotations

import functools
import importlib
import logging
import math

import anndata as ad
import numpy as np
import pandas as pd

from ..base.errors import InputError
from .controls import shuffled_labels
from .foscttm import foscttm_directions

log = logging.getLogger(__name__)

#: The latents the trainer writes, all required.
EMBEDDING_KEYS = ("X_rna", "X_hic", "X_joint")

#: Leiden resolutions searched for the best NMI (scIB's grid: 0.1, 0.2, ..., 2.0).
LEIDEN_RESOLUTIONS = tuple(round(0.1 * k, 1) for k in range(1, 21))

#: Resolution used when there are no labels to choose one with (scanpy's default).
DEFAULT_RESOLUTION = 1.0

#: Neighbours in the kNN graph (scanpy's default); fewer when there are fewer cells.
N_NEIGHBORS = 15

#: The kNN graph's distance for each kind of representation, as its own tool prescribes:
#: scanpy's default (euclidean) on a PCA; cosine on the model's latents, as GLUE's
#: tutorials and evaluation build the graph on theirs. A latent's norm carries the
#: posterior's confidence as much as the cell type: on the held-out HiRES brain cells the
#: RNA latent's Leiden ARI over five seeds is 0.70 +- 0.23 (one seed 0.32) euclidean and
#: 0.83 +- 0.07 cosine, while the scanpy PCA's is 0.80 euclidean and 0.72 cosine; k-means,
#: which both are scored by as well, is euclidean on both.
PCA_METRIC = "euclidean"
LATENT_METRIC = "cosine"


# ---------------------------------------------------------------- input checks
def check_embeddings(adata: ad.AnnData, keys=EMBEDDING_KEYS, path=None) -> None:
    """Raise :class:`InputError` unless ``adata`` has usable latents under ``keys``.

    Parameters
    ----------
    adata
        The embeddings.
    keys
        ``obsm`` keys that must be present, 2-D, finite, and with at least 3 cells.
    path
        The file ``adata`` was read from, named in the error.

    Raises
    ------
    InputError
        Naming the file and the missing or unusable key.
    """
    for key in keys:
        if key not in adata.obsm:
            have = ", ".join(sorted(adata.obsm.keys())) or "none"
            raise InputError(f"obsm key missing (obsm has: {have})", path=path, key=f"obsm/{key}")
        arr = np.asarray(adata.obsm[key])
        if arr.ndim != 2 or arr.shape[1] == 0:
            raise InputError(f"expected a cells x latent matrix, got shape {arr.shape}", path=path, key=f"obsm/{key}")
        if not np.isfinite(arr).all():
            bad = int((~np.isfinite(arr)).any(axis=1).sum())
            raise InputError(f"{bad} cells have NaN or infinite latent values", path=path, key=f"obsm/{key}")
    if adata.n_obs < 3:
        # a kNN graph and a ranking against "other cells" need a few cells
        raise InputError(f"need at least 3 cells to evaluate, got {adata.n_obs}", path=path)
    if "X_rna" in keys and "X_hic" in keys and adata.obsm["X_rna"].shape[1] != adata.obsm["X_hic"].shape[1]:
        raise InputError(
            f"X_rna and X_hic must share a latent space (same width) to compare them, got {adata.obsm['X_rna'].shape[1]} and {adata.obsm['X_hic'].shape[1]}",
            path=path,
            key="obsm/X_hic",
        )


def aligned_latents(adata: ad.AnnData) -> tuple[np.ndarray, np.ndarray]:
    """The aligned parts of ``X_rna`` and ``X_hic``: their first
    ``uns["ampflow"]["shared_dim"]`` columns (all of them when the file does not say),
    the space in which a cell's two latents are meant to coincide. The dimensions
    after it are private to one modality and not comparable across the two."""
    x_rna, x_hic = np.asarray(adata.obsm["X_rna"]), np.asarray(adata.obsm["X_hic"])
    meta = adata.uns.get("ampflow", {})
    s = int(meta.get("shared_dim", x_rna.shape[1])) if isinstance(meta, dict) else x_rna.shape[1]
    return x_rna[:, :s], x_hic[:, :s]


def _labels(adata: ad.AnnData, label_key: str | None) -> pd.Series | None:
    """Labels as strings with NaN kept, or None when there is no usable label column."""
    if label_key is None or label_key not in adata.obs.columns:
        return None
    labels = adata.obs[label_key]
    if labels.isna().all():
        return None
    # strings, so that integer-coded and categorical labels compare the same way
    return pd.Series([None if pd.isna(v) else str(v) for v in labels], index=labels.index, dtype=object)


# ---------------------------------------------------------------- clustering
#: umap-learn's numba kernels behind scanpy's kNN graph (its connectivities). umap-learn
#: compiles them without numba's disk cache, so every process compiled them again: about
#: 4 s, more than the whole scoring of a small dataset takes. (The UMAP layout's kernel,
#: under 1 s, is left alone: one function behind two dispatchers, serial and parallel,
#: whose cache entries would share a name.)
UMAP_KERNELS = ("umap.umap_.smooth_knn_dist", "umap.umap_.compute_membership_strengths")


@functools.cache
def cache_umap_kernels() -> list[str]:
    """Turn on numba's disk cache for :data:`UMAP_KERNELS` (what ``cache=True`` would have
    done; the compiled code is the same); the names it could not cache, which then
    compile per process as before (a missing kernel, or no writable cache folder)."""
    missed = []
    for name in UMAP_KERNELS:
        module, attr = name.rsplit(".", 1)
        try:
            importlib.import_module(module).__dict__[attr].enable_caching()
        except (ImportError, KeyError, AttributeError, RuntimeError):
            missed.append(name)
    if missed:
        log.info("numba disk cache not available for %s: compiled in this process", ", ".join(missed))
    return missed


def knn_metric(key: str) -> str:
    """The kNN graph's distance for the representation stored under ``key``: a latent
    (an ``obsm`` key of :data:`EMBEDDING_KEYS`) or a baseline's PCA."""
    return LATENT_METRIC if key in EMBEDDING_KEYS else PCA_METRIC


def _neighbors_adata(rep: np.ndarray, seed: int, metric: str = PCA_METRIC) -> ad.AnnData:
    """A private AnnData with a kNN graph on ``rep`` (``metric`` distances), so the
    caller's object is untouched."""
    import scanpy as sc

    cache_umap_kernels()

    rep = np.asarray(rep, dtype=np.float32)
    a = ad.AnnData(obs=pd.DataFrame(index=[str(i) for i in range(len(rep))]), obsm={"X_rep": rep})
    n_neighbors = min(N_NEIGHBORS, a.n_obs - 1)
    # Exact kNN (sklearn, brute force) at every size instead of scanpy's switch to
    # pynndescent above 8192 cells: latents are narrow, so exact search stays cheap
    # at tens of thousands of cells, the graph does not depend on thread count, and
    # scanpy 1.11's pynndescent path fails under scipy >= 1.17 (csr_array.getnnz).
    sc.pp.neighbors(a, n_neighbors=n_neighbors, use_rep="X_rep", transformer="sklearn", metric=metric, random_state=seed)
    return a


def _leiden(a: ad.AnnData, resolution: float, seed: int) -> np.ndarray:
    import scanpy as sc

    sc.tl.leiden(
        a,
        resolution=resolution,
        flavor="igraph",
        n_iterations=2,
        directed=False,
        random_state=seed,
        key_added="leiden",
    )
    return a.obs["leiden"].to_numpy()


def leiden_search(rep, labels: pd.Series | None, seed: int = 0, what: str = "latent", metric: str = PCA_METRIC) -> dict:
    """Leiden clusters of one representation, scored against labels at the best resolution.

    Builds a kNN graph on ``rep`` (15 neighbours, fewer for tiny data; ``metric``
    distances, see :func:`knn_metric`) and runs
    Leiden (igraph, 2 iterations) at each resolution of :data:`LEIDEN_RESOLUTIONS`.
    As in scIB, the resolution with the highest NMI against the labels is kept (the
    lowest one on ties) and ARI and NMI are reported there. ARI and NMI are computed
    over labelled cells only; unlabelled cells still take part in the graph and the
    clustering. Without labels, Leiden runs once at resolution 1.0 and ARI/NMI are None.

    Parameters
    ----------
    rep
        Array of shape ``(n_cells, d)``, ``n_cells >= 3``: a latent, a baseline's PCA.
    labels
        One label per row (None or NaN for unlabelled cells), as from :func:`_labels`;
        None when there are no labels.
    seed
        Random state for the neighbour search and Leiden.
    what
        Name of the representation, for the log.
    metric
        The kNN graph's distance.

    Returns
    -------
    dict
        ``ari``, ``nmi`` (float or None), ``leiden_resolution`` (float),
        ``n_clusters`` (int, at that resolution, over all rows), ``n_labelled`` and
        ``knn_metric``.
    """
    from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

    n = len(rep)
    log.info("kNN graph on %s (%d cells, %d neighbours, %s)", what, n, min(N_NEIGHBORS, n - 1), metric)
    graph = _neighbors_adata(rep, seed, metric)
    if labels is None:
        best_res = DEFAULT_RESOLUTION
        best_clusters = _leiden(graph, best_res, seed)
        ari = nmi = None
        n_labelled = 0
    else:
        mask = labels.notna().to_numpy()
        truth = labels.to_numpy()[mask]
        n_labelled = int(mask.sum())
        log.info(
            "Leiden over %d resolutions (%d labelled cells, %d labels)",
            len(LEIDEN_RESOLUTIONS),
            n_labelled,
            len(set(truth)),
        )
        best_nmi = -math.inf
        for res in LEIDEN_RESOLUTIONS:
            clusters = _leiden(graph, res, seed)
            score = normalized_mutual_info_score(truth, clusters[mask])
            log.debug("resolution %.1f: %d clusters, NMI %.4f", res, len(set(clusters)), score)
            if score > best_nmi:  # strict: ties keep the lower resolution
                best_nmi, best_res, best_clusters = score, res, clusters
        nmi = float(best_nmi)
        ari = float(adjusted_rand_score(truth, best_clusters[mask]))
        control = shuffled_labels(truth, best_clusters[mask], seed)
    n_clusters = len(set(best_clusters))
    log.info(
        "%s: Leiden resolution %.1f, %d clusters, ARI %s, NMI %s",
        what,
        best_res,
        n_clusters,
        "n/a" if ari is None else f"{ari:.4f}",
        "n/a" if nmi is None else f"{nmi:.4f}",
    )
    found = {"ari": ari, "nmi": nmi, "leiden_resolution": float(best_res), "n_clusters": int(n_clusters), "n_labelled": n_labelled,
             "knn_metric": metric}  # fmt: skip
    if labels is not None:
        found.update(control)
    return found


#: k-means starts (k-means++ seeds) of :func:`kmeans_scores`; the lowest inertia wins. With
#: 10, the held-out HiRES RNA latent of one seed got a local optimum (inertia 221.6, ARI 0.67
#: against the labels) where other random states found the better partition (216.7, 0.96).
KMEANS_STARTS = 100


def kmeans_scores(rep, labels: pd.Series | None, seed: int = 0, batches: pd.Series | None = None) -> dict | None:
    """k-means with k = the number of distinct labels (:data:`KMEANS_STARTS` starts, the
    lowest inertia kept), scored over the
    labelled cells with the shuffled-label control beside it; None without labels or
    with fewer cells than labels. With ``batches`` (the cells' batch, two or more
    values) the same clusters are scored against the batch over every cell too
    (``ari_batch``): a latent that sorts by batch reads high there.

    Leiden's resolution is chosen for the best NMI, which at small n favours many small
    clusters whose NMI is high by chance; k-means with the labels' k has no such choice.

    Returns
    -------
    dict or None
        ``ari``, ``nmi``, ``k``, ``ari_shuffled_p95``, ``nmi_shuffled_p95``; and
        ``ari_batch`` with ``batches``.
    """
    from sklearn.cluster import KMeans
    from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

    if labels is None:
        return None
    mask = labels.notna().to_numpy()
    truth = labels.to_numpy()[mask]
    k = len(set(truth))
    if k < 2 or len(rep) < k:
        return None
    every = KMeans(k, n_init=KMEANS_STARTS, random_state=seed).fit_predict(np.asarray(rep, dtype=np.float64))
    clusters = every[mask]
    out = {
        "ari": float(adjusted_rand_score(truth, clusters)),
        "nmi": float(normalized_mutual_info_score(truth, clusters)),
        "k": int(k),
        **shuffled_labels(truth, clusters, seed),
    }
    if batches is not None and batches.astype(str).nunique() >= 2:
        out["ari_batch"] = float(adjusted_rand_score(batches.astype(str).to_numpy(), every))
    return out


def cluster_scores(adata: ad.AnnData, use_rep: str = "X_joint", label_key: str | None = "cell_type", seed: int = 0) -> dict:
    """Leiden clustering scores of one latent and FOSCTTM between the modalities.

    The clustering is :func:`leiden_search` on ``obsm[use_rep]``; FOSCTTM is
    between the aligned parts of ``obsm["X_rna"]`` and ``obsm["X_hic"]``
    (:func:`aligned_latents`; see :mod:`.foscttm`).
    ``adata`` is not modified.

    Parameters
    ----------
    adata
        Embeddings with ``obsm`` ``X_rna``, ``X_hic`` and ``use_rep``.
    use_rep
        The ``obsm`` key clustered.
    label_key
        ``obs`` column with the reference labels; missing or all-NaN means no labels.
    seed
        Random state for the neighbour search and Leiden; the same seed gives the
        same scores.

    Returns
    -------
    dict
        ``ari``, ``nmi`` (float or None), ``leiden_resolution`` (float),
        ``n_clusters`` (int, at that resolution, over all cells), ``n_cells``,
        ``n_labelled`` (cells with a label), ``foscttm``, ``foscttm_rna_to_hic``,
        ``foscttm_hic_to_rna`` (floats), and ``use_rep``, ``label_key`` (None when
        no labels were used) and ``seed`` so a score file says how it was made.

    Raises
    ------
    InputError
        If a needed ``obsm`` key is missing or unusable.
    """
    check_embeddings(adata, keys=tuple(dict.fromkeys(("X_rna", "X_hic", use_rep))))
    n = adata.n_obs

    log.info("FOSCTTM between the aligned parts of X_rna and X_hic (%d cells)", n)
    rna_to_hic, hic_to_rna = foscttm_directions(*aligned_latents(adata))
    log.info("FOSCTTM: RNA->Hi-C %.4f, Hi-C->RNA %.4f", rna_to_hic, hic_to_rna)

    labels = _labels(adata, label_key)
    if labels is None and label_key is not None:
        log.info("no labels in obs[%r]: Leiden at resolution %.1f, no ARI/NMI", label_key, DEFAULT_RESOLUTION)
    found = leiden_search(adata.obsm[use_rep], labels, seed, what=use_rep, metric=knn_metric(use_rep))
    return {
        **found,
        "n_cells": int(n),
        "foscttm": float((rna_to_hic + hic_to_rna) / 2.0),
        "foscttm_rna_to_hic": float(rna_to_hic),
        "foscttm_hic_to_rna": float(hic_to_rna),
        "use_rep": use_rep,
        "label_key": label_key if labels is not None else None,
        "seed": int(seed),
    }
