"""CUDA memory accounting without a GPU: the step measurement and the metrics row read
a stand-in for ``torch.cuda`` (an allocator that rounds blocks to 512 B and keeps
2 MiB segments), and the CUDA overheads and the plan's budget follow PyTorch's rules.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from ampflow.amp.memory import cuda as co
from ampflow.base.errors import InputError
from ampflow.train import measured_memory as mem
from ampflow.train.measured_memory import StepMemory
from ampflow.train.trainer import Trainer

MIB = 2**20


class FakeAllocator:
    """The statistics of CUDA's caching allocator for a sequence of allocations:
    allocated rounds each block up to 512 B, requested does not, reserved grows by
    2 MiB segments and is never given back (the cache)."""

    def __init__(self):
        self.alloc = self.req = self.res = 0
        self.peaks = [0, 0, 0]
        self.resets = 0

    def malloc(self, n: int) -> None:
        self.alloc += co.round_block(n)
        self.req += n
        while self.res < self.alloc:
            self.res += 2 * MIB
        self._peak()

    def free(self, n: int) -> None:
        self.alloc -= co.round_block(n)
        self.req -= n

    def _peak(self):
        self.peaks = [max(p, x) for p, x in zip(self.peaks, (self.alloc, self.req, self.res))]

    # torch.cuda's functions
    def memory_stats(self):
        return {
            "allocated_bytes.all.peak": self.peaks[0], "requested_bytes.all.peak": self.peaks[1],
            "reserved_bytes.all.peak": self.peaks[2], "requested_bytes.all.current": self.req,
            "allocated_bytes.all.current": self.alloc,
        }  # fmt: skip

    def reset_peak_memory_stats(self):
        self.resets += 1
        self.peaks = [self.alloc, self.req, self.res]

    def memory_allocated(self):
        return self.alloc

    def max_memory_allocated(self):
        return self.peaks[0]


@pytest.fixture
def fake_cuda(monkeypatch):
    a = FakeAllocator()
    for name in ("memory_stats", "reset_peak_memory_stats", "memory_allocated", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, getattr(a, name))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *x: None)
    return a


def test_cuda_step_carries_allocated_requested_reserved_peaks(fake_cuda):
    a = fake_cuda
    a.malloc(32 * MIB)  # a cuBLAS workspace, persistent
    a.malloc(1000)  # the step's held tensors: 1000 B asked, 1024 B allocated
    held = 1000

    def run(on_stratum, on_phase):
        on_phase("forward")
        a.malloc(3 * MIB + 1)  # a saved activation
        on_stratum(0)
        on_phase("backward")
        a.malloc(5 * MIB + 3)  # the backward's transient: the peak
        a.free(5 * MIB + 3)
        a.free(3 * MIB + 1)
        on_phase("optimizer_step")
        a.malloc(100)
        a.free(100)
        return "done"

    result, m = mem._measure_cuda(run, held)
    assert result == "done" and m.source == "cuda"
    base = 32 * MIB + 1024
    assert m.base == base and m.held == held and m.base_requested == 32 * MIB + 1000
    rounded = co.round_block(3 * MIB + 1) + co.round_block(5 * MIB + 3)
    assert m.peak == base + rounded and m.peak_phase == "backward"
    assert m.phases["forward"] == base + co.round_block(3 * MIB + 1)
    assert m.phases["optimizer_step"] == base + co.round_block(100)
    assert m.requested == 32 * MIB + 1000 + 8 * MIB + 4  # no rounding
    assert m.reserved % (2 * MIB) == 0 and m.reserved >= m.peak
    assert m.marks == (base + co.round_block(3 * MIB + 1),)
    assert m.persistent == base - held  # the workspace and the held tensors' rounding
    assert a.resets == 4  # before the step, then at each of the three phases


def test_cpu_step_memory_has_no_cuda_fields():
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(16, 8)

    def run(on_stratum, on_phase):
        opt.zero_grad(set_to_none=True)
        on_phase("forward")
        loss = model(x).square().sum()
        on_phase("backward")
        loss.backward()
        on_phase("optimizer_step")
        opt.step()

    _, m = mem.measure_step(run, model, opt, x)
    assert m.source == "allocator" and m.requested is m.reserved is m.held is m.base_requested is None
    assert m.persistent == 0 and m.peak > m.base > 0


def _row(memory):
    """Trainer._metrics_row as the trainer calls it (unbound, on the attributes it reads)."""
    me = SimpleNamespace(step=3, data=SimpleNamespace(n_strata=2))
    terms = {"total": torch.tensor(1.5)}
    return Trainer._metrics_row(me, "pretrain", 0, 8, terms, 0.5, memory)


CPU_KEYS = {"stage", "epoch", "step", "loss", "seconds", "cells_per_s", "threads", "peak_bytes", "peak_phase", "peak_source", "stratum_bytes"}


def test_metrics_row_cuda_fields(fake_cuda):
    m = StepMemory(5000, {"forward": 5000}, "forward", (10, 20, 30), 3000, "cuda", requested=4500, reserved=8 * MIB,
                   held=1000, base_requested=2900)  # fmt: skip
    row = _row(m)
    assert set(row) == CPU_KEYS | {"peak_requested_bytes", "peak_reserved_bytes", "base_bytes", "held_bytes"}
    assert (row["peak_bytes"], row["peak_requested_bytes"], row["peak_reserved_bytes"]) == (5000, 4500, 8 * MIB)
    assert (row["base_bytes"], row["held_bytes"], row["peak_source"]) == (3000, 1000, "cuda")
    assert row["stratum_bytes"] == [10, 20]
    # an older torch without requested bytes: the key is left out, not written as null
    row = _row(StepMemory(5000, {}, "forward", (), 3000, "cuda", reserved=8 * MIB, held=1000))
    assert "peak_requested_bytes" not in row and row["peak_reserved_bytes"] == 8 * MIB


def test_metrics_row_cpu_unchanged():
    m = StepMemory(5000, {"forward": 5000}, "forward", (10, 20, 30), 3000, "allocator")
    row = _row(m)
    assert set(row) == CPU_KEYS
    assert row["peak_bytes"] == 5000 and row["peak_source"] == "allocator"
    assert set(_row(None)) == CPU_KEYS - {"peak_bytes", "peak_phase", "peak_source", "stratum_bytes"}


# ------------------------------------------------------------------ overheads and budget
@pytest.mark.parametrize(
    "config, cap, expected",
    [
        (None, (9, 0), 32 * MIB),  # Hopper's default
        (None, (8, 0), 8 * MIB + 128 * 1024),  # :4096:2:16:8
        (None, (10, 0), 8 * MIB + 128 * 1024),
        (":4096:8", (8, 0), 32 * MIB),  # what deterministic runs set
        (":16:8", (9, 0), 128 * 1024),
        (":4096:2:16:8", (9, 0), 8 * MIB + 128 * 1024),
        ("garbage", (9, 0), 32 * MIB),  # PyTorch warns and keeps its default
    ],
)
def test_cublas_workspace_bytes(config, cap, expected):
    env = {} if config is None else {"CUBLAS_WORKSPACE_CONFIG": config}
    assert co.cublas_workspace_bytes(cap, env) == expected


def test_cublaslt_workspace_bytes():
    assert co.cublaslt_workspace_bytes((9, 0), {}) == MIB
    assert co.cublaslt_workspace_bytes((9, 0), {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"}) == 0
    # capped at cuBLAS's unless unification is turned off
    env = {"CUBLASLT_WORKSPACE_SIZE": "65536", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    assert co.cublaslt_workspace_bytes((9, 0), env) == 32 * MIB
    assert co.cublaslt_workspace_bytes((9, 0), {**env, "TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"}) == 64 * MIB
    assert co.cublaslt_workspace_bytes((9, 0), {"CUBLASLT_WORKSPACE_SIZE": "x"}) == MIB


def test_overheads_and_rounding():
    o = co.cuda_overheads((9, 0), {}, handles=2, live_tensors=10)
    assert o.workspace_bytes == 2 * (32 * MIB + MIB)
    assert o.rounding_bytes == 10 * 511
    assert [co.round_block(n) for n in (0, 1, 512, 513)] == [0, 512, 512, 1024]
    assert o.allocated(1000) == 1000 + o.workspace_bytes + o.rounding_bytes
    assert o.device_bytes(1000) == math.ceil(o.allocated(1000) * 1.1) + o.context_bytes
    with pytest.raises(InputError, match="capability"):
        co.cublas_workspace_bytes("sm90", {})
    with pytest.raises(InputError, match="handles"):
        co.cuda_overheads((9, 0), {}, handles=0)
    with pytest.raises(InputError, match="fragmentation"):
        co.cuda_overheads((9, 0), {}, fragmentation=1.5)


def test_plan_budget():
    gib = 2**30
    assert co.plan_budget(80 * gib, 0.9, "cpu") == math.floor(80 * gib * 0.9)
    o = co.cuda_overheads((9, 0), {})
    b = co.plan_budget(80 * gib, 0.9, "cuda", o)
    assert b == math.floor((80 * gib - o.context_bytes) * 0.9 / 1.1) - o.workspace_bytes - o.rounding_bytes
    # a step predicted at the budget needs no more device memory than the share allowed
    assert o.device_bytes(b) <= 0.9 * (80 * gib - o.context_bytes) + o.context_bytes + 1
    assert co.plan_budget(80 * gib, 0.9, "auto", o) == b
    assert co.plan_budget(100 * MIB, 1.0, "cuda", o) == 0  # smaller than the context
    for kw, key in ((dict(device_memory=0, budget_fraction=0.9), "device_memory"),
                    (dict(device_memory=gib, budget_fraction=0), "budget_fraction"),
                    (dict(device_memory=gib, budget_fraction=0.5, device="tpu"), "train.device")):  # fmt: skip
        with pytest.raises(InputError, match=key):
            co.plan_budget(**kw)


def test_a_plan_for_cuda_budgets_the_context_workspaces_and_fragmentation():
    """diagnose: a plan that trains on CUDA compares the predicted peak with the device
    memory less the CUDA overheads (and says so); a CPU plan, and one that records no
    device, with device memory x budget_fraction as before."""
    from helpers import mm10_profile

    from ampflow.amp.decide.diagnose import diagnose
    from ampflow.contract.config import TrainConfig

    prof, memory = mm10_profile(), 80 * 2**30
    gpu = diagnose(prof, 1, memory, train=TrainConfig(device="cuda"))
    cpu = diagnose(prof, 1, memory, train=TrainConfig(device="cpu"))
    bare = diagnose(prof, 1, memory)
    assert cpu.inputs.budget_bytes == bare.inputs.budget_bytes == math.floor(memory * 0.9)
    o = co.cuda_overheads(capability=co.DEFAULT_CAPABILITY)
    expected = math.floor((memory - o.context_bytes) * 0.9 / (1 + o.fragmentation)) - o.workspace_bytes - o.rounding_bytes
    assert gpu.inputs.budget_bytes == expected < cpu.inputs.budget_bytes
    assert gpu.device == "cuda" and any(r.startswith("budget on CUDA: (device memory 80.0 GiB") for r in gpu.reasons), gpu.reasons
    assert not any("budget on CUDA" in r for r in cpu.reasons)
