"""Which slice of a plain parameter each tensor-parallel rank holds, and how to put the
slices back together.

A sharded module keeps the plain module's parameter names; for each parameter that it
holds only a slice of, it records a :class:`Shard` (dimension, indices of this rank's
slice, full size). The ranks' index sets along that dimension are disjoint and cover it,
so a consolidated tensor is one scatter and one all-reduce (:func:`gather_full`), and
slicing a full tensor is one ``index_select`` (:meth:`Shard.take`). Checkpoints hold the
consolidated (single-process) state, so they resume on any mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from ..base.errors import InputError


@dataclass(frozen=True)
class Shard:
    """This rank's slice of a plain tensor: ``full.index_select(dim, index)``."""

    dim: int
    index: torch.Tensor  # (n_local,) long, sorted
    size: int  # full length along ``dim``

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``full`` (a new, contiguous tensor)."""
        if full.shape[self.dim] != self.size:
            raise ValueError(f"expected {self.size} along dim {self.dim}, got shape {tuple(full.shape)}")
        return full.index_select(self.dim, self.index.to(full.device)).contiguous()


def split_range(n: int, parts: int, part: int) -> tuple[int, int]:
    """``[lo, hi)`` of part ``part`` when ``n`` items are cut into ``parts`` contiguous,
    near-equal pieces (the first ``n % parts`` pieces one longer, as ``tensor_split``)."""
    base, extra = divmod(n, parts)
    lo = part * base + min(part, extra)
    return lo, lo + base + (1 if part < extra else 0)


def head_channels(D: int, heads: int, tp: int, rank: int) -> torch.Tensor:
    """Channels of width ``D`` that rank ``rank`` of ``tp`` holds under hidden parallelism.

    Every rank takes the same share of every attention head (head h owns channels
    ``[h*dh, (h+1)*dh)``, ``dh = D / heads``; the rank takes its contiguous ``dh / tp`` of
    each), so the local tensor still reshapes to ``(heads, n, dh / tp)`` and each head's
    scores are a sum of the ranks' partial dot products.

    Returns
    -------
    (D / tp,) long
    """
    dh = D // heads
    if D % heads or dh % tp:
        raise InputError(
            f"hidden parallelism over {tp} ranks needs the head width D/heads = {D}/{heads} divisible by {tp}",
            key="mesh.tp", value=tp,
        )  # fmt: skip
    part = dh // tp
    return torch.cat([torch.arange(h * dh + rank * part, h * dh + (rank + 1) * part) for h in range(heads)])


def feature_shards(bounds: list[int], tp: int, rank: int) -> tuple[torch.Tensor, list[int]]:
    """Features that rank ``rank`` of ``tp`` owns under feature parallelism: a contiguous,
    near-equal piece of every stratum (features are stratum-major; stratum k is
    ``[bounds[k], bounds[k+1])``).

    Returns
    -------
    index : (F_local,) long
        The rank's features, in the plain order.
    local_bounds : list of L + 1 ints
        Where each stratum's piece lies in ``index``. A stratum with fewer features
        than ranks leaves some ranks an empty piece.
    """
    pieces, local_bounds = [], [0]
    for k in range(len(bounds) - 1):
        lo, hi = split_range(bounds[k + 1] - bounds[k], tp, rank)
        pieces.append(torch.arange(bounds[k] + lo, bounds[k] + hi))
        local_bounds.append(local_bounds[-1] + hi - lo)
    return torch.cat(pieces).long(), local_bounds


def sharded_parameter(full: torch.Tensor, shard: Shard | None) -> nn.Parameter:
    """A new parameter holding ``shard``'s slice of ``full`` (all of it for None)."""
    data = full.detach().clone() if shard is None else shard.take(full.detach())
    return nn.Parameter(data, requires_grad=full.requires_grad)


def gather_full(local: torch.Tensor, shard: Shard, group) -> torch.Tensor:
    """The full tensor from every rank's ``local`` slice (a collective over ``group``;
    every rank gets it)."""
    shape = list(local.shape)
    shape[shard.dim] = shard.size
    full = local.new_zeros(shape)
    full.index_copy_(shard.dim, shard.index.to(local.device), local.detach())
    if group is not None:
        dist.all_reduce(full, group=group)
    return full
