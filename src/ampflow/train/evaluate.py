"""Scores and a figure for trained latents: modality alignment and cell-type structure.

The trainer writes ``embeddings.h5ad``: cells in ``obs`` (optionally with a
``cell_type`` column) and three latents in ``obsm``: ``X_rna`` and ``X_hic``
(one per modality, in a shared space) and ``X_joint``. Row *i* of ``X_rna`` and
row *i* of ``X_hic`` come from the same cell, so the true cross-modal match of
every cell is known. From these this module computes

* FOSCTTM (fraction of samples closer than the true match) between the RNA and
  Hi-C latents: 0 is perfect alignment, about 0.5 is no better than chance;
* ARI and NMI of Leiden clusters of ``X_joint`` against the cell labels, with
  the resolution chosen the way scIB does (the best NMI over a grid);
* a UMAP figure: the joint latent by cell type, and both modalities' latents in one
  embedding by cell type and by modality.

:func:`main_evaluate` does all of it for one file and writes ``scores.json`` and
``umap.png``.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Mapping
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd

from ..io.atomic import atomic_path, write_text_atomic
from ..io.errors import InputError, require_file

log = logging.getLogger(__name__)

#: The latents the trainer writes, all required.
EMBEDDING_KEYS = ("X_rna", "X_hic", "X_joint")

#: Leiden resolutions searched for the best NMI (scIB's grid: 0.1, 0.2, ..., 2.0).
LEIDEN_RESOLUTIONS = tuple(round(0.1 * k, 1) for k in range(1, 21))

#: Resolution used when there are no labels to choose one with (scanpy's default).
DEFAULT_RESOLUTION = 1.0

#: Neighbours in the kNN graph (scanpy's default); fewer when there are fewer cells.
N_NEIGHBORS = 15

#: Budget for one block of the distance matrix, in float64 entries (128 MiB).
_BLOCK_ENTRIES = 1 << 24

#: Modality colours from the Okabe-Ito palette, which stays distinct for colour-blind readers.
_MODALITY_COLOURS = {"RNA": "#0072B2", "Hi-C": "#E69F00"}
_UNLABELLED_COLOUR = "#c8c8c8"


# ---------------------------------------------------------------- FOSCTTM
def foscttm_directions(x, y, block_size: int | None = None) -> tuple[float, float]:
    """FOSCTTM in both directions between two paired embeddings.

    Parameters
    ----------
    x, y
        Arrays of shape ``(n, d)``; row *i* of ``x`` and row *i* of ``y`` are the
        same sample seen two ways.
    block_size
        Rows of the distance matrix held in memory at once. By default enough rows
        to fill about 128 MiB of distances, whatever the number of samples.

    Returns
    -------
    x_to_y, y_to_x
        ``x_to_y``: for each *i*, the fraction of *j != i* with
        ``d(x_i, y_j) < d(x_i, y_i)``, averaged over *i*; ``y_to_x`` the same with
        the roles swapped (``d(y_i, x_j) < d(y_i, x_i)``). Euclidean distances.

    Raises
    ------
    ValueError
        If the shapes differ, there are fewer than two samples, or a value is not finite.
    """
    from scipy.spatial.distance import cdist

    # float64 so that near-ties are decided as a direct computation would decide them
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.ndim != 2 or x.shape != y.shape:
        raise ValueError(f"x and y must be 2-D arrays of the same shape, got {x.shape} and {y.shape}")
    n = x.shape[0]
    if n < 2:
        raise ValueError(f"FOSCTTM needs at least 2 samples, got {n}")
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError("x and y must be finite (NaN or inf found)")
    if block_size is None:
        block_size = max(1, _BLOCK_ENTRIES // n)

    # d(x_i, y_i) for all i; needed up front because the y -> x direction compares
    # each column of D = d(x_., y_.) against its diagonal entry.
    true = np.sqrt(((x - y) ** 2).sum(axis=1))
    closer_x_to_y = np.zeros(n, dtype=np.int64)
    closer_y_to_x = np.zeros(n, dtype=np.int64)
    for start in range(0, n, block_size):
        stop = min(start + block_size, n)
        rows = np.arange(start, stop)
        d = cdist(x[start:stop], y, metric="euclidean")  # d[r, j] = d(x_{start+r}, y_j)
        # The true match is never counted against itself: exclude it explicitly
        # rather than relying on two computations of the same distance agreeing.
        d[rows - start, rows] = np.inf
        # x -> y: row i of D against d(x_i, y_i)
        closer_x_to_y[start:stop] = (d < true[start:stop, None]).sum(axis=1)
        # y -> x: d(y_i, x_j) is D[j, i], so column i against d(y_i, x_i)
        closer_y_to_x += (d < true[None, :]).sum(axis=0)
    # per-cell fractions first, then their mean, exactly as the definition reads
    x_to_y = float((closer_x_to_y / (n - 1)).mean())
    y_to_x = float((closer_y_to_x / (n - 1)).mean())
    return x_to_y, y_to_x


def foscttm(x, y, block_size: int | None = None) -> float:
    """Fraction of samples closer than the true match, averaged over both directions.

    Parameters
    ----------
    x, y
        Arrays of shape ``(n, d)`` with row *i* of each from the same sample.
    block_size
        Rows of the distance matrix held in memory at once (see
        :func:`foscttm_directions`).

    Returns
    -------
    float
        Mean of the two directions of :func:`foscttm_directions`: 0 when every
        sample's true match is its nearest cross-modal neighbour, about 0.5 when
        the two embeddings are unrelated.
    """
    x_to_y, y_to_x = foscttm_directions(x, y, block_size=block_size)
    return (x_to_y + y_to_x) / 2.0


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
            "X_rna and X_hic must share a latent space (same width) to compare them, got "
            f"{adata.obsm['X_rna'].shape[1]} and {adata.obsm['X_hic'].shape[1]}",
            path=path,
            key="obsm/X_hic",
        )


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
def _neighbors_adata(rep: np.ndarray, seed: int) -> ad.AnnData:
    """A private AnnData with a kNN graph on ``rep``, so the caller's object is untouched."""
    import scanpy as sc

    rep = np.asarray(rep, dtype=np.float32)
    a = ad.AnnData(obs=pd.DataFrame(index=[str(i) for i in range(len(rep))]), obsm={"X_rep": rep})
    n_neighbors = min(N_NEIGHBORS, a.n_obs - 1)
    # Exact kNN (sklearn, brute force) at every size instead of scanpy's switch to
    # pynndescent above 8192 cells: latents are narrow, so exact search stays cheap
    # at tens of thousands of cells, the graph does not depend on thread count, and
    # scanpy 1.11's pynndescent path fails under scipy >= 1.17 (csr_array.getnnz).
    sc.pp.neighbors(a, n_neighbors=n_neighbors, use_rep="X_rep", transformer="sklearn", random_state=seed)
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


def cluster_scores(
    adata: ad.AnnData, use_rep: str = "X_joint", label_key: str | None = "cell_type", seed: int = 0
) -> dict:
    """Leiden clustering scores of one latent and FOSCTTM between the modalities.

    Builds a kNN graph on ``obsm[use_rep]`` (15 neighbours, fewer for tiny data)
    and runs Leiden (igraph, 2 iterations) at each resolution of
    :data:`LEIDEN_RESOLUTIONS`. As in scIB, the resolution with the highest NMI
    against the labels is kept (the lowest one on ties) and ARI and NMI are
    reported there. ARI and NMI are computed over labelled cells only; unlabelled
    cells still take part in the graph and the clustering. Without labels, Leiden
    runs once at resolution 1.0 and ARI/NMI are None.

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
    from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

    check_embeddings(adata, keys=tuple(dict.fromkeys(("X_rna", "X_hic", use_rep))))
    n = adata.n_obs

    log.info("FOSCTTM between X_rna and X_hic (%d cells)", n)
    rna_to_hic, hic_to_rna = foscttm_directions(adata.obsm["X_rna"], adata.obsm["X_hic"])
    log.info("FOSCTTM: RNA->Hi-C %.4f, Hi-C->RNA %.4f", rna_to_hic, hic_to_rna)

    log.info("kNN graph on %s (%d neighbours)", use_rep, min(N_NEIGHBORS, n - 1))
    graph = _neighbors_adata(adata.obsm[use_rep], seed)

    labels = _labels(adata, label_key)
    if labels is None:
        if label_key is not None:
            log.info("no labels in obs[%r]: Leiden at resolution %.1f, no ARI/NMI", label_key, DEFAULT_RESOLUTION)
        best_res = DEFAULT_RESOLUTION
        best_clusters = _leiden(graph, best_res, seed)
        ari = nmi = None
        n_labelled = 0
    else:
        mask = labels.notna().to_numpy()
        truth = labels.to_numpy()[mask]
        n_labelled = int(mask.sum())
        log.info(
            "Leiden over %d resolutions against %s (%d labelled cells, %d labels)",
            len(LEIDEN_RESOLUTIONS),
            label_key,
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
    n_clusters = len(set(best_clusters))
    log.info(
        "Leiden resolution %.1f: %d clusters, ARI %s, NMI %s",
        best_res,
        n_clusters,
        "n/a" if ari is None else f"{ari:.4f}",
        "n/a" if nmi is None else f"{nmi:.4f}",
    )
    return {
        "ari": ari,
        "nmi": nmi,
        "leiden_resolution": float(best_res),
        "n_clusters": int(n_clusters),
        "n_cells": int(n),
        "n_labelled": n_labelled,
        "foscttm": float((rna_to_hic + hic_to_rna) / 2.0),
        "foscttm_rna_to_hic": float(rna_to_hic),
        "foscttm_hic_to_rna": float(hic_to_rna),
        "use_rep": use_rep,
        "label_key": label_key if labels is not None else None,
        "seed": int(seed),
    }


# ---------------------------------------------------------------- figure
def _config_name(adata: ad.AnnData) -> str | None:
    """``uns["ampflow"]["config"]``: a configuration name, or a mapping with a ``name``."""
    meta = adata.uns.get("ampflow")
    if not isinstance(meta, Mapping):
        return None
    cfg = meta.get("config")
    if isinstance(cfg, Mapping):
        cfg = cfg.get("name")
    if isinstance(cfg, np.ndarray) and cfg.ndim == 0:  # h5ad may hand back 0-d arrays
        cfg = cfg.item()
    if isinstance(cfg, bytes):
        cfg = cfg.decode()
    return cfg if isinstance(cfg, str) and cfg else None


def _category_order(column: pd.Series, present: set[str]) -> list[str]:
    """Legend order: a categorical column's own order, else natural order (type_2 < type_10)."""
    if isinstance(column.dtype, pd.CategoricalDtype):
        ordered = [str(c) for c in column.cat.categories]
        return [c for c in ordered if c in present]

    def natural(text: str):
        return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", text)]

    return sorted(present, key=natural)


def _palette(n: int) -> list[str]:
    """``n`` distinguishable colours: scanpy's categorical palettes, by size."""
    from scanpy.plotting import palettes

    for pal in (palettes.default_20, palettes.default_28, palettes.default_102):
        if n <= len(pal):
            return list(pal[:n])
    # more categories than any palette: cycle (the legend is then the only guide anyway)
    return [palettes.default_102[i % len(palettes.default_102)] for i in range(n)]


def _umap(rep: np.ndarray, seed: int) -> np.ndarray:
    import scanpy as sc

    a = _neighbors_adata(rep, seed)
    sc.tl.umap(a, random_state=seed)
    return np.asarray(a.obsm["X_umap"])


def joint_umap(adata: ad.AnnData, seed: int = 0) -> np.ndarray:
    """UMAP of ``X_joint``: ``(n, 2)`` coordinates, one point per cell."""
    check_embeddings(adata, keys=("X_joint",))
    log.info("UMAP of X_joint (%d cells)", adata.n_obs)
    return _umap(np.asarray(adata.obsm["X_joint"]), seed)


def stacked_umap(adata: ad.AnnData, seed: int = 0) -> np.ndarray:
    """UMAP of ``[X_rna; X_hic]`` stacked as ``2n`` points in one embedding.

    Parameters
    ----------
    adata
        Embeddings with ``obsm`` ``X_rna`` and ``X_hic``.
    seed
        Random state for the neighbour search and the UMAP layout.

    Returns
    -------
    numpy.ndarray
        ``(2n, 2)`` coordinates: rows ``0..n-1`` the RNA latents, ``n..2n-1`` Hi-C.
    """
    check_embeddings(adata, keys=("X_rna", "X_hic"))
    stacked = np.vstack([np.asarray(adata.obsm["X_rna"]), np.asarray(adata.obsm["X_hic"])])
    log.info("UMAP of stacked RNA and Hi-C latents (%d points)", stacked.shape[0])
    return _umap(stacked, seed)


def plot_umap(adata: ad.AnnData, path, label_key: str | None = "cell_type", seed: int = 0, source=None) -> Path:
    """Write a three-panel PNG: the UMAP of ``X_joint`` by cell type, and the stacked
    RNA + Hi-C UMAP by cell type and by modality.

    The last two panels show the same layout (:func:`stacked_umap`), so an RNA point
    and a Hi-C point of the same cell type lying together means the modalities are
    aligned. Points are drawn in a seeded random order so that neither modality
    systematically covers the other. UMAP coordinates have no unit: only
    neighbourhoods are meaningful, not distances or axes.

    Parameters
    ----------
    adata
        Embeddings with ``obsm`` ``X_rna``, ``X_hic`` and ``X_joint``.
    path
        The PNG to write (atomically).
    label_key
        ``obs`` column coloured in the cell-type panels; without it those panels are
        grey and say so.
    seed
        Random state for the UMAPs and the drawing order.
    source
        The file the embeddings came from, used in the title when ``adata.uns``
        has no ``ampflow`` -> ``config`` name.

    Returns
    -------
    pathlib.Path
        ``path``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    path = Path(path)
    joint = joint_umap(adata, seed=seed)
    coords = stacked_umap(adata, seed=seed)
    n = adata.n_obs
    modality = np.array(["RNA"] * n + ["Hi-C"] * n)
    labels = _labels(adata, label_key)

    name = _config_name(adata)
    if name is None:
        src = Path(source) if source is not None else path
        # the folder usually names the run (results/<config>/embeddings.h5ad)
        name = f"{src.parent.name}/{src.name}" if src.parent.name else src.name
    rng = np.random.default_rng(seed)
    order = rng.permutation(2 * n)
    order_joint = rng.permutation(n)

    def marker_size(points: int) -> float:
        # scanpy's rule of thumb for marker size, kept within readable bounds
        return float(np.clip(120000 / points, 1.0, 15.0))

    fig = Figure(figsize=(14, 6.2), layout="constrained")
    FigureCanvasAgg(fig)  # Agg without pyplot: no global backend, no open-figure registry
    ax_joint, ax_type, ax_mod = fig.subplots(1, 3)

    def scatter(ax, xy, colours, draw, what):
        ax.scatter(xy[draw, 0], xy[draw, 1], c=colours[draw], s=marker_size(len(xy)), linewidths=0)
        ax.set_xlabel(f"UMAP 1 of {what} (arbitrary units)", fontsize=9.5)
        ax.set_ylabel(f"UMAP 2 of {what} (arbitrary units)", fontsize=9.5)
        ax.set_xticks([])
        ax.set_yticks([])

    def legend(ax, names, colours, title):
        handles = [
            Line2D([], [], marker="o", linestyle="", markersize=7, color=c, label=k)
            for k, c in zip(names, colours, strict=True)
        ]
        # below the panel, so the panels keep the width; long category lists go into
        # more columns and smaller type rather than off the page
        ncol = min(len(names), 3 if len(names) <= 12 else 4 if len(names) <= 40 else 6)
        fontsize = 9 if len(names) <= 12 else 7 if len(names) <= 40 else 5
        ax.legend(
            handles=handles,
            title=title,
            loc="upper center",
            bbox_to_anchor=(0.5, -0.08),
            frameon=False,
            ncol=ncol,
            fontsize=fontsize,
            title_fontsize=fontsize + 1,
        )

    def by_type(ax, xy, label_values, draw, what, with_legend):
        """Colour by ``label_key``; unlabelled cells grey and underneath."""
        if label_values is None:
            scatter(ax, xy, np.full(len(xy), _UNLABELLED_COLOUR, dtype=object), draw, what)
            missing = f"no labels in obs[{label_key!r}]" if label_key else "no labels"
            return f"({missing})"
        labelled = np.array([v is not None for v in label_values])
        categories = _category_order(adata.obs[label_key], set(label_values[labelled]))
        pal = _palette(len(categories))
        lookup = dict(zip(categories, pal, strict=True))
        colours = np.array([_UNLABELLED_COLOUR if v is None else lookup[v] for v in label_values], dtype=object)
        scatter(ax, xy, colours, draw[np.argsort(labelled[draw], kind="stable")], what)
        if with_legend:
            names, cols = list(categories), list(pal)
            if not labelled.all():
                names.append("unlabelled")
                cols.append(_UNLABELLED_COLOUR)
            legend(ax, names, cols, label_key)
        return f"({label_key})"

    cell_label = None if labels is None else labels.to_numpy()
    note = by_type(ax_joint, joint, cell_label, order_joint, "X_joint", with_legend=True)
    ax_joint.set_title(f"Joint latent X_joint by cell type {note}\n{n} cells", fontsize=11)
    stacked_label = None if cell_label is None else np.concatenate([cell_label, cell_label])
    note = by_type(ax_type, coords, stacked_label, order, "X_rna + X_hic", with_legend=True)
    ax_type.set_title(f"RNA and Hi-C latents by cell type {note}\n{2 * n} points", fontsize=11)

    scatter(ax_mod, coords, np.array([_MODALITY_COLOURS[m] for m in modality], dtype=object), order, "X_rna + X_hic")
    legend(ax_mod, list(_MODALITY_COLOURS), list(_MODALITY_COLOURS.values()), "modality")
    ax_mod.set_title(f"RNA and Hi-C latents by modality\n{2 * n} points", fontsize=11)

    fig.suptitle(f"{name}: UMAPs of the joint latent and of the RNA and Hi-C latents ({n} cells)", fontsize=12)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    log.info("wrote %s", path)
    return path


# ---------------------------------------------------------------- entry point
def _plain(value):
    """JSON-ready value: numpy scalars to Python numbers, NaN to None."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def main_evaluate(embeddings_path, out_dir, label_key: str | None = "cell_type", seed: int = 0) -> dict:
    """Score one ``embeddings.h5ad`` and write ``scores.json`` and ``umap.png``.

    Parameters
    ----------
    embeddings_path
        The trainer's AnnData with ``obsm`` ``X_rna``, ``X_hic`` and ``X_joint``.
    out_dir
        Folder for ``scores.json`` (sorted keys, indent 2) and ``umap.png``; created
        if needed. Both files are written atomically.
    label_key
        ``obs`` column with cell labels for ARI/NMI and the first UMAP panel.
    seed
        Random state for the kNN graphs, Leiden and UMAP.

    Returns
    -------
    dict
        The scores, as written (see :func:`cluster_scores`).

    Raises
    ------
    InputError
        If the file is missing or unreadable, or an ``obsm`` key is missing or
        unusable; the message names the file and the key.
    """
    path = require_file(embeddings_path, "embeddings file")
    out_dir = Path(out_dir)
    log.info("reading %s", path)
    try:
        adata = ad.read_h5ad(path)
    except (OSError, KeyError, ValueError) as exc:
        raise InputError(f"not a readable h5ad file ({exc})", path=path) from exc
    check_embeddings(adata, path=path)
    log.info("%d cells; latent widths %s", adata.n_obs, {k: int(adata.obsm[k].shape[1]) for k in EMBEDDING_KEYS})

    scores = {k: _plain(v) for k, v in cluster_scores(adata, use_rep="X_joint", label_key=label_key, seed=seed).items()}
    scores_path = out_dir / "scores.json"
    write_text_atomic(scores_path, json.dumps(scores, sort_keys=True, indent=2) + "\n")
    log.info("wrote %s", scores_path)

    plot_umap(adata, out_dir / "umap.png", label_key=label_key, seed=seed, source=path)
    return scores
