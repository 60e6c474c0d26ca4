"""Cell encoders: counts -> Normal(loc, std) over the cell latent."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..contract.config import HIC_BAND_WEIGHTS, HIC_TRANSFORMS
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


class HiCInput(nn.Module):
    """The Hi-C encoder's input: ``f(count / m_ck * w_k)`` for a feature of stratum k
    of cell c, with m_ck the cell's mean count over stratum k's features, w_k a weight
    per stratum taken from the training cells and f ``log1p`` (``transform="log1p"``) or
    nothing (``"linear"``).

    Dividing by m_ck takes out each cell's distance decay and depth (which vary from cell
    to cell, with cycle and sequencing batch, and would otherwise dominate the input).
    The weight puts back how much each stratum holds (BandNorm, Zheng et al. 2022, with
    ``band_weight="mean"``): w_k = the training cells' mean of m_ck, so the near strata,
    where the cell-type signal is, weigh most; ``"sqrt"`` takes its square root, ``"none"``
    weighs every stratum alike (the input before this weight existed). Stratum 0 (the
    diagonal: most of a cell's contacts and, alone, little cell-type signal) is read
    with ``diagonal``, weighed like the others; otherwise its columns are zero. Which
    of these the model defaults to was measured on real cortex cells the model never
    trained on (``scripts/bench_science.py``: ablations ``band_none``, ``band_sqrt``,
    ``no_diagonal``, ``linear``). Without the log, a near stratum's feature weighs in
    proportion to its count: the log flattens the near strata towards the far ones, as the
    weight ``none`` does.

    ``band_mean`` (L,) is a buffer in the state dict, set once by :meth:`fit` from the
    training cells and saved with the model, so that ``ampflow embed`` applies exactly
    this transform to new cells and batches. Before :meth:`fit` it is all ones.
    """

    def __init__(self, feature_stratum: torch.Tensor, n_strata: int, band_weight: str = "mean", diagonal: bool = True, transform: str = "log1p"):
        super().__init__()
        if band_weight not in HIC_BAND_WEIGHTS:
            raise ValueError(f"band_weight must be one of {HIC_BAND_WEIGHTS}, not {band_weight!r}")
        if transform not in HIC_TRANSFORMS:
            raise ValueError(f"transform must be one of {HIC_TRANSFORMS}, not {transform!r}")
        self.n_strata, self.band_weight, self.diagonal, self.transform = n_strata, band_weight, diagonal, transform
        self.register_buffer("feature_stratum", feature_stratum.long(), persistent=False)
        self.register_buffer("sizes", torch.bincount(feature_stratum.long(), minlength=n_strata).double(), persistent=False)
        self.register_buffer("band_mean", torch.ones(n_strata))

    @torch.no_grad()
    def fit(self, totals: torch.Tensor) -> None:
        """Set ``band_mean`` from the training cells' contacts per stratum ``totals``
        (n_cells, L), as the mean over cells of each cell's mean count per feature."""
        if totals.shape[1] != self.n_strata or not len(totals):
            raise ValueError(f"need (n_cells >= 1, {self.n_strata}) stratum totals, got {tuple(totals.shape)}")
        mean = (totals.double() / self.sizes.cpu().clamp_min(1.0)).mean(0)
        self.band_mean.copy_(mean.to(self.band_mean))

    def weights(self) -> torch.Tensor:
        """w_k (L,), stratum 0's zero without ``diagonal``."""
        w = {"mean": self.band_mean, "sqrt": self.band_mean.clamp_min(0).sqrt(), "none": torch.ones_like(self.band_mean)}[self.band_weight]
        if not self.diagonal:
            w = torch.cat([w.new_zeros(1), w[1:]])
        return w

    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        """counts: (B, F) -> (B, F)."""
        totals = stratum_totals(counts, self.feature_stratum, self.n_strata)  # (B, L)
        per_stratum = self.sizes.to(counts.dtype) * self.weights().to(counts.dtype) / totals.clamp_min(1.0)
        x = counts * per_stratum[:, self.feature_stratum]
        return torch.log1p(x) if self.transform == "log1p" else x
