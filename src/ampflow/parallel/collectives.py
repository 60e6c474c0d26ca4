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


def all_reduce_max(x: torch.Tensor, group) -> torch.Tensor:
    """Element-wise max over the group, outside autograd (e.g. a softmax shift, whose
    value does not change the result and so needs no gradient)."""
    if group is None:
        return x
    with torch.no_grad():
        return _all_reduce(x.detach(), group, dist.ReduceOp.MAX)
