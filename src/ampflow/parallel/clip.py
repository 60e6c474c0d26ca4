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

from ..contract.config import CLIP_ZSCORE

#: added to the norm before dividing, as ``torch.nn.utils.clip_grad_norm_`` does
NORM_EPS = 1e-6


def norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype :func:`gradient_norm` returns for gradients of ``dtype``: float32 or wider."""
    return torch.promote_types(dtype, torch.float32)


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
    dtype = norm_dtype(first.dtype)

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


#: ZClip's published settings (its README and paper): the z-score above which a norm is a
#: spike, the moving statistics' smoothing and the warm-up steps that seed them
ZSCORE_Z, ZSCORE_ALPHA, ZSCORE_WARMUP = 2.5, 0.97, 25


class ZScoreBound:
    """A bound that follows the run's own norms: ZClip's z-score rule (Kumar et al. 2025,
    "ZClip: Adaptive Spike Mitigation for LLM Pre-Training", with its published settings).

    The first ``warmup`` norms are left as they are and give the mean and variance; from
    then on a norm whose z-score against the exponential moving mean and variance
    (``alpha``) is above ``z`` is a spike and is scaled down to ``mean + z**2 * std /
    z_score`` (the larger the spike, the nearer the mean), and the moving statistics
    take the scaled norm, so that a spike does not widen the bound for the next one.

    Why: a fixed bound is a scale the user must know. A step's norm has a median of 0.04
    on the Lee 2019 cells and of 31 on the demo (12 to 236), so a bound of 1 left
    the first alone (but for a few steps of 1 to 2 and the blow-ups of 45 to 119) and
    would scale every step of the second. This bound is relative to the run's own norms:
    on the Lee cells it scaled 2 to 3% of the steps and scored as the bound of 1 did
    (``docs/measurements.md``), on the demo about 2%, on the HiRES control 0.6 to 9%
    (the most where a norm reached 2,510 against a median of 26).

    The state is three 0-d tensors on the norm's device, updated in place (a CUDA graph
    captures it, with no host read): steps seen, moving mean, moving variance.
    :meth:`reset` starts a new warm-up (a training stage with other learning rate and loss
    weights has norms of another scale); :meth:`state` and :meth:`load` carry it through
    a checkpoint, so that a resumed run scales as the uninterrupted one.
    """

    def __init__(self, z: float = ZSCORE_Z, alpha: float = ZSCORE_ALPHA, warmup: int = ZSCORE_WARMUP):
        self.z, self.alpha, self.warmup = z, alpha, warmup
        self.count = self.mean = self.var = None
        #: the bound of the last step (inf: not a spike, left as it was); on the device
        self.last: torch.Tensor | None = None

    def prepare(self, dtype: torch.dtype, device) -> None:
        """Make the state tensors (zero) if they do not exist yet, for gradients of
        ``dtype`` on ``device`` (in the norm's dtype, :func:`norm_dtype`)."""
        if self.count is None:
            kw = dict(dtype=norm_dtype(dtype), device=device)
            self.count, self.mean, self.var = (torch.zeros((), **kw) for _ in range(3))
            self.last = torch.full((), float("inf"), **kw)

    def tensors(self) -> list[torch.Tensor]:
        """The state tensors (empty before the first step), for a capture to save and put back."""
        return [] if self.count is None else [self.count, self.mean, self.var, self.last]

    @torch.no_grad()
    def __call__(self, norm: torch.Tensor) -> torch.Tensor:
        """This step's bound for ``norm`` (inf where it is no spike); updates the state."""
        self.prepare(norm.dtype, norm.device)
        warm = self.count < self.warmup
        std = self.var.sqrt()
        score = (norm - self.mean) / (std + NORM_EPS)
        spike = ~warm & (score > self.z)
        bound = torch.where(spike, self.mean + self.z * self.z * std / score, torch.full_like(norm, float("inf")))
        seen = torch.where(spike, bound, norm)
        # warm-up: the running mean and (population) variance of the norms so far (Welford)
        n = self.count + 1
        delta = norm - self.mean
        w_mean = self.mean + delta / n
        w_var = self.var + (delta * (norm - w_mean) - self.var) / n
        # then the moving ones, of the norm as scaled
        e_mean = self.alpha * self.mean + (1 - self.alpha) * seen
        e_var = self.alpha * self.var + (1 - self.alpha) * (seen - e_mean).square()
        self.mean.copy_(torch.where(warm, w_mean, e_mean))
        self.var.copy_(torch.where(warm, w_var, e_var))
        self.count.add_(1)
        self.last.copy_(bound)
        return bound

    def reset(self) -> None:
        """A new warm-up from the next step (in place: a captured graph keeps its addresses)."""
        if self.count is not None:
            for t in (self.count, self.mean, self.var):
                t.zero_()
            self.last.fill_(float("inf"))

    def state(self) -> dict:
        """The state as plain floats (a checkpoint's); empty before the first step."""
        return {} if self.count is None else {k: float(getattr(self, k)) for k in ("count", "mean", "var")}

    def load(self, state: dict, dtype: torch.dtype, device) -> None:
        """Back to :meth:`state`'s values (in place where the tensors exist)."""
        if not state:
            return
        self.prepare(dtype, device)
        for k in ("count", "mean", "var"):
            getattr(self, k).fill_(state[k])


def make_bound(setting: float | str | None) -> float | ZScoreBound | None:
    """``train.clip_grad_norm`` as :func:`clip_gradients` takes it: a number (a fixed
    bound), :data:`~ampflow.contract.config.CLIP_ZSCORE` (a :class:`ZScoreBound` of its own) or None (no clipping)."""
    # the settings read when called, not when defined (tests shorten the warm-up)
    return ZScoreBound(ZSCORE_Z, ZSCORE_ALPHA, ZSCORE_WARMUP) if setting == CLIP_ZSCORE else setting


@torch.no_grad()
def clip_gradients(model: nn.Module, max_norm: float | ZScoreBound) -> torch.Tensor:
    """Scale every gradient of ``model`` in place by ``min(1, max_norm / (norm + 1e-6))``
    (``norm``: :func:`gradient_norm`; ``max_norm`` a number or a :class:`ZScoreBound`,
    which gives this step's bound); returns the norm before clipping."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = gradient_norm(model)
    if isinstance(max_norm, ZScoreBound):
        max_norm = max_norm(norm)
    factor = (max_norm / (norm + NORM_EPS)).clamp(max=1.0)
    torch._foreach_mul_(grads, factor.to(grads[0].dtype))
    return norm


class ClipTally:
    """What clipping did in each training stage, for the log: steps whose norm was read,
    how many of them were scaled down and the largest norm. ``setting`` is
    ``train.clip_grad_norm``: a fixed bound scales a norm above it; with :data:`~ampflow.contract.config.CLIP_ZSCORE`
    a step was scaled where its row's bound is not None."""

    def __init__(self, setting: float | str | None):
        self.setting = setting
        self.stages: dict[str, list] = {}  # stage -> [steps, clipped, largest]

    def add(self, stage: str, norm: float, bound: float | None = None) -> None:
        t = self.stages.setdefault(stage, [0, 0, 0.0])
        t[0] += 1
        t[1] += bound is not None if self.setting == CLIP_ZSCORE else norm > self.setting
        t[2] = max(t[2], norm)

    def line(self, stage: str) -> str | None:
        """One log line for ``stage`` (None: no step of it was read)."""
        if stage not in self.stages:
            return None
        steps, clipped, largest = self.stages[stage]
        if self.setting == CLIP_ZSCORE:
            return (f"{stage}: the gradient norm was a spike (z-score above {ZSCORE_Z:g} against its moving mean and spread) "
                    f"on {clipped} of {steps} step(s) and scaled down there (largest {largest:.3g})")  # fmt: skip
        return (f"{stage}: the gradient norm was above train.clip_grad_norm {self.setting:g} on {clipped} of {steps} step(s) "
                f"and scaled down to it there (largest {largest:.3g})")  # fmt: skip
