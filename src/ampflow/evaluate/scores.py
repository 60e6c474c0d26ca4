"""Every score of ``scores.json``, side by side: the model's latents, the baselines, the control.

For each group of cells (:mod:`.groups`: held-out and training cells apart, or all
cells), every representation of :data:`METHODS` (the joint latent, each modality's
latent, and the single-modality baselines of :mod:`.baselines`) is clustered on
that group's cells alone and scored with the same Leiden resolution search
(:func:`~.clusters.leiden_search`), so the numbers compare like with like. FOSCTTM
between ``X_rna`` and ``X_hic`` and its shuffled-pairing control (:mod:`.controls`)
are computed on held-out cells (on all cells without a split): on training cells the
alignment loss itself pulled the pairs together.

The headline (:func:`headline_scores`) keeps the keys ``scores.json`` always had
(``ari``, ``nmi``, ``foscttm`` ...), from the joint latent of the headline group.
"""

from __future__ import annotations

import logging

import anndata as ad
import numpy as np

from .clusters import _labels, aligned_latents, kmeans_scores, knn_metric, leiden_search
from .controls import shuffled_foscttm
from .foscttm import foscttm_directions
from .groups import cell_groups, headline_group
from .spread import effective_dims

log = logging.getLogger(__name__)

#: What is scored in each group, in report order: method name -> ``obsm`` key of the
#: embeddings, or the name of a baseline of :func:`~.baselines.load_baselines`.
METHODS = {
    "joint": "X_joint",
    "rna_latent": "X_rna",
    "hic_latent": "X_hic",
    "rna_baseline": "rna_baseline",
    "hic_baseline": "hic_baseline",
    "bandnorm_baseline": "bandnorm_baseline",
}

#: Methods and alignment scores that need an RNA modality: Hi-C-only embeddings (no
#: ``X_rna``) record them under ``absent`` with this reason, never as zeros.
NEEDS_RNA = ("rna_latent", "rna_baseline")
NO_RNA = "no RNA modality (Hi-C-only dataset)"
ALIGNMENT = ("foscttm", "shuffled_control")

#: A kNN graph and a ranking against "other cells" need a few cells.
MIN_CELLS = 3


def _representation(adata: ad.AnnData, baselines: dict | None, key: str):
    if key in adata.obsm:
        return np.asarray(adata.obsm[key])
    if baselines is not None and key in baselines:
        return np.asarray(baselines[key])
    return None


def score_group(
    adata: ad.AnnData, rows: np.ndarray, baselines: dict | None = None, label_key: str | None = "cell_type",
    seed: int = 0, alignment: bool = True, name: str = "", batch_key: str | None = "batch",
) -> dict:  # fmt: skip
    """Scores of one group of cells.

    Parameters
    ----------
    adata
        Embeddings with ``obsm`` ``X_rna``, ``X_hic``, ``X_joint``.
    rows
        Integer rows of ``adata`` in the group; only these cells are clustered and ranked.
    baselines
        ``{"rna_baseline": (n_obs, k), "hic_baseline": (n_obs, k)}`` row-aligned with
        ``adata``, or None (their scores are then None).
    label_key
        ``obs`` column with the reference labels.
    seed
        Random state of the kNN graphs, Leiden and the control's derangement.
    alignment
        Whether to compute FOSCTTM and the shuffled-pairing control.
    name
        The group's name, for the log.
    batch_key
        ``obs`` column with the cells' batches: each method's k-means clusters are
        scored against it too (``kmeans.ari_batch``) when it has two or more values.

    Returns
    -------
    dict
        ``n_cells``, ``n_labelled``; ``methods``: per name of :data:`METHODS` a dict
        with ``ari``, ``nmi``, ``leiden_resolution``, ``n_clusters``,
        ``representation``, ``kmeans`` and ``effective_dims`` (:func:`~.spread.effective_dims`
        of the group's cells; None for a baseline not given); with ``alignment``,
        ``foscttm`` (``foscttm``, ``foscttm_rna_to_hic``, ``foscttm_hic_to_rna``) and
        ``shuffled_control`` (see :func:`~.controls.shuffled_foscttm`). A group of
        fewer than :data:`MIN_CELLS` cells has ``skipped`` (the reason) instead.
        Hi-C-only embeddings (no ``X_rna``) have ``joint``, ``hic_latent`` and
        ``hic_baseline`` only, no FOSCTTM or control, and ``absent``: each left-out
        method and alignment score with the reason.
    """
    rows = np.asarray(rows)
    hic_only = "X_rna" not in adata.obsm
    labels = _labels(adata, label_key)
    sub_labels = None if labels is None else labels.iloc[rows]
    if sub_labels is not None and sub_labels.isna().all():
        sub_labels = None
    entry = {"n_cells": int(len(rows)), "n_labelled": 0 if sub_labels is None else int(sub_labels.notna().sum())}
    sub_batches = adata.obs[batch_key].iloc[rows] if batch_key is not None and batch_key in adata.obs.columns else None
    if len(rows) < MIN_CELLS:
        log.warning("%s: %d cells, too few to score", name or "group", len(rows))
        return {**entry, "skipped": f"fewer than {MIN_CELLS} cells"}
    log.info("scoring %s: %d cells, %d labelled", name or "group", len(rows), entry["n_labelled"])
    methods = {}
    for method, key in METHODS.items():
        if hic_only and method in NEEDS_RNA:
            continue
        rep = _representation(adata, baselines, key)
        if rep is None:
            methods[method] = None
            continue
        found = leiden_search(rep[rows], sub_labels, seed, what=f"{name} {key}".strip(), metric=knn_metric(key))
        found.pop("n_labelled")
        methods[method] = {**found, "representation": key, "kmeans": kmeans_scores(rep[rows], sub_labels, seed, sub_batches),
                           "effective_dims": effective_dims(rep[rows])}  # fmt: skip
    entry["methods"] = methods
    if hic_only:  # nothing to align: one modality
        entry["absent"] = {k: NO_RNA for k in NEEDS_RNA + (ALIGNMENT if alignment else ())}
    elif alignment:
        x_rna, x_hic = (x[rows] for x in aligned_latents(adata))
        rna_to_hic, hic_to_rna = foscttm_directions(x_rna, x_hic)
        log.info("%s FOSCTTM: RNA->Hi-C %.4f, Hi-C->RNA %.4f", name, rna_to_hic, hic_to_rna)
        entry["foscttm"] = {
            "foscttm": float((rna_to_hic + hic_to_rna) / 2.0),
            "foscttm_rna_to_hic": float(rna_to_hic),
            "foscttm_hic_to_rna": float(hic_to_rna),
        }
        entry["shuffled_control"] = shuffled_foscttm(x_rna, x_hic, seed=seed)
    return entry


def group_scores(adata: ad.AnnData, baselines: dict | None = None, label_key: str | None = "cell_type", seed: int = 0, path=None,
                 batch_key: str | None = "batch") -> dict:  # fmt: skip
    """:func:`score_group` for every group of :func:`~.groups.cell_groups`.

    Alignment scores (FOSCTTM, control) are computed for held-out cells, for all
    cells without a split, and for the headline group whatever it is.

    Returns
    -------
    dict
        Group name (``"heldout"``, ``"train"`` or ``"all"``) -> its scores.
    """
    groups = cell_groups(adata, path)
    head = headline_group(groups)
    return {
        g: score_group(adata, rows, baselines, label_key, seed, alignment=(g != "train" or g == head), name=g, batch_key=batch_key)
        for g, rows in groups.items()
    }


def headline_scores(groups: dict, label_key: str | None, seed: int) -> dict:
    """The flat keys ``scores.json`` always had, from the headline group's joint latent.

    Returns
    -------
    dict
        ``ari``, ``nmi`` (and the 95th percentiles of the same clusters' scores against
        shuffled labels), ``leiden_resolution``, ``n_clusters``, ``knn_metric``, ``n_cells``,
        ``n_labelled``, ``foscttm``, ``foscttm_rna_to_hic``, ``foscttm_hic_to_rna``,
        ``use_rep`` (``X_joint``), ``label_key`` (None without labels), ``seed`` and
        ``headline_group``; values None where the group was too small to score, or
        (FOSCTTM) where the embeddings are Hi-C only (``modalities`` then ``["hic"]``).
    """
    head = headline_group(groups)
    entry = groups[head]
    joint = (entry.get("methods") or {}).get("joint") or {}
    align = entry.get("foscttm") or {}
    return {
        "ari": joint.get("ari"),
        "nmi": joint.get("nmi"),
        "ari_shuffled_p95": joint.get("ari_shuffled_p95"),
        "nmi_shuffled_p95": joint.get("nmi_shuffled_p95"),
        "leiden_resolution": joint.get("leiden_resolution"),
        "n_clusters": joint.get("n_clusters"),
        "knn_metric": joint.get("knn_metric"),
        "n_cells": entry["n_cells"],
        "n_labelled": entry["n_labelled"],
        "foscttm": align.get("foscttm"),
        "foscttm_rna_to_hic": align.get("foscttm_rna_to_hic"),
        "foscttm_hic_to_rna": align.get("foscttm_hic_to_rna"),
        "use_rep": "X_joint",
        "label_key": label_key if any(g["n_labelled"] for g in groups.values()) else None,
        "seed": int(seed),
        "headline_group": head,
        "modalities": ["hic"] if "absent" in entry else ["rna", "hic"],
    }
