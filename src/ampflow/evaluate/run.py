"""Score one ``embeddings.h5ad``: ``scores.json`` and ``umap.png`` (``ampflow evaluate``).

:func:`main_evaluate` reads the trainer's file, checks its latents, computes the
scores of :func:`~.clusters.cluster_scores` (Leiden ARI/NMI of ``X_joint``,
FOSCTTM between ``X_rna`` and ``X_hic``) and draws :func:`~.umap.plot_umap`. Both
outputs are written atomically, so an interrupted run leaves no half-written file
for the workflow to mistake for a finished one.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import anndata as ad
import numpy as np

from ..io.atomic import write_text_atomic
from ..io.errors import InputError, require_file
from .clusters import EMBEDDING_KEYS, check_embeddings, cluster_scores
from .umap import plot_umap

log = logging.getLogger(__name__)


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
