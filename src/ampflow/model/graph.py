"""Guidance-graph encoder (node embeddings -> Normal over node latents) and decoder."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..contract.model_shapes import graph_encoder_params
from .encoders import STD_EPS
from .layers import linear_from


class GraphConv(nn.Module):
    """Signed, weighted, degree-normalised propagation: out_i = sum_j s_ij w_ij x_j / sqrt(d_i d_j).

    The edge list (both directions, with self-loops) is fixed, so the normalised
    coefficients are computed once and kept as buffers.
    """

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, weight: torch.Tensor, sign: torch.Tensor, n_nodes: int):
        super().__init__()
        deg = torch.zeros(n_nodes, dtype=weight.dtype).index_add_(0, dst, weight)
        coef = sign * weight / torch.sqrt(deg[src] * deg[dst]).clamp_min(1e-12)
        self.register_buffer("src", src, persistent=False)
        self.register_buffer("dst", dst, persistent=False)
        self.register_buffer("coef", coef, persistent=False)
        self.n_nodes = n_nodes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (n_nodes, d) -> (n_nodes, d)."""
        msg = x.index_select(0, self.src) * self.coef.to(x.dtype).unsqueeze(1)
        return torch.zeros_like(x).index_add_(0, self.dst, msg)


class GraphEncoder(nn.Module):
    """Learned node embeddings -> GraphConv -> SELU -> GraphConv -> Normal(loc, softplus(std))."""

    def __init__(self, n_nodes: int, latent: int, src, dst, weight, sign):
        super().__init__()
        p = graph_encoder_params(n_nodes, latent)
        self.embedding = nn.Parameter(torch.empty(p["embedding"].shape))
        nn.init.xavier_uniform_(self.embedding)
        self.conv = GraphConv(src, dst, weight, sign, n_nodes)
        self.loc = linear_from(p, "loc")
        self.std = linear_from(p, "std")

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        """-> loc, std: (n_nodes, latent)."""
        h = F.selu(self.conv(self.embedding))
        h = self.conv(h)
        return self.loc(h), F.softplus(self.std(h)) + STD_EPS


def graph_sample_sizes(n_edges: int, neg_samples: int, batch: int) -> tuple[int, int]:
    """(positive edges, negative targets) that :func:`graph_nll` samples per step."""
    m = min(batch, n_edges)
    return m, m * neg_samples


def graph_nll(v: torch.Tensor, src, dst, weight, sign, neg_samples: int, batch: int, generator=None, sample=None) -> torch.Tensor:
    """Graph decoder loss: Bernoulli(sigmoid(sign * <v_s, v_t>)) on a sample of edges
    (positives, weighted by edge weight) and ``neg_samples`` random targets per positive.

    Parameters
    ----------
    v : (n_nodes, d) node latents (a sample).
    src, dst, weight, sign : (E,) edge list.
    generator : torch.Generator for the edge and negative sampling (None: global RNG).
    sample : (idx, nt), optional
        The edge indices and negative targets (drawn as here, in this order: :func:`~ampflow.train.static_step.draw_step`) instead of
        drawing them here: a step that runs with no host round-trip draws them on its
        device beforehand (a CPU generator's draws would be copied to the GPU mid-step).
    """
    n_edges, n_nodes = src.numel(), v.shape[0]
    if sample is not None:
        idx, nt = sample
    else:
        # drawn by the generator where it lives (the CPU by default), used where v is
        idx = torch.randint(n_edges, (min(batch, n_edges),), generator=generator).to(v.device)
    s, t, w, sg = src[idx], dst[idx], weight[idx].to(v.dtype), sign[idx].to(v.dtype)
    pos_logit = sg * (v.index_select(0, s) * v.index_select(0, t)).sum(1)
    loss_pos = F.binary_cross_entropy_with_logits(pos_logit, torch.ones_like(pos_logit), weight=w, reduction="sum")
    if neg_samples:
        ns = s.repeat(neg_samples)
        if sample is None:
            nt = torch.randint(n_nodes, (ns.numel(),), generator=generator).to(v.device)
        neg_logit = sg.repeat(neg_samples) * (v.index_select(0, ns) * v.index_select(0, nt)).sum(1)
        loss_neg = F.binary_cross_entropy_with_logits(neg_logit, torch.zeros_like(neg_logit), reduction="sum")
    else:
        loss_neg = v.new_zeros(())
    return (loss_pos + loss_neg) / (idx.numel() * (1 + neg_samples))
