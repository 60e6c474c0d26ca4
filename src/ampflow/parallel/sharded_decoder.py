"""The stratified ZINB Hi-C decoder sharded over a tensor-parallel group (S2 and/or S5).

Built from a plain :class:`~ampflow.model.decoders.StratifiedZINBDecoder`, with the same
parameter names in the same order, and answering the same :meth:`mean_nll` that
:class:`~ampflow.model.paired.PairedModel` calls, so the model's code is not touched.

* S5 (``hidden``): every stratum block is a
  :class:`~.hidden_parallel.HiddenParallelStratumBlock`, ``u_D`` holds this rank's
  channels, and the decode ``u_D . key[F_k]^T`` is a partial product over the channels,
  all-reduced.
* S2 (``features``): this rank decodes its piece of every stratum's features: logits,
  the stratum softmax (normaliser combined over the ranks), the mean and the ZINB
  likelihood, whose sum is all-reduced. The replicated tensors that enter this
  feature-sharded computation (keys, ``u``) pass ``copy_to_group`` so
  that their gradients sum the ranks' parts.
* Both: the partial products are all-reduced for all of the stratum's features and each
  rank keeps its piece (an all-reduce, sum forward and backward, then a slice; not a
  reduce-scatter, which would move less).

S3 (chunk) and S4 (key-first) are read from the plain decoder and compose.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..model.decoders import StratifiedZINBDecoder
from ..model.prob import ZINB
from .collectives import all_reduce_sum, copy_to_group, reduce_from_group
from .feature_parallel import sharded_softmax
from .hidden_parallel import HiddenParallelStratumBlock, LocalLinear
from .shards import Shard, feature_shards, head_channels, sharded_parameter


class ShardedStratifiedZINBDecoder(nn.Module):
    """See the module docstring.

    Parameters
    ----------
    plain : StratifiedZINBDecoder
    group : process group (None for a group of one)
    tp, rank : int
        Group size and this rank's place in it.
    features, hidden : bool
        Apply S2, S5.

    Attributes
    ----------
    shards : dict
        Parameter name -> :class:`~.shards.Shard` of the parameters held in part.
    """

    def __init__(self, plain: StratifiedZINBDecoder, group, tp: int, rank: int, features: bool, hidden: bool):
        super().__init__()
        self.group, self.features, self.hidden = group, features, hidden
        self.n_strata, self.key_first, self.n_batches = plain.n_strata, plain.key_first, plain.n_batches
        n_features = plain.scale_lin.numel()
        if features:
            local, self.local_bounds = feature_shards(plain.bounds, tp, rank)
        else:
            local, self.local_bounds = torch.arange(n_features), list(plain.bounds)
        fshard = Shard(0, local, n_features) if features else None
        # the likelihood's scored strata (model.hic_likelihood): this rank's features of
        # them, a range of its own since they are in stratum-major order too, and how
        # many features they are in all
        self.scored_local, self.n_scored = None, n_features
        if plain.scored_strata is not None:
            first, last = plain.scored_strata
            self.scored_local = (self.local_bounds[first], self.local_bounds[last + 1])
            self.n_scored = plain.scored_features[1] - plain.scored_features[0]
        # own parameters first, in the plain order (named_parameters lists them first)
        for name in ("scale_lin", "bias", "log_theta", "zi_logits"):
            setattr(self, name, sharded_parameter(getattr(plain, name), fshard))
        self.loading = sharded_parameter(plain.loading, fshard)
        # index buffers on the plain decoder's device: it is sharded after the model moved
        # to its GPU, and the indices are built on the CPU
        device = plain.scale_lin.device
        self.register_buffer("local_features", local.to(device), persistent=False)
        self.register_buffer("feature_anchor", plain.feature_anchor.clone(), persistent=False)
        self.bounds = list(plain.bounds)
        self.shards: dict[str, Shard] = {}
        if fshard is not None:
            self.shards.update({name: fshard for name in ("scale_lin", "bias", "log_theta", "zi_logits", "loading")})
        if hidden:
            D = plain.u_proj.out_features if plain.u_proj is not None else plain.loading.shape[1] - plain.n_batches
            heads = plain.blocks[0].heads if len(plain.blocks) else 1
            channels = head_channels(D, heads, tp, rank)
            self.register_buffer("channels", channels.to(device), persistent=False)
            self.blocks = nn.ModuleList(HiddenParallelStratumBlock(b, channels, tp, rank, group) for b in plain.blocks)
            for i, b in enumerate(self.blocks):
                self.shards.update({f"blocks.{i}.{n}": s for n, s in b.shards.items()})
            if plain.u_proj is not None:
                self.u_proj = LocalLinear(plain.u_proj, Shard(0, channels, D), None)
                self.shards["u_proj.weight"] = Shard(0, channels, D)
            else:
                self.u_proj = None
        else:
            self.blocks = plain.blocks
            self.u_proj = plain.u_proj

    # ------------------------------------------------------------------ pieces
    loading_input = StratifiedZINBDecoder.loading_input

    def _u_D(self, u: torch.Tensor) -> torch.Tensor:
        """The query of strata k >= 1: (B, D), or this rank's (B, D / tp) under S5."""
        if not self.hidden:
            return self.u_proj(u) if self.u_proj is not None else u
        u = copy_to_group(u, self.group)
        return u @ self.u_proj.weight.T if self.u_proj is not None else u.index_select(1, self.channels)

    def _stratum_logits(self, k: int, u: torch.Tensor, u_D: torch.Tensor, v_anchors: torch.Tensor, u_load: torch.Tensor) -> torch.Tensor:
        """Logits of this rank's features of stratum k: (B, |local piece of F_k|).

        Under S2, ``u``, ``u_load`` and (without S5) ``u_D`` have passed
        ``copy_to_group`` once for all strata (:meth:`mean_nll`): their gradients sum
        over the strata here and are all-reduced once, not once per stratum."""
        lo, hi = self.local_bounds[k], self.local_bounds[k + 1]
        fg = self.group if self.features else None
        if k == 0 or not self.hidden:
            key, q = (v_anchors, u) if k == 0 else (self.blocks[k - 1](v_anchors), u_D)
            key = copy_to_group(key, fg)
            raw = self._product(q, key, self.feature_anchor[self.local_features[lo:hi]])
        else:
            key = self.blocks[k - 1](v_anchors)  # (n, D / tp)
            if self.features:  # partial over channels for the whole stratum; keep this rank's piece
                full_lo = self.bounds[k]
                partial = self._product(u_D, key, self.feature_anchor[self.bounds[k] : self.bounds[k + 1]])
                raw = all_reduce_sum(partial, self.group).index_select(1, self.local_features[lo:hi] - full_lo)
            else:
                raw = reduce_from_group(self._product(u_D, key, self.feature_anchor[lo:hi]), self.group)
        loadings = u_load @ self.loading[lo:hi].T
        return F.softplus(self.scale_lin[lo:hi]) * raw + loadings + self.bias[lo:hi]

    def _product(self, q: torch.Tensor, key: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """``q . key[anchors]^T`` (S4) or ``(q . key^T)[:, anchors]``: (B, len(anchors))."""
        return q @ key.index_select(0, anchors).T if self.key_first else (q @ key.T).index_select(1, anchors)

    # ------------------------------------------------------------------ loss
    def mean_nll(self, u: torch.Tensor, v_anchors: torch.Tensor, band_totals: torch.Tensor, x: torch.Tensor, on_stratum=None, cond=None) -> torch.Tensor:
        """The plain decoder's ``mean_nll`` from this rank's share (of the scored
        features); equal on every rank.

        u: (B, latent), v_anchors: (n_anchors, latent), band_totals: (B, L), x: (B, F)
        and cond: (B, n_batches) or None replicated over the group -> 0-d.
        """
        fg = self.group if self.features else None
        u_D = self._u_D(u)
        u_load = copy_to_group(self.loading_input(u, cond), fg)
        if not self.hidden:  # under S5 the strata k >= 1 all-reduce their partial products instead
            u_D = copy_to_group(u_D, fg)
        u = copy_to_group(u, fg)  # stratum 0's query
        means = []
        for k in range(self.n_strata):
            p = sharded_softmax(self._stratum_logits(k, u, u_D, v_anchors, u_load), fg)
            means.append(p * band_totals[:, k : k + 1])
            if on_stratum is not None:
                on_stratum(k)
        mu = torch.cat(means, dim=1)
        x_local = x.index_select(1, self.local_features) if self.features else x
        log_p = ZINB(mu, self.log_theta.exp(), self.zi_logits.expand_as(mu)).log_prob(x_local)
        if self.scored_local is None:
            log_p = log_p.sum()
        else:
            lo, hi = self.scored_local
            log_p = log_p.sum(0)[lo:hi].sum()
        return -reduce_from_group(log_p, fg) / (x.shape[0] * self.n_scored)
