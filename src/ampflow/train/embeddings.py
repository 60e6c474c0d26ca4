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


#: Rows of every encoder forward pass that writes embeddings (training's and ``ampflow
#: embed``'s): a batch of fewer cells is padded with empty cells to this many.
EMBED_ROWS = 1024


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` (B, n) with ``rows - B`` rows of zeros appended: (rows, n)."""
    if x.shape[0] > rows:
        raise ValueError(f"a batch of {x.shape[0]} rows exceeds the {rows} of a forward pass")
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])]) if x.shape[0] < rows else x


def latent_means(
    encode: Callable, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], latent: int, rows: int = EMBED_ROWS
) -> tuple[np.ndarray, np.ndarray]:
    """RNA and Hi-C latent means, (n_cells, latent) each, of ``encode(rna, hic)`` over the
    batches (in eval mode, without gradients: the caller's model decides).

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
            n = rna.shape[0]
            r, h = encode(pad_rows(rna, rows), pad_rows(hic, rows))
            xr.append(r[:n].cpu().numpy())
            xh.append(h[:n].cpu().numpy())
    if not xr:
        return np.zeros((0, latent)), np.zeros((0, latent))
    return np.concatenate(xr), np.concatenate(xh)


def joint_latent(x_rna: np.ndarray, x_hic: np.ndarray) -> np.ndarray:
    """The joint embedding of paired cells: the mean of their two latents."""
    return (x_rna + x_hic) / 2


def embeddings_anndata(obs: pd.DataFrame, x_rna: np.ndarray, x_hic: np.ndarray, uns: dict) -> ad.AnnData:
    """``obs`` with ``obsm`` ``X_rna``, ``X_hic`` and ``X_joint`` (float32) and
    ``uns["ampflow"]``."""
    emb = ad.AnnData(obs=obs.copy())
    emb.obsm["X_rna"] = x_rna.astype(np.float32)
    emb.obsm["X_hic"] = x_hic.astype(np.float32)
    emb.obsm["X_joint"] = joint_latent(x_rna, x_hic).astype(np.float32)
    emb.uns["ampflow"] = uns
    return emb
