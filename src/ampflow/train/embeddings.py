"""The embeddings file (``embeddings.h5ad``): the RNA and Hi-C latent means of every cell
and the joint embedding built from them, written by training and by ``ampflow embed``
alike, so that the two give the same file for the same model and cells.

The joint embedding
-------------------
Each cell latent has ``shared_dim`` aligned dimensions followed by ``private_dim``
(``model.private_dim``) that only one modality's decoder reads. Training pulls the Hi-C
latent's shared dimensions onto the RNA latent's (the alignment term), so for a paired
cell the RNA latent's shared part already stands for both; what Hi-C knows and RNA does
not has nowhere to go but the Hi-C private dimensions. The joint embedding is therefore

    X_joint = [X_rna, X_hic[:, shared_dim:]]

the whole RNA latent followed by the Hi-C private dimensions. Why not the mean of the two
latents (the rule before): averaging adds the Hi-C latent's error to every cell, so a
Hi-C profile that says nothing about its cell (a real negative control: the real HiRES
brain RNA paired with subsamples of one unrelated cell) moves each cell by noise as large
as its signal and dilutes the RNA latent's clusters. In the rule above an uninformative
Hi-C adds only its private dimensions, which the KL term holds at the prior's mean when the
decoder cannot use them, i.e. a near-constant block that leaves every distance as it was;
an informative Hi-C (cell types that only chromatin separates) adds exactly the
dimensions that separate them. Weighting the two latents by their posterior precision
(a product of experts) was measured too and rejected: the encoders' standard deviations
are not calibrated on cells they never saw.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import anndata as ad
import numpy as np
import pandas as pd
import torch

#: Rows of every encoder forward pass that writes embeddings (training's and ``ampflow
#: embed``'s): a batch of fewer cells is padded with empty cells to this many.
EMBED_ROWS = 1024


def pad_rows(x: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """``x`` (B, n) with ``rows - B`` rows of zeros appended: (rows, n); None stays None
    (the RNA of a Hi-C-only model)."""
    if x is None:
        return None
    if x.shape[0] > rows:
        raise ValueError(f"a batch of {x.shape[0]} rows exceeds the {rows} of a forward pass")
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])]) if x.shape[0] < rows else x


def latent_means(
    encode: Callable, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], latent: int, rows: int = EMBED_ROWS
) -> tuple[np.ndarray | None, np.ndarray]:
    """RNA and Hi-C latent means, (n_cells, latent) each, of ``encode(rna, hic)`` over the
    batches (in eval mode, without gradients: the caller's model decides). The RNA one
    is None where ``encode`` gives None for it (a Hi-C-only model).

    Every forward pass has exactly ``rows`` rows (batches of at most that many cells,
    padded with empty cells): a matrix product's rows are not computed alike for every
    row count (BLAS kernels treat a partial last block of rows differently), so without
    the padding a cell's vector would depend on how many cells it is encoded with, and
    embedding a subset of the cells (held-out ones, say) would not give training's
    vectors bit for bit. Every layer acts on each row alone, so the padding rows change
    nothing else.
    """
    xr, xh = [], []
    with torch.no_grad():
        for rna, hic in batches:
            n = hic.shape[0]
            r, h = encode(pad_rows(rna, rows), pad_rows(hic, rows))
            xr.append(None if r is None else r[:n].cpu().numpy())
            xh.append(h[:n].cpu().numpy())
    if not xh:
        return np.zeros((0, latent)), np.zeros((0, latent))
    if any(r is None for r in xr):
        return None, np.concatenate(xh)
    return np.concatenate(xr), np.concatenate(xh)


def joint_latent(x_rna: np.ndarray, x_hic: np.ndarray, shared_dim: int) -> np.ndarray:
    """The joint embedding of paired cells: the RNA latent followed by the Hi-C latent's
    private dimensions (those after ``shared_dim``); see the module docstring for why."""
    if not 0 < shared_dim <= x_hic.shape[1]:
        raise ValueError(f"shared_dim {shared_dim} outside 1..{x_hic.shape[1]}")
    return np.hstack([x_rna, x_hic[:, shared_dim:]])


def embeddings_anndata(obs: pd.DataFrame, x_rna: np.ndarray | None, x_hic: np.ndarray, shared_dim: int, uns: dict) -> ad.AnnData:
    """``obs`` with ``obsm`` ``X_rna``, ``X_hic`` and ``X_joint`` (float32) and
    ``uns["ampflow"]`` (``uns`` plus ``shared_dim``, the aligned leading dimensions of
    ``X_rna`` and ``X_hic`` that FOSCTTM compares). ``x_rna`` None (a Hi-C-only model):
    no ``X_rna``, and ``X_joint`` is the Hi-C latent, the only one there is."""
    emb = ad.AnnData(obs=obs.copy())
    if x_rna is None:
        emb.obsm["X_hic"] = x_hic.astype(np.float32)
        emb.obsm["X_joint"] = x_hic.astype(np.float32)
        emb.uns["ampflow"] = {**uns, "modalities": ["hic"]}
        return emb
    emb.obsm["X_rna"] = x_rna.astype(np.float32)
    emb.obsm["X_hic"] = x_hic.astype(np.float32)
    emb.obsm["X_joint"] = joint_latent(x_rna, x_hic, shared_dim).astype(np.float32)
    emb.uns["ampflow"] = {**uns, "shared_dim": int(shared_dim)}
    return emb
