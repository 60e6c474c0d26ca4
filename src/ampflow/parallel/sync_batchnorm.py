"""Batch normalisation whose batch statistics span the cells of a whole process group.

Under data parallelism each rank holds only some of the batch's cells, so a plain
``nn.BatchNorm1d`` would normalise with statistics of those cells alone and the model
would no longer be the single-process one. ``torch.nn.SyncBatchNorm`` fixes that but
runs on CUDA only; this module does the same with ordinary collectives, so it also
runs on CPU with gloo (tests, the demo) and on NCCL.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .collectives import all_reduce_sum


class SyncBatchNorm1d(nn.BatchNorm1d):
    """``nn.BatchNorm1d`` with training statistics over every cell of ``group``.

    In training, Σx, Σx² and the element count per channel are all-reduced (one
    collective per call) and every rank normalises with the global mean and biased
    variance, then updates ``running_mean`` / ``running_var`` exactly as
    ``nn.BatchNorm1d`` would on the full batch (momentum or cumulative average;
    unbiased variance in ``running_var``). The all-reduce also sums gradients in
    backward: the statistics feed every rank's normalisation, so each rank's share of
    their gradient must reach every other rank. Hence every rank of the group must
    call forward and backward of each such layer the same number of times.

    In eval mode (with running statistics) nothing is communicated, and a None group
    (a group of one) makes the module exactly ``nn.BatchNorm1d``.

    Parameters
    ----------
    num_features, eps, momentum, affine, track_running_stats, device, dtype
        As for ``nn.BatchNorm1d``.
    group : ProcessGroup or None
        The data-parallel group whose cells form the batch.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, device=None, dtype=None, group=None):  # fmt: skip
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (N, C) or (N, C, L) -> same shape, normalised per channel C over N (and L)."""
        batch_stats = self.training or self.running_mean is None
        if self.group is None or not batch_stats:
            return super().forward(x)
        self._check_input_dim(x)
        C = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        # statistics in at least fp32: a half-precision count or Σx² is useless
        xs = x.to(torch.promote_types(x.dtype, torch.float32))
        # Shift by the running mean (identical on every rank) before summing: Σ(x-K)² -
        # (Σ(x-K))²/n cancels far less than Σx² - (Σx)²/n once K is near the mean.
        shift = self.running_mean.detach().to(xs.dtype) if self.running_mean is not None else xs.new_zeros(C)
        d = xs - shift.view(1, C, *[1] * (x.dim() - 2))
        local_n = xs.new_full((1,), x.numel() // C)
        stats = all_reduce_sum(torch.cat([d.sum(dims), d.square().sum(dims), local_n]), self.group)
        s1, s2, n = stats[:C], stats[C : 2 * C], stats[2 * C]
        count = int(n.detach())
        if count < 2:
            # the same on every rank (the count is global), so all ranks raise together
            raise ValueError(f"Expected more than 1 value per channel when training, got {count} over the group")
        mean_shifted = s1 / count
        var = (s2 / count - mean_shifted.square()).clamp_min(0.0)  # biased, as used for normalising
        mean = mean_shifted + shift
        if self.training and self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach() * (count / (count - 1)))
        shape = (1, C) + (1,) * (x.dim() - 2)
        y = (xs - mean.view(shape)) * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(x.dtype)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, unbiased_var: torch.Tensor) -> None:
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased_var.to(self.running_var.dtype), alpha=factor)


def convert_sync_batchnorm(module: nn.Module, group) -> nn.Module:
    """Replace every ``nn.BatchNorm1d`` in ``module`` by :class:`SyncBatchNorm1d` over ``group``.

    In place: the new layers take over the old ones' Parameter objects (so an
    optimizer built before the swap still holds them) and their buffers. Layers that
    are already :class:`SyncBatchNorm1d` get ``group`` set.

    Parameters
    ----------
    module : nn.Module
    group : ProcessGroup or None

    Returns
    -------
    nn.Module
        ``module``, or its replacement if ``module`` is itself a BatchNorm1d.
    """
    if isinstance(module, SyncBatchNorm1d):
        module.group = group
        return module
    if isinstance(module, nn.BatchNorm1d):
        new = SyncBatchNorm1d(module.num_features, module.eps, module.momentum, module.affine,
                              module.track_running_stats, group=group)  # fmt: skip
        if module.affine:
            new.weight, new.bias = module.weight, module.bias
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            setattr(new, name, getattr(module, name))
        new.train(module.training)
        return new
    for name, child in module.named_children():
        new_child = convert_sync_batchnorm(child, group)
        if new_child is not child:
            setattr(module, name, new_child)
    return module
