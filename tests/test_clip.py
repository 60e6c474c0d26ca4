"""Gradient-norm clipping (``train.clip_grad_norm``): the whole model's norm and the scaled
gradients against torch's own ``clip_grad_norm_``; under every parallel strategy it is
part of tests/parallel_equivalence.py's step (the referee there: one process)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from parallel_equivalence import WEIGHTS, _problem

from ampflow.base.errors import InputError
from ampflow.contract.config import TrainConfig
from ampflow.parallel.clip import ZScoreBound, clip_gradients, gradient_norm


def _gradients(dtype=torch.float32):
    model, rna, hic, cond = _problem(dtype, "narrow")
    model.train()
    torch.manual_seed(0)
    model(rna, hic, WEIGHTS, generator=torch.Generator().manual_seed(1), cond=cond)["total"].backward()
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_clipping_equals_torch_clip_grad_norm(dtype):
    ours, theirs = _gradients(dtype), _gradients(dtype)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours.parameters(), theirs.parameters()))
    norm = float(gradient_norm(ours))
    max_norm = norm / 7  # bites
    got = clip_gradients(ours, max_norm)
    want = torch.nn.utils.clip_grad_norm_(list(theirs.parameters()), max_norm)
    tol = 1e-6 if dtype == torch.float32 else 1e-13
    assert abs(float(got) - float(want)) <= tol * float(want)
    for (n, a), b in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=tol, atol=0, msg=n)
    assert abs(float(gradient_norm(ours)) - max_norm) <= 1e-5 * max_norm  # clipped to the bound


def test_a_norm_below_the_bound_leaves_every_gradient_as_it_was():
    model = _gradients()
    before = [p.grad.clone() for p in model.parameters()]
    norm = clip_gradients(model, 1e6)
    assert float(norm) > 0
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize("kind", ["fixed", "zscore"])
def test_clipping_runs_without_a_host_sync(kind):
    """Inside a CUDA graph nothing may read a device value on the host: the norm stays a
    tensor, the factor (and a :class:`ZScoreBound`'s state, through its warm-up and past
    it) is computed from it on the device (counted here as torch counts host reads:
    ``aten::_local_scalar_dense``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                Reads.n += 1
            return func(*args, **(kwargs or {}))

    bound = 1e-3 if kind == "fixed" else ZScoreBound()
    for _ in range(1 if kind == "fixed" else 30):
        model = _gradients()
        with Reads():
            clip_gradients(model, bound)
    assert Reads.n == 0


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), True, "1", "auto", "1.0e9"])
def test_bad_clip_setting_names_the_key(bad):
    with pytest.raises(InputError, match="train.clip_grad_norm"):
        TrainConfig(clip_grad_norm=bad)


def test_clip_setting_default_and_off():
    assert TrainConfig().clip_grad_norm == "zscore"
    assert TrainConfig(clip_grad_norm=None).clip_grad_norm is None
    assert TrainConfig(clip_grad_norm=1.0).clip_grad_norm == 1.0
    assert TrainConfig(clip_grad_norm="zscore").clip_grad_norm == "zscore"


# ----------------------------------------------------------------- the z-score bound
def _zclip_reference(norms, z=2.5, alpha=0.97, warmup=25):
    """ZClip's z-score rule with adaptive scaling as its authors' code runs it (plain
    floats, the warm-up norms kept in a list): each step's bound, None where the norm is
    left as it is."""
    buffer, mean, var, out = [], None, None, []
    for g in norms:
        if mean is None:
            buffer.append(g)
            if len(buffer) >= warmup:
                mean = sum(buffer) / len(buffer)
                var = sum((x - mean) ** 2 for x in buffer) / len(buffer)
            out.append(None)
            continue
        std = var**0.5
        score = (g - mean) / (std + 1e-6)
        bound = mean + z * std / (score / z) if score > z else None
        seen = g if bound is None else bound
        mean = alpha * mean + (1 - alpha) * seen
        var = alpha * var + (1 - alpha) * (seen - mean) ** 2
        out.append(bound)
    return out


def _norm_series(n=400, seed=0):
    """Norms as a run has them: falling early, noisy, with spikes of 10 to 1000 times."""
    rng = np.random.default_rng(seed)
    norms = 0.05 * (1 + 4 * np.exp(-np.arange(n) / 60)) * rng.lognormal(0, 0.3, n)
    for at, times in ((40, 30.0), (41, 120.0), (200, 1000.0), (300, 10.0)):
        norms[at] *= times
    return norms.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_zscore_bound_follows_the_published_rule(dtype):
    norms = _norm_series()
    want = _zclip_reference(norms)
    bound = ZScoreBound()
    got = [float(bound(torch.tensor(g, dtype=dtype))) for g in norms]
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    assert [w is None for w in want] == [g == float("inf") for g in got]
    for i, (w, g) in enumerate(zip(want, got)):
        if w is not None:
            assert abs(g - w) <= tol * w, (i, g, w)
    spikes = [i for i, w in enumerate(want) if w is not None]
    assert {40, 41, 200, 300} <= set(spikes)  # every planted spike is caught
    assert len(spikes) < 0.1 * len(norms)  # and the noise mostly left alone
    assert all(i >= 25 for i in spikes)  # nothing in the warm-up


def test_zscore_bound_reset_starts_a_new_warmup_and_its_state_round_trips():
    norms = _norm_series()
    a = ZScoreBound()
    for g in norms[:100]:
        a(torch.tensor(g))
    b = ZScoreBound()
    b.load(a.state(), torch.float32, "cpu")  # as a resumed run's
    assert all(torch.equal(a(torch.tensor(g)), b(torch.tensor(g))) for g in norms[100:])
    a.reset()  # a new stage: a warm-up again, then a fresh bound's steps
    fresh = ZScoreBound()
    assert [float(a(torch.tensor(g))) for g in norms] == [float(fresh(torch.tensor(g))) for g in norms]
    assert a.state() == fresh.state() and a.state()["count"] == len(norms)


def test_zscore_clipping_scales_a_spike_to_its_bound_and_leaves_the_rest():
    model = _gradients()
    norm = float(gradient_norm(model))
    mean, std = norm / 50, norm / 500
    bound = ZScoreBound()
    bound.load({"count": 100.0, "mean": mean, "var": std**2}, torch.float32, "cpu")
    assert abs(float(clip_gradients(model, bound)) - norm) <= 1e-6 * norm  # the norm before
    score = (norm - mean) / (std + 1e-6)  # about 490 standard deviations: a spike
    limit = mean + 2.5 * std / (score / 2.5)
    assert abs(float(bound.last) - limit) <= 1e-5 * limit
    assert abs(float(gradient_norm(model)) - limit) <= 1e-5 * limit  # scaled down to it
    # no spike: every gradient bit for bit
    model = _gradients()
    before = [p.grad.clone() for p in model.parameters()]
    bound.load({"count": 100.0, "mean": norm, "var": (norm / 10) ** 2}, torch.float32, "cpu")
    clip_gradients(model, bound)
    assert float(bound.last) == float("inf")
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))
