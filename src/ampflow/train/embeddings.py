"""The embeddings file (``embeddings.h5ad``): the RNA and Hi-C latent means of every cell
and the joint embedding built from them, written by training and by ``ampflow embed``
alike, so that the two give the same file for the same model and cells.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import anndata as ad
import numpy as np
import pandas as pd
import torch


def latent_means(encode: Callable, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], latent: int) -> tuple[np.ndarray | None, np.ndarray]:
    """RNA and Hi-C latent means, (n_cells, latent) each, of ``encode(rna, hic)`` over the
    batches (in eval mode, without gradients: the caller's model decides). The RNA one
    is None where ``encode`` gives None for it (a Hi-C-only model)."""
    xr, xh = [], []
    with torch.no_grad():
        for rna, hic in batches:
            r, h = encode(rna, hic)
            xr.append(None if r is None else r.cpu().numpy())
            xh.append(h.cpu().numpy())
    if not xh:
        return np.zeros((0, latent)), np.zeros((0, latent))
    if any(r is None for r in xr):
        return None, np.concatenate(xh)
    return np.concatenate(xr), np.concatenate(xh)


def joint_latent(x_rna: np.ndarray, x_hic: np.ndarray) -> np.ndarray:
    """The joint embedding of paired cells: the mean of their two latents."""
    return (x_rna + x_hic) / 2


def embeddings_anndata(obs: pd.DataFrame, x_rna: np.ndarray | None, x_hic: np.ndarray, uns: dict) -> ad.AnnData:
    """``obs`` with ``obsm`` ``X_rna``, ``X_hic`` and ``X_joint`` (float32) and
    ``uns["ampflow"]``. ``x_rna`` None (a Hi-C-only model): no ``X_rna``, and
    ``X_joint`` is the Hi-C latent, the only one there is."""
    emb = ad.AnnData(obs=obs.copy())
    if x_rna is None:
        emb.obsm["X_hic"] = x_hic.astype(np.float32)
        emb.obsm["X_joint"] = x_hic.astype(np.float32)
        emb.uns["ampflow"] = {**uns, "modalities": ["hic"]}
        return emb
    emb.obsm["X_rna"] = x_rna.astype(np.float32)
    emb.obsm["X_hic"] = x_hic.astype(np.float32)
    emb.obsm["X_joint"] = joint_latent(x_rna, x_hic).astype(np.float32)
    emb.uns["ampflow"] = uns
    return emb
