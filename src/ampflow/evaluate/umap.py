"""The UMAP figure of trained latents: the joint latent, and both modalities in one embedding.

:func:`plot_umap` writes three panels: the UMAP of ``X_joint`` by cell type, and
one UMAP of ``X_rna`` and ``X_hic`` stacked (``2n`` points), coloured once by cell
type and once by modality. An RNA point and a Hi-C point of the same cell type
lying together in the stacked embedding means the modalities are aligned. The kNN
graphs are the same exact ones the clustering scores use (see :mod:`.clusters`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd

from ..base.atomic import atomic_path
from .clusters import LATENT_METRIC, _labels, _neighbors_adata, aligned_latents, check_embeddings

log = logging.getLogger(__name__)

#: Modality colours from the Okabe-Ito palette, which stays distinct for colour-blind readers.
_MODALITY_COLOURS = {"RNA": "#0072B2", "Hi-C": "#E69F00"}
_UNLABELLED_COLOUR = "#c8c8c8"


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

    a = _neighbors_adata(rep, seed, LATENT_METRIC)  # only latents are drawn
    sc.tl.umap(a, random_state=seed)
    return np.asarray(a.obsm["X_umap"])


def joint_umap(adata: ad.AnnData, seed: int = 0) -> np.ndarray:
    """UMAP of ``X_joint``: ``(n, 2)`` coordinates, one point per cell."""
    check_embeddings(adata, keys=("X_joint",))
    log.info("UMAP of X_joint (%d cells)", adata.n_obs)
    return _umap(np.asarray(adata.obsm["X_joint"]), seed)


def stacked_umap(adata: ad.AnnData, seed: int = 0) -> np.ndarray:
    """UMAP of ``[X_rna; X_hic]`` (their aligned parts, :func:`~.clusters.aligned_latents`)
    stacked as ``2n`` points in one embedding.

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
    stacked = np.vstack(aligned_latents(adata))  # private dimensions are not comparable
    log.info("UMAP of stacked RNA and Hi-C latents (%d points)", stacked.shape[0])
    return _umap(stacked, seed)


def plot_umap(adata: ad.AnnData, path, label_key: str | None = "cell_type", seed: int = 0, source=None) -> Path:
    """Write a three-panel PNG: the UMAP of ``X_joint`` by cell type, and the stacked
    RNA + Hi-C UMAP by cell type and by modality. Hi-C-only embeddings (no ``X_rna``)
    get the first panel alone.

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
    # Hi-C-only embeddings (no X_rna): one panel, X_joint being the Hi-C latent itself
    hic_only = "X_rna" not in adata.obsm
    joint = joint_umap(adata, seed=seed)
    coords = None if hic_only else stacked_umap(adata, seed=seed)
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

    fig = Figure(figsize=(5.5, 6.2) if hic_only else (14, 6.2), layout="constrained")
    FigureCanvasAgg(fig)  # Agg without pyplot: no global backend, no open-figure registry
    ax_joint, ax_type, ax_mod = (fig.subplots(1, 1), None, None) if hic_only else fig.subplots(1, 3)

    def scatter(ax, xy, colours, draw, what):
        ax.scatter(xy[draw, 0], xy[draw, 1], c=colours[draw], s=marker_size(len(xy)), linewidths=0)
        ax.set_xlabel(f"UMAP 1 of {what} (arbitrary units)", fontsize=9.5)
        ax.set_ylabel(f"UMAP 2 of {what} (arbitrary units)", fontsize=9.5)
        ax.set_xticks([])
        ax.set_yticks([])

    def legend(ax, names, colours, title):
        handles = [Line2D([], [], marker="o", linestyle="", markersize=7, color=c, label=k) for k, c in zip(names, colours, strict=True)]
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
    if hic_only:
        ax_joint.set_title(f"Hi-C latent (X_joint = X_hic) by cell type {note}\n{n} cells", fontsize=11)
        fig.suptitle(f"{name}: UMAP of the Hi-C latent ({n} cells, no RNA)", fontsize=12)
        return _save(fig, path)
    ax_joint.set_title(f"Joint latent X_joint by cell type {note}\n{n} cells", fontsize=11)
    stacked_label = None if cell_label is None else np.concatenate([cell_label, cell_label])
    note = by_type(ax_type, coords, stacked_label, order, "X_rna + X_hic", with_legend=True)
    ax_type.set_title(f"RNA and Hi-C latents by cell type {note}\n{2 * n} points", fontsize=11)

    scatter(ax_mod, coords, np.array([_MODALITY_COLOURS[m] for m in modality], dtype=object), order, "X_rna + X_hic")
    legend(ax_mod, list(_MODALITY_COLOURS), list(_MODALITY_COLOURS.values()), "modality")
    ax_mod.set_title(f"RNA and Hi-C latents by modality\n{2 * n} points", fontsize=11)

    fig.suptitle(f"{name}: UMAPs of the joint latent and of the RNA and Hi-C latents ({n} cells)", fontsize=12)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    """Write the figure as PNG atomically (no half-written file under the final name)."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    log.info("wrote %s", path)
    return path
