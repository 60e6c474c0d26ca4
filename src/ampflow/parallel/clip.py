"""Gradient-norm clipping over a model's shards: the norm of the whole model's gradient,
whichever strategy holds it.

On the Lee 2019 cortex cells a few training runs in ten blew up: within a few steps
every cell's Hi-C latent mean flew off (squared norm up to 2,400 against about 10) and
its width fell to the floor, the gradient's norm reached 45 to 119 where the steps
before had 0.04 to 0.05 (healthy runs never passed 0.75), and the validation loss took
30 epochs to come back: early stopping then kept a model from before the blow-up, a
fifth trained. Clipping the norm at 1 leaves every step of the healthy runs as it was
and keeps the others training (``scripts/bench_science.py``; README, "How well it
works").

Under tensor parallelism a sharded parameter's gradient is split over the tp group
(``model.shards``), each replicated one is whole on every rank: the squared norm is the
replicated part plus the sum over the group of the shards' parts, so every rank scales
by the same factor, the one process would use. Data parallelism sums the gradients
before this, so its ranks hold the same gradients. Everything stays on the device (no
host sync: a CUDA graph captures it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

#: added to the norm before dividing, as ``torch.nn.utils.clip_grad_norm_`` does
NORM_EPS = 1e-6


def gradient_norm(model: nn.Module) -> torch.Tensor:
    """The 2-norm of every parameter's gradient of ``model`` together (0-d, float32 or
    wider, on the parameters' device), over the tp group's shards (``model.shards``,
    ``model.tp_group``; see :func:`~ampflow.parallel.parallelize.parallelize`)."""
    shards = getattr(model, "shards", None) or {}
    group = getattr(model, "tp_group", None)
    whole, split = [], []
    for name, p in model.named_parameters():
        if p.grad is not None:
            (split if name in shards else whole).append(p.grad)
    first = (whole or split)[0]
    # the per-tensor norms in the gradients' dtype (no widened copy of a bf16 gradient),
    # summed in float32 at least
    dtype = torch.promote_types(first.dtype, torch.float32)

    def squares(grads: list[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros((), dtype=dtype, device=first.device)
        return torch.stack(torch._foreach_norm(grads)).to(dtype).square().sum()

    total = squares(whole)
    if shards:
        part = squares(split)
        if group is not None:
            dist.all_reduce(part, group=group)
        total = total + part
    return total.sqrt()


@torch.no_grad()
def clip_gradients(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Scale every gradient of ``model`` in place by ``min(1, max_norm / (norm + 1e-6))``
    (``norm``: :func:`gradient_norm`); returns the norm before clipping."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = gradient_norm(model)
    factor = (max_norm / (norm + NORM_EPS)).clamp(max=1.0)
    torch._foreach_mul_(grads, factor.to(grads[0].dtype))
    return norm


class ClipTally:
    """What clipping did in each training stage, for the log: steps whose norm was read,
    how many of them were above ``max_norm`` (scaled down) and the largest norm."""

    def __init__(self, max_norm: float | None):
        self.max_norm = max_norm
        self.stages: dict[str, list] = {}  # stage -> [steps, clipped, largest]

    def add(self, stage: str, norm: float) -> None:
        t = self.stages.setdefault(stage, [0, 0, 0.0])
        t[0] += 1
        t[1] += norm > self.max_norm
        t[2] = max(t[2], norm)

    def line(self, stage: str) -> str | None:
        """One log line for ``stage`` (None: no step of it was read)."""
        if stage not in self.stages:
            return None
        steps, clipped, largest = self.stages[stage]
        return (f"{stage}: the gradient norm was above train.clip_grad_norm {self.max_norm:g} on {clipped} of {steps} step(s) "
                f"and scaled down to it there (largest {largest:.3g})")  # fmt: skip
