"""S2 feature parallelism: the pieces that act on a rank's share of the Hi-C features.

Within a tp group every rank sees the same cells and owns a contiguous piece of every
stratum's features (:func:`~.shards.feature_shards`). Two places touch all features:

* the Hi-C encoder's input projection (:class:`FeatureParallelLinear`): each rank
  multiplies its columns, the partial sums are all-reduced (identity backward: what
  follows is replicated), the bias is added once;
* the decoder's per-stratum softmax (:func:`sharded_softmax`): the normaliser is
  combined over the ranks (every rank's max and sum of exponentials, gathered at once).

The reconstruction loss over a rank's features is summed locally and all-reduced in
:class:`~.sharded_decoder.ShardedStratifiedZINBDecoder`.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .collectives import group_gather, reduce_from_group
from .shards import Shard, sharded_parameter


class FeatureParallelLinear(nn.Module):
    """``nn.Linear(F, out)`` acting on a rank's features of a replicated input.

    Parameters
    ----------
    plain : nn.Linear
        The full projection (left unchanged).
    features : (F_local,) long
        This rank's input columns.
    group : process group
    """

    def __init__(self, plain: nn.Linear, features: torch.Tensor, group):
        super().__init__()
        self.group = group
        self.in_features, self.out_features = plain.in_features, plain.out_features
        shard = Shard(1, features.long(), plain.in_features)
        self.weight = sharded_parameter(plain.weight, shard)
        self.bias = sharded_parameter(plain.bias, None) if plain.bias is not None else None
        # on the layer's device: built after the model moved to its GPU, from CPU indices
        self.register_buffer("features", features.long().to(plain.weight.device, copy=True), persistent=False)
        self.shards = {"weight": shard}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, F) replicated input (only this rank's columns are read) -> (B, out)."""
        partial = x.index_select(1, self.features) @ self.weight.T
        y = reduce_from_group(partial, self.group)
        return y + self.bias if self.bias is not None else y


def sharded_softmax(logits: torch.Tensor, group) -> torch.Tensor:
    """Softmax along dim 1 of a row whose entries are spread over ``group``.

    logits: (B, n_local), possibly n_local = 0 -> (B, n_local). With no group this is
    ``torch.softmax``. One collective forward and one backward: every rank's max ``m_r``
    and sum ``s_r = sum exp(x - m_r)`` are gathered together (:func:`group_gather`), and
    the normaliser is ``sum_r s_r exp(m_r - M)`` with ``M`` the largest ``m_r`` (a
    log-sum-exp over ranks). The shifts only guard ``exp`` and need no gradient; the
    ``s_r`` are sums that every rank's probabilities depend on, so their gradients are
    summed over the ranks (the gather's backward).
    """
    if group is None:
        return torch.softmax(logits, dim=1)
    B = logits.shape[0]
    if logits.shape[1]:
        local_max = logits.detach().amax(1, keepdim=True)
        e = torch.exp(logits - local_max)
        local_sum = e.sum(1, keepdim=True)
    else:  # an empty piece adds nothing: exp(-inf - M) = 0
        local_max, local_sum, e = logits.new_full((B, 1), float("-inf")), logits.new_zeros((B, 1)), logits
    stats = group_gather(torch.cat([local_max, local_sum], 1), group)  # (tp, B, 2)
    maxima = stats[..., :1].detach()
    shift = maxima.amax(0)  # (B, 1)
    total = (stats[..., 1:] * torch.exp(maxima - shift)).sum(0)
    return e * (torch.exp(local_max - shift) / total)
