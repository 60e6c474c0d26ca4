"""Score one ``embeddings.h5ad``: ``scores.json`` and ``umap.png`` (``ampflow evaluate``).

:func:`main_evaluate` reads the trainer's file, checks its latents, builds the
single-modality baselines from the data folder (:mod:`.baselines`), scores every
group of cells (:mod:`.scores`: Leiden ARI/NMI of each latent and baseline, FOSCTTM
and its shuffled control) and draws :func:`~.umap.plot_umap`. Both outputs are
written atomically, so an interrupted run leaves no half-written file for the
workflow to mistake for a finished one.

``scores.json``::

    ari, nmi, foscttm, ...   the joint latent on the headline group (held-out cells, else all)
    headline_group           "heldout" or "all"
    groups
      heldout | train | all
        n_cells, n_labelled
        methods
          joint | rna_latent | hic_latent | rna_baseline | hic_baseline | bandnorm_baseline
            ari, nmi, leiden_resolution, n_clusters, representation (Leiden)
            ari_shuffled_p95, nmi_shuffled_p95   the same clusters against shuffled labels
            kmeans           ari, nmi, k, ari_shuffled_p95, nmi_shuffled_p95 (k = the labels);
                             ari_batch: the same clusters against obs[batch_key] (two or more batches)
            effective_dims   how many dimensions the group's cells spread over (participation ratio)
        foscttm              foscttm, foscttm_rna_to_hic, foscttm_hic_to_rna   (not on training cells)
        shuffled_control     foscttm, ..., chance, tolerance, at_chance       (not on training cells)
        absent               Hi-C-only embeddings (no X_rna): rna_latent, rna_baseline, foscttm,
                             shuffled_control -> why they are not scored (never zeros)
    modalities               ["rna", "hic"], or ["hic"] for Hi-C-only embeddings
    baselines                rna | hic | bandnorm: file, cells fit, settings (null without --data)
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import anndata as ad
import numpy as np

from ..base.atomic import write_text_atomic
from ..base.errors import InputError, require_file
from .clusters import EMBEDDING_KEYS, check_embeddings
from .groups import split_labels
from .scores import group_scores, headline_scores
from .umap import plot_umap

log = logging.getLogger(__name__)


def _plain(value):
    """JSON-ready value, nested dicts included: numpy scalars to Python numbers, NaN to None."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def main_evaluate(embeddings_path, out_dir, label_key: str | None = "cell_type", seed: int = 0, data=None, batch_key: str | None = "batch") -> dict:
    """Score one ``embeddings.h5ad`` and write ``scores.json`` and ``umap.png``.

    Parameters
    ----------
    embeddings_path
        The trainer's AnnData with ``obsm`` ``X_rna``, ``X_hic`` and ``X_joint``, and
        optionally ``obs["split"]`` (``"train"`` / ``"heldout"``).
    out_dir
        Folder for ``scores.json`` (sorted keys, indent 2) and ``umap.png``; created
        if needed. Both files are written atomically.
    label_key
        ``obs`` column with cell labels for ARI/NMI and the first UMAP panel.
    seed
        Random state for the kNN graphs, Leiden, the baselines' PCA, the control's
        derangement and UMAP.
    data
        The configuration's data folder (``data/{cfg}`` with ``rna.h5ad`` and
        ``hic.h5ad``) for the baselines; without it their scores are None.
    batch_key
        ``obs`` column with the cells' batches (``model.batch_key``): k-means clusters
        are scored against it beside the labels.

    Returns
    -------
    dict
        The scores, as written (layout in the module docstring).

    Raises
    ------
    InputError
        If a file is missing or unreadable, an ``obsm`` key is missing or unusable,
        a data file lacks an embedded cell, or a split value is unknown; the message
        names the file and the key.
    """
    path = require_file(embeddings_path, "embeddings file")
    out_dir = Path(out_dir)
    log.info("reading %s", path)
    try:
        adata = ad.read_h5ad(path)
    except (OSError, KeyError, ValueError) as exc:
        raise InputError(f"not a readable h5ad file ({exc})", path=path) from exc
    # a Hi-C-only model writes no X_rna; its X_joint is the Hi-C latent
    keys = EMBEDDING_KEYS if "X_rna" in adata.obsm else tuple(k for k in EMBEDDING_KEYS if k != "X_rna")
    check_embeddings(adata, keys=keys, path=path)
    log.info("%d cells; latent widths %s", adata.n_obs, {k: int(adata.obsm[k].shape[1]) for k in keys})

    split = split_labels(adata.obs, path)
    baselines = info = None
    if data is not None:
        from .baselines import load_baselines

        baselines, info = load_baselines(data, adata.obs_names, split=split, seed=seed)
    else:
        log.info("no data folder given: no baselines")
    groups = group_scores(adata, baselines, label_key=label_key, seed=seed, path=path, batch_key=batch_key)
    scores = _plain({**headline_scores(groups, label_key, seed), "groups": groups, "baselines": info})
    scores_path = out_dir / "scores.json"
    write_text_atomic(scores_path, json.dumps(scores, sort_keys=True, indent=2) + "\n")
    log.info("wrote %s", scores_path)

    plot_umap(adata, out_dir / "umap.png", label_key=label_key, seed=seed, source=path)
    return scores
