"""S5 hidden parallelism: a stratum block whose width D is split over the tp group.

Each rank holds channels ``I`` of D (:func:`~.shards.head_channels`: an equal share of
every head) and a contiguous slice ``J`` of the feed-forward width ``ffn * D``. With
``h = LN(V)`` replicated:

* ``x_I = h W_v[I]^T`` and ``q_I = h W_k[I]^T``: local rows of the projections; ``h``
  enters through ``copy_to_group`` so that its gradient sums the ranks' parts.
* attention: each block's scores are the all-reduced sum of the ranks' partial dot
  products, scaled by ``1 / sqrt(D / heads)`` of the *global* head width; the values
  and the output stay local. Built on the banded kernel, as the plain block (S3's
  query chunks compose; without S3 the whole sequence is one block).
* ``LN(key)`` over D from every rank's mean and centred sum of squares, gathered in one
  collective (backward: both sums in one), saving only the normalised local channels.
* GEGLU: ``z = LN(key) W_ff^T`` is a partial sum over the local channels; the ranks
  all-reduce it and keep their slice ``J`` of both halves (an all-reduce, then a slice;
  a reduce-scatter would move less), so only
  ``a_J``, ``g_J`` are saved; ``W_out`` acts the same way in reverse (partial products
  over ``J``, all-reduced, slice ``I`` kept).

Every collective whose result feeds sharded computation is ``all_reduce_sum`` (sum in
both directions), so every parameter's gradient is exactly its slice of the
single-process gradient. Saved activations proportional to D shrink by ``tp``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..model.attention import local_attention_banded
from ..model.decoders import StratumBlock
from .collectives import all_reduce_sum, copy_to_group, group_gather, group_sum
from .shards import Shard, sharded_parameter, split_range


class _ShardedLayerNorm(torch.autograd.Function):
    """LayerNorm whose normalised dimension is split over a group, with its backward
    written out so that it saves what ``F.layer_norm`` saves: the normalised input
    (here this rank's channels) and one inverse deviation per row."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, width, group):
        # one collective: every rank's mean and centred sum of squares, combined as Chan
        # et al.'s parallel variance (M2 = sum M2_r + n_r sum (m_r - m)^2), as stable as
        # the two-pass variance; each collective is a round trip that the ranks wait on
        n = x.shape[-1]
        if n * dist.get_world_size(group) != width:
            raise ValueError(f"a sharded LayerNorm needs equal slices: {n} channels per rank of {width}")
        local_mean = x.mean(-1, keepdim=True)
        xc = x - local_mean
        stats = group_gather(torch.cat([local_mean, xc.square().sum(-1, keepdim=True)], -1), group)  # (tp, ..., 2)
        means = stats[..., :1]
        mean = means.mean(0)
        m2 = stats[..., 1:].sum(0) + n * (means - mean).square().sum(0)
        rstd = torch.rsqrt(m2 / width + eps)
        xhat = xc.sub_(mean - local_mean).mul_(rstd)
        ctx.save_for_backward(xhat, rstd, weight)
        ctx.width, ctx.group = width, group
        return xhat * weight + bias

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy):
        xhat, rstd, weight = ctx.saved_tensors
        rows = tuple(range(gy.dim() - 1))
        g = gy * weight
        # dx = rstd (g - mean(g) - xhat mean(g xhat)), the means over the global width,
        # both in one collective
        sums = group_sum(torch.cat([g.sum(-1, keepdim=True), (g * xhat).sum(-1, keepdim=True)], -1), ctx.group) / ctx.width
        m1, m2 = sums[..., :1], sums[..., 1:]
        dx = (g - m1 - xhat * m2) * rstd
        return dx, (gy * xhat).sum(rows), gy.sum(rows), None, None, None


def sharded_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, width: int, group) -> torch.Tensor:
    """LayerNorm over a last dimension of global size ``width`` split over ``group``.

    x: (..., width / tp) local channels; weight, bias: their (width / tp,) slices.
    Without a group this is ``F.layer_norm``.
    """
    if group is None:
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    return _ShardedLayerNorm.apply(x, weight, bias, eps, width, group)


class LocalLinear(nn.Module):
    """A slice of an ``nn.Linear``: ``weight`` / ``bias`` keep the plain names."""

    def __init__(self, plain: nn.Linear, weight_shard: Shard | None, bias_shard: Shard | None):
        super().__init__()
        self.weight = sharded_parameter(plain.weight, weight_shard)
        self.bias = sharded_parameter(plain.bias, bias_shard) if plain.bias is not None else None


class LocalNorm(nn.Module):
    def __init__(self, plain: nn.LayerNorm, shard: Shard | None):
        super().__init__()
        self.weight = sharded_parameter(plain.weight, shard)
        self.bias = sharded_parameter(plain.bias, shard)
        self.eps = plain.eps


class HiddenParallelStratumBlock(nn.Module):
    """:class:`~ampflow.model.decoders.StratumBlock` with D split over ``group``.

    Parameters
    ----------
    plain : StratumBlock
        The block to shard (left unchanged).
    channels : (D / tp,) long
        This rank's channels of D.
    tp, rank : int
        Group size and this rank's place in it.
    group : process group

    Attributes
    ----------
    shards : dict
        Parameter name -> :class:`Shard` for each parameter held in part.
    """

    def __init__(self, plain: StratumBlock, channels: torch.Tensor, tp: int, rank: int, group):
        super().__init__()
        D = plain.w_v.out_features
        width = plain.w_out.in_features  # ffn * D
        lo, hi = split_range(width, tp, rank)
        ffn = torch.arange(lo, hi)
        ffn2 = torch.cat([ffn, ffn + width])  # both GEGLU halves
        rows_d, rows_ffn2 = Shard(0, channels, D), Shard(0, ffn2, 2 * width)
        cols_d, cols_ffn = Shard(1, channels, D), Shard(1, ffn, width)
        self.heads, self.window, self.attention, self.chunk = plain.heads, plain.window, plain.attention, plain.chunk
        self.group, self.D = group, D
        device = plain.w_v.weight.device  # the indices are built on the CPU; the block may be on a GPU
        self.register_buffer("channels", channels.to(device, copy=True), persistent=False)
        self.register_buffer("ffn_cols", ffn2.to(device), persistent=False)
        self.norm_in = LocalNorm(plain.norm_in, None)
        self.w_v = LocalLinear(plain.w_v, rows_d, None)
        self.w_k = LocalLinear(plain.w_k, rows_d, None) if plain.w_k is not None else None
        self.norm_ff = LocalNorm(plain.norm_ff, rows_d)
        self.w_ff = LocalLinear(plain.w_ff, cols_d, rows_ffn2)
        self.w_out = LocalLinear(plain.w_out, cols_ffn, rows_d)
        self.shards = {
            "w_v.weight": rows_d, "norm_ff.weight": rows_d, "norm_ff.bias": rows_d,
            "w_ff.weight": cols_d, "w_ff.bias": rows_ffn2, "w_out.weight": cols_ffn, "w_out.bias": rows_d,
        }  # fmt: skip
        if self.w_k is not None:
            self.shards["w_k.weight"] = rows_d

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        """v: (n_anchors, latent), replicated -> this rank's channels of the key: (n_anchors, D / tp)."""
        g = self.group
        h = F.layer_norm(v, v.shape[-1:], self.norm_in.weight, self.norm_in.bias, self.norm_in.eps)
        h = copy_to_group(h, g)
        x = h @ self.w_v.weight.T
        key = x
        if self.attention:
            n, d_local = x.shape
            dh = d_local // self.heads
            qk = (h @ self.w_k.weight.T).view(n, self.heads, dh).transpose(0, 1)  # (H, n, dh / tp)
            val = x.view(n, self.heads, dh).transpose(0, 1)
            scale = 1.0 / math.sqrt(self.D // self.heads)
            combine = None if g is None else (lambda t: group_sum(t, g))
            att = local_attention_banded(qk, qk, val, self.window, self.chunk or None, scale, combine)
            key = x + att.transpose(0, 1).reshape(n, d_local)
        y = sharded_layer_norm(key, self.norm_ff.weight, self.norm_ff.bias, self.norm_ff.eps, self.D, g)
        z = all_reduce_sum(y @ self.w_ff.weight.T, g)  # (n, 2 * ffn * D): partial sums over D
        half = self.w_ff.bias.numel() // 2
        z = z[:, self.ffn_cols] + self.w_ff.bias
        a, gate = z[:, :half], z[:, half:]
        hidden = a * F.gelu(gate)  # (n, ffn * D / tp)
        out = all_reduce_sum(hidden @ self.w_out.weight.T, g)  # (n, D): partial sums over J
        return key + out[:, self.channels] + self.w_out.bias
