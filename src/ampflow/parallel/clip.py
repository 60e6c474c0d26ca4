"""Gradient-norm clipping over a model's shards: the norm of the whole model's gradient,
whichever strategy holds it.

Why: a training run on real cortex cells (Lee 2019) can blow up. Within a few steps every
training cell's Hi-C latent mean flies off (squared norm up to 2,400 where it is about
10) and its width falls to the floor; the gradient's norm reached 45 and 119 in the two
runs of ten that did so with an input tried and not adopted, where every step of the
others stayed below 0.75 (median 0.04). The validation loss then takes longer than early
stopping waits to come back, and the stage keeps a model from before the blow-up, a fifth
trained. Clipped at 1, both trained on (held-out ARI 0.17 and 0.62 became 0.45 and 0.78)
and the two runs beside them repeated bit for bit: a norm under the bound is left as it
is. With the template's settings (15 runs) 10 never passed 0.82 and 5 passed 1 on one or
two steps (at most 1.94).

Under tensor parallelism a sharded parameter's gradient is split over the tp group
(``model.shards``), each replicated one is whole on every rank: the squared norm is the
replicated part plus the sum over the group of the shards' parts, so every rank scales
by the factor one process would use. Data parallelism sums the gradients before this, so
its ranks hold the same gradients. Everything stays on the device (no host sync: a CUDA
graph captures it).
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
