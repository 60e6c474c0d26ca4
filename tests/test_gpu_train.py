"""Training on a GPU, each test run on ``cpu`` and ``cuda`` (the cuda case skipped
without a GPU): the CPU case proves the test's own code (device moves, the one-rank
groups, the comparisons) on every machine, so that on a GPU node only the device can
fail.

* the Trainer end to end: trained, killed (the test double ``StoppingTrainer``) and resumed, outputs written,
  metrics rows with the allocator's peaks (``peak_source`` ``cuda`` with the requested
  and reserved peaks and the base). Determinism: on CPU the resumed run equals the
  uninterrupted one bit for bit. On CUDA the trainer itself (``train.deterministic``,
  its default) runs under ``torch.use_deterministic_algorithms(True, warn_only=True)``
  with ``CUBLAS_WORKSPACE_CONFIG=:4096:8``: bit-identical unless an op warned that it
  has no deterministic
  CUDA implementation, and then within a stated tolerance (:data:`RESUME_RTOL` on the
  final loss and parameters: atomics reorder float32 sums, about 1e-7 relative per
  addition, over the 12 steps of the run);
* thinned counts (``train.hic_keep_min``) drawn on the device as on the host;
* every strategy set's collectives issued on a one-rank group (NCCL on CUDA, gloo on
  CPU), compared with the single-process model (tests/parallel_equivalence.py's helpers);
* two ranks on one device over gloo (which takes CUDA tensors) against one process;
* a step's numerics in fp32 and bf16 against the same problem in fp64.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

import pandas as pd
import pytest
import scipy.sparse as sp
import torch
import torch.distributed as dist
from conftest import load_script

CUDA = torch.cuda.is_available()
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]),
]
#: Relative difference allowed between a resumed and an uninterrupted CUDA run when an
#: op without a deterministic implementation ran.
RESUME_RTOL = 1e-4
TINY_SIZES = "chrA\t3000000\nchrB\t2000000\n"


def _to(x, device):
    """Tensors inside nested dicts, lists and tuples moved to ``device``."""
    if torch.is_tensor(x):
        return x.to(device)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to(v, device) for v in x)
    return x


# ------------------------------------------------------------------ the Trainer
def _paired_data(tmp: Path, n_cells: int):
    from ampflow.io.genome import read_chromsizes
    from ampflow.train.data import PairedData

    bt = load_script("bench_train")
    sizes = tmp / "tiny.chrom.sizes"
    sizes.write_text(TINY_SIZES)
    shape = bt.build_shape(read_chromsizes(sizes, ["chrA", "chrB"]), 100_000, 4, 30, 3, 0)
    rna, hic = bt.Cells(shape, n_cells, n_cells, 500.0, 2000.0, 0).get(0)
    return PairedData(
        obs=pd.DataFrame(index=pd.Index([f"c{i}" for i in range(n_cells)], name="cell_id")),
        rna=sp.csr_matrix(rna.numpy()), hic=sp.csr_matrix(hic.numpy()),
        feature_anchor=shape.feature_anchor, feature_stratum=shape.feature_stratum, n_strata=shape.n_strata,
        graph=shape.graph, meta={"hic": {"resolution": shape.resolution}}, genes=[f"g{i}" for i in range(shape.n_genes)],
        features=[f"f{i}" for i in range(hic.shape[1])],
    )  # fmt: skip


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("device, graphs", [
    pytest.param("cpu", "auto", id="cpu"),
    pytest.param("cuda", "auto", id="cuda-graphed", marks=DEVICES[1].marks),
    pytest.param("cuda", False, id="cuda-eager", marks=DEVICES[1].marks),
])  # fmt: skip
def test_trainer_trains_is_killed_and_resumes(device, graphs, tmp_path):
    from trainer_doubles import StoppingTrainer

    from ampflow.contract.config import EarlyStoppingConfig, LossWeights, ModelConfig, StageConfig, TrainConfig
    from ampflow.train.trainer import MEASURED_STEPS, Trainer

    data = _paired_data(tmp_path, 32)
    w = LossWeights()
    cfg = TrainConfig(device=device, batch_size=8, checkpoint_every=2, checkpoint_seconds=0, threads=1, cuda_graphs=graphs,
                      pretrain=StageConfig(2, 2e-3, w), finetune=StageConfig(1, 5e-4, w), early_stopping=EarlyStoppingConfig(patience=0))  # fmt: skip
    steps = 3 * math.ceil(32 / 8)
    caught: list = []
    # train.deterministic (default true): the trainer itself switches a CUDA run to
    # deterministic kernels and sets the cuBLAS workspace; undone after the test
    cublas = os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            a = Trainer(data, ModelConfig(), cfg, tmp_path / "a")
            assert a.device.type == device
            assert a.mode.graphs == (device == "cuda" and graphs == "auto")
            assert a.fit() is True
            assert StoppingTrainer(data, ModelConfig(), cfg, tmp_path / "b", stop_after=5).fit() is False
            assert Trainer(data, ModelConfig(), cfg, tmp_path / "b").fit() is True
        assert torch.are_deterministic_algorithms_enabled()
        if device == "cuda":
            assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        else:  # no cuBLAS on a CPU run
            assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    finally:
        torch.use_deterministic_algorithms(False)
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        if cublas is not None:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = cublas
    for out in ("a", "b"):
        for f in ("model.pt", "embeddings.h5ad", "config.yaml", "metrics.jsonl"):
            assert (tmp_path / out / f).is_file(), (out, f)
    ra, rb = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == list(range(1, steps + 1))
    measured = [r for r in ra if "peak_bytes" in r]
    if device == "cuda":
        # the first steps and every checkpoint's (reading the peaks waits for the GPU)
        assert [r["step"] for r in measured] == [s for s in range(1, steps + 1) if s <= MEASURED_STEPS or s % 2 == 0]
        assert {r["peak_source"] for r in measured} == {"cuda"}
        for r in measured:
            # allocated >= requested (512 B rounding); reserved >= allocated; the base
            # holds the step's tensors and the cuBLAS workspaces
            assert r["peak_reserved_bytes"] >= r["peak_bytes"] >= r["peak_requested_bytes"] > 0, r
            assert r["base_bytes"] >= r["held_bytes"] > 0 and r["peak_bytes"] > r["base_bytes"], r
    else:
        assert len(measured) == MEASURED_STEPS and {r["peak_source"] for r in measured} == {"allocator"}
        assert not any("peak_reserved_bytes" in r for r in ra)
    ma = torch.load(tmp_path / "a" / "model.pt", map_location="cpu", weights_only=True)["state_dict"]
    mb = torch.load(tmp_path / "b" / "model.pt", map_location="cpu", weights_only=True)["state_dict"]
    assert ma.keys() == mb.keys()
    nondeterministic = [str(c.message) for c in caught if "deterministic" in str(c.message)]
    la, lb = ra[-1]["loss"]["total"], rb[-1]["loss"]["total"]
    if device == "cpu" or not nondeterministic:
        assert la == lb, (la, lb, nondeterministic)
        assert all(torch.equal(ma[k], mb[k]) for k in ma)
    else:
        assert abs(la - lb) <= RESUME_RTOL * abs(la), (la, lb, nondeterministic[:3])
        for k in ma:
            if ma[k].is_floating_point():
                torch.testing.assert_close(mb[k], ma[k], rtol=RESUME_RTOL, atol=RESUME_RTOL * float(ma[k].abs().max()))


@pytest.mark.parametrize("thinned", ["both", "encoder"])
@pytest.mark.parametrize("device", DEVICES)
def test_thinned_counts_train_alike_on_the_device_and_from_the_host(device, thinned, tmp_path, monkeypatch):
    """``train.hic_keep_min``: on a GPU the counts stay on the device and are thinned
    there; referee: the same run with the counts thinned on the host and copied (the
    device's room for them taken away), whose draws are the same: every metrics row's loss
    within float32 rounding, the same parameters. ``hic_thinned: encoder``: the counts
    whole and the encoder's thinned copy, each densified there. On CPU both runs take the
    host path (the test's own code, proven on every machine)."""
    from ampflow.contract.config import EarlyStoppingConfig, LossWeights, ModelConfig, StageConfig, TrainConfig
    from ampflow.train import trainer as trainer_module

    data = _paired_data(tmp_path, 32)
    w = LossWeights()
    cfg = TrainConfig(device=device, batch_size=8, hic_keep_min=0.3, hic_thinned=thinned, checkpoint_every=10**6, threads=1, pretrain=StageConfig(2, 2e-3, w),
                      finetune=StageConfig(0, 5e-4, w), early_stopping=EarlyStoppingConfig(patience=0))  # fmt: skip
    try:
        on_device = trainer_module.Trainer(data, ModelConfig(), cfg, tmp_path / "device")
        assert (getattr(on_device, "resident", None) is not None) == (device == "cuda")
        assert on_device.fit() is True
        monkeypatch.setattr(trainer_module, "RESIDENT_MARGIN_BYTES", 2**62)
        from_host = trainer_module.Trainer(data, ModelConfig(), cfg, tmp_path / "host")
        assert getattr(from_host, "resident", None) is None
        assert from_host.fit() is True
    finally:
        torch.use_deterministic_algorithms(False)
    rd, rh = _rows(tmp_path / "device"), _rows(tmp_path / "host")
    assert len(rd) == len(rh) == 8
    for a, b in zip(rd, rh):
        assert math.isclose(a["loss"]["total"], b["loss"]["total"], rel_tol=1e-5), (a["step"], a["loss"], b["loss"])
    md = torch.load(tmp_path / "device" / "model.pt", map_location="cpu", weights_only=True)["state_dict"]
    mh = torch.load(tmp_path / "host" / "model.pt", map_location="cpu", weights_only=True)["state_dict"]
    for k in md:
        if md[k].is_floating_point():
            torch.testing.assert_close(md[k], mh[k], rtol=1e-4, atol=1e-4 * float(md[k].abs().max()))


# ------------------------------------------------------------------ collectives
SETS_ONE_RANK = (["S1"], ["S2", "S4"], ["S3", "S5"], ["S2", "S3", "S4", "S5"])


@pytest.mark.parametrize("device", DEVICES)
def test_every_collective_on_a_one_rank_group(device, tmp_path):
    """parallelize()'s steps with every group set to the one-rank world, so that each
    collective call site is issued on the device's backend (tp = dp = 1 would skip
    them), against the single-process model (fp64 exactly, fp32 against fp64)."""
    import parallel_equivalence as T
    from parallel_equivalence import _snapshot

    from ampflow.contract.strategies import FEATURE_PARALLEL, HIDDEN_PARALLEL
    from ampflow.parallel.data_parallel import DataParallelStep, parallelize_data_parallel
    from ampflow.parallel.feature_parallel import FeatureParallelLinear
    from ampflow.parallel.mesh import Mesh
    from ampflow.parallel.parallelize import apply_single_device_strategies
    from ampflow.parallel.sharded_decoder import ShardedStratifiedZINBDecoder

    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    world = dist.group.WORLD
    try:
        for ids in SETS_ONE_RANK:
            for dtype in (torch.float64, torch.float32):
                tag = "+".join(ids) + f" {dtype} on {device}/{backend}"
                plan = T._plan(ids, 1, 1)
                model, rna, hic, cond = T._problem(dtype, "wide")
                assert cond is None  # "wide" has no batches; the step below passes none
                model, rna, hic = model.to(device), rna.to(device), hic.to(device)
                mesh = Mesh(1, 1, 0)
                mesh.dp_group = mesh.tp_group = world
                dec = model.hic_decoder
                apply_single_device_strategies(dec, plan)
                features, hidden = plan.uses(FEATURE_PARALLEL), plan.uses(HIDDEN_PARALLEL)
                shards = {}
                if features or hidden:
                    sharded = ShardedStratifiedZINBDecoder(dec, world, 1, 0, features, hidden)
                    model.hic_decoder = sharded
                    shards.update({f"hic_decoder.{n}": s for n, s in sharded.shards.items()})
                if features:
                    layer = FeatureParallelLinear(model.hic_encoder.body[0], sharded.local_features, world)
                    model.hic_encoder.body[0] = layer
                    shards.update({f"hic_encoder.body.0.{n}": s for n, s in layer.shards.items()})
                model = parallelize_data_parallel(model, mesh, broadcast=True)
                model.train()
                opt = torch.optim.Adam(model.parameters(), lr=T.LR)
                gen = torch.Generator().manual_seed(T.NOISE_SEED)
                torch.manual_seed(T.GLOBAL_SEED)
                rows = torch.arange(T.B)
                terms = DataParallelStep(mesh, clip=T.CLIP).step(model, opt, rna, hic, T.WEIGHTS, rows, batch_size=T.B, generator=gen)
                got = _to(_snapshot(model, terms), "cpu")
                got["shards"] = shards
                assert next(model.parameters()).device.type == device
                ref = T._reference(dtype, "wide", 2)  # noise from the shared generator, as a dp group draws it
                truth = T._truth("wide", 2) if dtype != torch.float64 else None
                T.assert_rank_matches(got, ref, dtype, tag, truth=truth)
    finally:
        dist.destroy_process_group()


def _problem_on(device, problem):
    """parallel_equivalence's ``_problem`` built on ``device``."""

    def on_device(*a, **k):
        model, rna, hic, cond = problem(*a, **k)
        return model.to(device), rna.to(device), hic.to(device), None if cond is None else cond.to(device)

    return on_device


def _ranks_on_one_device(rank, world, cases, device):
    """tests/parallel_equivalence.py's worker with its problem on ``device`` (every rank on
    GPU 0 under gloo); results back on the CPU."""
    import parallel_equivalence as T

    if device == "cuda":
        torch.cuda.set_device(0)
    orig = T._problem
    T._problem = _problem_on(device, orig)
    try:
        out = T._tp_worker(rank, world, cases)
    finally:
        T._problem = orig
    return _to(out, "cpu")


def _references_on(device, T, monkeypatch):
    """parallel_equivalence's one-process references computed on ``device`` (results back
    on the CPU): with dp = 1 the model draws its noise from the global RNG of its device,
    and CUDA's generator draws other numbers than the CPU's from the same seed."""
    problem = T._problem
    on_device = _problem_on(device, problem)

    def computed_on_device(fn):
        def call(*a, **k):
            T._problem = on_device
            try:
                return _to(fn(*a, **k), "cpu")
            finally:
                T._problem = problem

        return call

    for name in ("_reference", "_truth"):
        monkeypatch.setattr(T, name, computed_on_device(getattr(T, name)))


@pytest.mark.dist
@pytest.mark.parametrize("device", DEVICES)
def test_two_ranks_share_one_device_over_gloo(device, tmp_path, monkeypatch):
    import parallel_equivalence as T
    from dist_helpers import run_world

    cases = [c for c in T.ALL if c[0] != "dp2xtp2 all"]
    if device == "cpu":  # test_tensor_parallel runs them all on CPU: here the device path's proof
        cases = [c for c in cases if c[0] in ("S1", "S2+S3+S4+S5") and c[1] == "narrow"]
    results = run_world(_ranks_on_one_device, 2, tmp_path, cases, device)
    _references_on(device, T, monkeypatch)
    T._check(2, results, cases)


# ------------------------------------------------------------------ numerics
#: Relative error of a step's loss and of each gradient (as a whole tensor, by norm)
#: against fp64: fp32 rounds at 6e-8 per operation, bf16 at 3.9e-3 (8-bit mantissa),
#: and the sums of a step (a few hundred terms) grow that by their depth. Measured on
#: CPU: fp32 7.5e-8 (loss) and 4.6e-6 (worst gradient), bf16 1.1e-3 and 0.10. CUDA keeps
#: fp32 matrix products in fp32 unless TF32 is allowed (torch's default: not for matmul).
NUMERICS = {torch.float32: (1e-6, 1e-4), torch.bfloat16: (3e-2, 0.15)}


def _one_step(dtype, device):
    import parallel_equivalence as T

    model, rna, hic, cond = T._problem(torch.float64, "narrow")
    model, rna, hic, cond = model.to(device, dtype), rna.to(device, dtype), hic.to(device, dtype), cond.to(device, dtype)
    model.train()
    n_nodes, d = model.graph_encoder.embedding.shape
    g = torch.Generator().manual_seed(T.NOISE_SEED)
    noise = tuple(torch.randn(n, d, generator=g).to(device, dtype) for n in (T.B, T.B, n_nodes))
    gen = torch.Generator().manual_seed(T.NOISE_SEED)
    terms = model(rna, hic, T.WEIGHTS, generator=gen, noise=noise, cond=cond)
    terms["total"].backward()
    grads = {n: p.grad.detach().double().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return float(terms["total"].detach()), grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_step_numerics_against_fp64(device, dtype):
    if device == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    loss_tol, grad_tol = NUMERICS[dtype]
    ref_loss, ref_grads = _one_step(torch.float64, "cpu")
    loss, grads = _one_step(dtype, device)
    assert math.isfinite(loss) and abs(loss - ref_loss) <= loss_tol * abs(ref_loss), (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    worst = {}
    for n, ref in ref_grads.items():
        scale = float(ref.norm())
        if scale > 0:
            worst[n] = float((grads[n] - ref).norm()) / scale
    assert worst and max(worst.values()) <= grad_tol, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
