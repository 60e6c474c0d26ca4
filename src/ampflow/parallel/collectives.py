"""Collectives inside the autograd graph, each paired with its adjoint.

Following Megatron-LM's mappings: a value all-reduced in forward that then feeds only
replicated computation needs identity in backward (:func:`reduce_from_group`, "g");
a replicated value entering sharded computation needs an all-reduce of its gradient
(:func:`copy_to_group`, "f"); a partial sum that feeds sharded computation needs the
all-reduce in both directions (:func:`all_reduce_sum`). The group is always explicit;
a None group (size one) makes every function the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    x = x.contiguous().clone()
    dist.all_reduce(x, op=op, group=group)
    return x


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


def copy_to_group(x: torch.Tensor, group) -> torch.Tensor:
    """f: identity forward, all-reduce (sum) of the gradient backward."""
    return x if group is None else _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group) -> torch.Tensor:
    """g: all-reduce (sum) forward, identity backward."""
    return x if group is None else _ReduceFromGroup.apply(x, group)


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """All-reduce (sum) forward and backward: for partial sums feeding sharded compute."""
    return x if group is None else _AllReduceSum.apply(x, group)


def group_sum(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over the group, outside autograd: for hand-written forward and backward
    passes (custom autograd Functions) that place their own collectives."""
    return x if group is None else _all_reduce(x, group)


def group_gather(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``x`` (same shape on every rank), stacked in group-rank order:
    ``(group size, *x.shape)``, in one collective. Built as the sum of buffers that are
    zero outside each rank's row (an all-reduce: the collective every backend has), so
    under autograd the gradient of a rank's row is the sum of every rank's gradient of
    it (what a value that all ranks' losses read needs). No group: ``x[None]``."""
    if group is None:
        return x.unsqueeze(0)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = [x.new_zeros((rank, *x.shape)), x.unsqueeze(0), x.new_zeros((size - rank - 1, *x.shape))]
    return all_reduce_sum(torch.cat(rows), group)
