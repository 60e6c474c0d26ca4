"""Gradient-norm clipping (``train.clip_grad_norm``): the whole model's norm and the scaled
gradients against torch's own ``clip_grad_norm_``; under every parallel strategy it is
part of tests/parallel_equivalence.py's step (the referee there: one process)."""

from __future__ import annotations

import pytest
import torch
from parallel_equivalence import WEIGHTS, _problem

from ampflow.base.errors import InputError
from ampflow.contract.config import TrainConfig
from ampflow.parallel.clip import clip_gradients, gradient_norm


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


def test_clipping_runs_without_a_host_sync():
    """Inside a CUDA graph nothing may read a device value on the host: the norm stays a
    tensor, the factor is computed from it on the device (counted here as torch counts
    host reads: ``aten::_local_scalar_dense``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                Reads.n += 1
            return func(*args, **(kwargs or {}))

    model = _gradients()
    with Reads():
        clip_gradients(model, 1e-3)
    assert Reads.n == 0


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), True, "1"])
def test_bad_clip_setting_names_the_key(bad):
    with pytest.raises(InputError, match="train.clip_grad_norm"):
        TrainConfig(clip_grad_norm=bad)


def test_clip_setting_default_and_off():
    assert TrainConfig().clip_grad_norm is None
    assert TrainConfig(clip_grad_norm=1.0).clip_grad_norm == 1.0
