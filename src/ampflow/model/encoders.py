"""Cell encoders: counts -> Normal(loc, std) over the cell latent."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
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
    nothing (``"linear"``); with ``pcs`` > 0, that input projected on the training
    cells' first ``pcs`` principal axes.

    Dividing by m_ck takes out each cell's distance decay and depth (which vary from cell
    to cell, with cycle and sequencing batch, and would otherwise dominate the input).
    The weight puts back how much each stratum holds (BandNorm, Zheng et al. 2022, with
    ``band_weight="mean"``): w_k = the training cells' mean of m_ck, so the near strata,
    where the cell-type signal is, weigh most; ``"sqrt"`` takes its square root, ``"none"``
    weighs every stratum alike (the input before this weight existed). Stratum 0 (the
    diagonal: most of a cell's contacts and, alone, little cell-type signal) is read
    with ``diagonal``, weighed like the others; otherwise its columns are zero. Strata
    beyond ``max_stratum`` (None: none) are zero too: without the log a far stratum's
    few contacts, divided by a sparse cell's small m_ck, give the largest values of
    all and pull the principal axes onto those cells. Which of these the model
    defaults to was measured on real cortex cells the model never trained on
    (``scripts/bench_science.py``: ablations ``band_none``, ``band_sqrt``,
    ``no_diagonal``, ``linear``, ``near_pcs``). Without the log, a near stratum's feature
    weighs in proportion to its count: the log flattens the near strata towards the far
    ones, as the weight ``none`` does.

    The projection (``pcs``) is what GLUE's encoders read (a PCA or LSI of the data,
    ``use_rep``): ``(x - mean) A^T A`` with A the axes, so the encoder keeps its width and
    its feature-parallel shards. It takes out the directions in which the training cells
    differ least, mostly each cell's own counting noise, before the encoder sees them.

    ``band_mean`` (L,), and with ``pcs`` ``pca_mean`` (F,) and ``pca_axes`` (k, F), are
    buffers in the state dict, set once by :meth:`fit` from the training cells and saved
    with the model, so that ``ampflow embed`` applies exactly this transform to new cells
    and batches. Before :meth:`fit` the band means are all ones and the axes zero.
    """

    def __init__(self, feature_stratum: torch.Tensor, n_strata: int, band_weight: str = "mean", diagonal: bool = True, transform: str = "log1p",
                 max_stratum: int | None = None, pcs: int = 0):  # fmt: skip
        super().__init__()
        if band_weight not in HIC_BAND_WEIGHTS:
            raise ValueError(f"band_weight must be one of {HIC_BAND_WEIGHTS}, not {band_weight!r}")
        if transform not in HIC_TRANSFORMS:
            raise ValueError(f"transform must be one of {HIC_TRANSFORMS}, not {transform!r}")
        self.n_strata, self.band_weight, self.diagonal, self.transform = n_strata, band_weight, diagonal, transform
        self.max_stratum, self.pcs = max_stratum, int(pcs)
        self.register_buffer("feature_stratum", feature_stratum.long(), persistent=False)
        self.register_buffer("sizes", torch.bincount(feature_stratum.long(), minlength=n_strata).double(), persistent=False)
        self.register_buffer("band_mean", torch.ones(n_strata))
        # the strata read, fixed by the settings: a mask made once, so that the step sets no
        # element of a device tensor from the host (a copy a captured CUDA graph forbids)
        stratum = torch.arange(n_strata)
        keep = (stratum >= (0 if diagonal else 1)) & (stratum <= (n_strata if max_stratum is None else max_stratum))
        self.register_buffer("keep", keep, persistent=False)
        if self.pcs:
            self.register_buffer("pca_mean", torch.zeros(len(feature_stratum)))
            self.register_buffer("pca_axes", torch.zeros(self.pcs, len(feature_stratum)))

    @classmethod
    def from_config(cls, cfg, feature_stratum: torch.Tensor, n_strata: int) -> HiCInput:
        """The input a :class:`~ampflow.contract.config.ModelConfig` describes."""
        return cls(feature_stratum, n_strata, cfg.hic_band_weight, cfg.hic_diagonal, cfg.hic_transform, cfg.hic_max_stratum, cfg.hic_pcs)

    @torch.no_grad()
    def fit(self, totals: torch.Tensor, counts=None, seed: int = 0) -> None:
        """Set ``band_mean`` from the training cells' contacts per stratum ``totals``
        (n_cells, L), as the mean over cells of each cell's mean count per feature; with
        ``pcs``, the principal axes of those cells' input from their ``counts`` (n_cells,
        F; scipy sparse or dense, never densified when sparse; ARPACK from ``seed``)."""
        if totals.shape[1] != self.n_strata or not len(totals):
            raise ValueError(f"need (n_cells >= 1, {self.n_strata}) stratum totals, got {tuple(totals.shape)}")
        mean = (totals.double() / self.sizes.cpu().clamp_min(1.0)).mean(0)
        self.band_mean.copy_(mean.to(self.band_mean))
        if not self.pcs:
            return
        if counts is None or counts.shape[0] != len(totals):
            raise ValueError(f"pcs = {self.pcs} needs the {len(totals)} training cells' counts to fit its axes")
        mean, axes = self._principal_axes(counts, totals.double().cpu().numpy(), seed)
        self.pca_mean.copy_(torch.as_tensor(mean).to(self.pca_mean))
        self.pca_axes.zero_()
        self.pca_axes[: len(axes)] = torch.as_tensor(axes).to(self.pca_axes)

    def _principal_axes(self, counts, totals: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """Centre (F,) and axes (k, F), k = min(pcs, n - 1, F - 1), of the input of
        ``counts`` in float64, computed sparse as :meth:`forward` computes it dense."""
        from sklearn.decomposition import PCA

        stratum = self.feature_stratum.cpu().numpy()
        factor = self.sizes.cpu().numpy() * self.weights().double().cpu().numpy() / np.maximum(totals, 1.0)  # (n, L)
        x = sp.csr_matrix(counts, dtype=np.float64, copy=True)
        x.data *= factor[np.repeat(np.arange(x.shape[0]), np.diff(x.indptr)), stratum[x.indices]]
        if self.transform == "log1p":
            x.data = np.log1p(x.data)
        x.eliminate_zeros()
        k = min(self.pcs, x.shape[0] - 1, x.shape[1] - 1)
        if k < 1:
            raise ValueError(f"pcs = {self.pcs} needs at least 2 training cells and 2 features, got {x.shape[0]} and {x.shape[1]}")
        pca = PCA(n_components=k, svd_solver="arpack", random_state=seed).fit(x)
        # ARPACK's signs are arbitrary; the projection A^T A does not depend on them
        return np.ascontiguousarray(pca.mean_), np.ascontiguousarray(pca.components_)

    def weights(self) -> torch.Tensor:
        """w_k (L,): stratum 0's zero without ``diagonal``, those beyond ``max_stratum`` zero."""
        w = {"mean": self.band_mean, "sqrt": self.band_mean.clamp_min(0).sqrt(), "none": torch.ones_like(self.band_mean)}[self.band_weight]
        return torch.where(self.keep, w, torch.zeros_like(w))

    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        """counts: (B, F) -> (B, F)."""
        totals = stratum_totals(counts, self.feature_stratum, self.n_strata)  # (B, L)
        per_stratum = self.sizes.to(counts.dtype) * self.weights().to(counts.dtype) / totals.clamp_min(1.0)
        x = counts * per_stratum[:, self.feature_stratum]
        x = torch.log1p(x) if self.transform == "log1p" else x
        if self.pcs:
            axes = self.pca_axes.to(x.dtype)
            x = ((x - self.pca_mean.to(x.dtype)) @ axes.T) @ axes
        return x
