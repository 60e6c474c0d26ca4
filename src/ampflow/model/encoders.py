"""Cell encoders: counts -> Normal(loc, std) over the cell latent."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..contract.model_shapes import ENCODER_LAYERS, encoder_params
from .layers import batch_norm_from, linear_from

STD_EPS = 1e-4


class Encoder(nn.Module):
    """Two-layer MLP (Linear, LeakyReLU, BatchNorm, Dropout) with a Normal head.

    Parameters
    ----------
    n_in
        Input features.
    hidden, latent
        Hidden and latent widths.
    dropout
        Dropout after each hidden layer.
    """

    def __init__(self, n_in: int, hidden: int, latent: int, dropout: float):
        super().__init__()
        p = encoder_params(n_in, hidden, latent)
        layers = []
        for linear, norm in ENCODER_LAYERS:  # the description's positions in ``body``
            layers += [linear_from(p, f"body.{linear}"), nn.LeakyReLU(0.2)]
            layers += [batch_norm_from(p, f"body.{norm}"), nn.Dropout(dropout)]
        self.body = nn.Sequential(*layers)
        self.loc = linear_from(p, "loc")
        self.std = linear_from(p, "std")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (B, n_in) transformed counts -> loc, std: (B, latent)."""
        h = self.body(x)
        return self.loc(h), F.softplus(self.std(h)) + STD_EPS


def rna_input(counts: torch.Tensor, library: torch.Tensor) -> torch.Tensor:
    """log1p of counts normalised to 10^4 per cell. counts: (B, G), library: (B,)."""
    return torch.log1p(counts * (1e4 / library.clamp_min(1.0)).unsqueeze(1))


def stratum_totals(counts: torch.Tensor, feature_stratum: torch.Tensor, n_strata: int) -> torch.Tensor:
    """Each cell's contacts per stratum: (B, F) counts -> (B, L)."""
    return counts.new_zeros(counts.shape[0], n_strata).index_add_(1, feature_stratum, counts)


def hic_input(counts: torch.Tensor, feature_stratum: torch.Tensor, n_strata: int) -> torch.Tensor:
    """log1p(counts * 5e4 / library / s_k), s_k = the cell's own share of contacts in
    stratum k, scaled so that every stratum's features average one.

    That is per-cell, per-stratum depth normalisation: each cell's distance decay
    (which varies from cell to cell and would otherwise dominate the input) is
    divided out, and what remains is where in each stratum the contacts fall.

    counts: (B, F); feature_stratum: (F,) long -> (B, F).
    """
    totals = stratum_totals(counts, feature_stratum, n_strata)  # (B, L)
    sizes = torch.bincount(feature_stratum, minlength=n_strata).to(counts.dtype)  # (L,)
    per_feature = (sizes / totals.clamp_min(1.0))[:, feature_stratum]
    return torch.log1p(counts * per_feature)
