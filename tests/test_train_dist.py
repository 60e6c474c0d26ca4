"""Data-parallel training (S1) under torchrun: 2 gloo processes on the CPU.

* With dropout 0 the first steps' losses equal those of one process that draws its
  noise and graph samples from the same generator (the trainer's, seeded from the train
  seed), to 1e-5 relative in fp32.
* Rank 0 alone writes the outputs: one metrics line per step, with every rank's work
  share and peak bytes.
* A 2-process run killed after a checkpoint and resumed ends bit-identical to an
  uninterrupted one.
* A tensor-parallel plan (dp 1 x tp 2, S2 to S5) follows the single-process run of the
  same command (dropout on: every rank of a tp group draws what one process draws); a
  run killed after a checkpoint resumes bit-identical; a checkpoint written by the
  2-process run resumes in one process (checkpoints hold the consolidated state).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import MODEL, SETTINGS, assert_same_model, metrics, prepare
from trainer_doubles import stop_env

from ampflow.contract.config import TrainConfig
from ampflow.contract.plan import Plan
from ampflow.contract.strategies import BUILT_IN, DATA_PARALLEL
from ampflow.demo import write_demo
from ampflow.parallel.data_parallel import draw_noise
from ampflow.parallel.parallelize import parallelize
from ampflow.train.data import load_paired
from ampflow.train.trainer import MEASURED_STEPS, build_model, epoch_batches, seed_everything

pytestmark = [pytest.mark.dist, pytest.mark.slow]

DP_MODEL = dataclasses.replace(MODEL, dropout=0.0)
DP_SETTINGS = {**SETTINGS, "pretrain": {"epochs": 2}, "finetune": {"epochs": 1}}  # 9 steps
N_STEPS = 9
PLAN = {
    "mesh": {"dp": 2, "tp": 1},
    "world_size": 2,
    "strategies": [{"id": "S1", "name": DATA_PARALLEL}],
    "chunk_size": 0,
    "key_first": False,
}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dist-data")
    paths = write_demo(root / "demo", n_cells=24, seed=0, n_genes=300)
    return prepare(paths, root / "work")


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("plan") / "plan.json"
    p.write_text(json.dumps(PLAN))
    return p


def train(data_dir: Path, out: Path, plan: Path, *extra: str, launch: bool = True, stop_after: int | None = None,
          settings: dict = DP_SETTINGS) -> subprocess.CompletedProcess:  # fmt: skip
    args = ["train", "--data", data_dir, "--out", out, "--model", json.dumps(DP_MODEL.to_dict()),
            "--train", json.dumps(settings), "--plan", plan, *extra]  # fmt: skip
    if launch:  # `ampflow train --launch` starts torchrun itself
        cmd = [sys.executable, "-m", "ampflow.cli", *args, "--launch"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "ampflow.cli", *args]
    return subprocess.run([str(x) for x in cmd], capture_output=True, text=True, timeout=300, env=_env(out, stop_after))


def _env(out: Path, stop_after: int | None) -> dict | None:
    """With ``stop_after``: every training process is killed after that step (the test
    double :mod:`trainer_doubles`); else this process's environment."""
    return None if stop_after is None else stop_env(Path(f"{out}.doubles"), stop_after)


@pytest.fixture(scope="module")
def dp_run(data_dir, plan_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dp") / "run"
    res = train(data_dir, out, plan_file)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "launching 2 processes" in res.stderr
    return out


def single_process_losses(data_dir: Path, n_steps: int, settings: dict = DP_SETTINGS) -> list[float]:
    """The same training in one process, noise drawn from the trainer's generator (and
    with ``hic_keep_min`` the whole batch's Hi-C thinned as the trainer keys it: what
    both the encoder and the likelihood read, or with ``hic_thinned: encoder`` what the
    encoder alone reads)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = TrainConfig.from_dict(settings)
        paired = load_paired(data_dir)
        generator = seed_everything(cfg.seed)
        model = parallelize(build_model(DP_MODEL, paired), Plan.from_dict(PLAN))
        stage = cfg.stages[0][1]
        optimizer = torch.optim.Adam(model.parameters(), lr=stage.lr)
        model.train()
        losses = []
        for step, idx in enumerate(epoch_batches(paired.n_cells, cfg.batch_size, cfg.seed, 0, 0)[:n_steps]):
            thinning = (cfg.hic_keep_min, cfg.seed, step) if cfg.hic_keep_min < 1 else None
            rna, hic = paired.batch(idx, thinning=None if cfg.encoder_copy else thinning)
            hic_in = paired.batch(idx, thinning=thinning)[1] if cfg.encoder_copy else None
            optimizer.zero_grad(set_to_none=True)
            noise = draw_noise(model, len(idx), generator)
            terms = model(rna, hic, stage.weights, generator=generator, noise=noise, hic_in=hic_in)
            loss = model.weighted_total(terms, stage.weights, 1.0, 1.0)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        return losses
    finally:
        torch.set_num_threads(n)


def test_plan_processes():
    assert Plan.from_dict(PLAN).world == 2
    assert Plan.from_dict({"mesh": {"dp": 2, "tp": 2}, "world_size": 4}).world == 4
    assert Plan().world == 1


def test_dp_losses_equal_one_process(dp_run, data_dir):
    """Step 1 to 1e-5 relative. Later steps start from parameters that fp32 rounding has
    already moved apart: Adam turns rounding noise on gradients that vanish in exact
    arithmetic into steps of up to ~lr (see parallel_equivalence._adam_tolerance), which
    moves later losses by ~1e-4 to 1e-3 relative (moving those parameters by 1e-3 in one
    process does as much), so later steps only have to agree to 1e-2."""
    rows = metrics(dp_run)
    ref = single_process_losses(data_dir, 3)  # the first epoch
    got = [r["loss"]["total"] for r in rows[:3]]
    for step, (a, b) in enumerate(zip(got, ref), 1):
        rtol = 1e-5 if step == 1 else 1e-2
        assert abs(a - b) <= rtol * abs(b), f"step {step}: {a} vs one process {b}"


@pytest.mark.parametrize("thinned", ["both", "encoder"])
def test_dp_thinning_equals_one_process(data_dir, plan_file, tmp_path, thinned):
    """With ``train.hic_keep_min`` each rank thins its own cells: the first step's loss
    equals that of one process thinning the whole batch (1e-5 relative), and differs
    from the unthinned run's by far more; with ``hic_thinned: encoder`` (the encoder
    reads the thinned copy, the likelihood the counts) also from the run where both read
    the thinned counts."""
    settings = {**DP_SETTINGS, "hic_keep_min": 0.3, "hic_thinned": thinned, "pretrain": {"epochs": 1}, "finetune": {"epochs": 0}}
    out = tmp_path / "thinned"
    res = train(data_dir, out, plan_file, settings=settings)
    assert res.returncode == 0, res.stderr[-4000:]
    got = metrics(out)[0]["loss"]["total"]
    want, plain = single_process_losses(data_dir, 1, settings)[0], single_process_losses(data_dir, 1, {**settings, "hic_keep_min": 1.0})[0]
    assert abs(got - want) <= 1e-5 * abs(want), f"{got} vs one process {want}"
    assert abs(got - plain) > 1e-3 * abs(plain)
    if thinned == "encoder":
        other = single_process_losses(data_dir, 1, {**settings, "hic_thinned": "both"})[0]
        assert abs(got - other) > 1e-3 * abs(other)


def test_only_rank0_writes(dp_run):
    names = {p.name for p in dp_run.iterdir()}
    assert {"model.pt", "embeddings.h5ad", "metrics.jsonl", "config.yaml", "checkpoints"} <= names
    assert not list(dp_run.rglob(".tmp-*"))
    rows = metrics(dp_run)
    assert [r["step"] for r in rows] == list(range(1, N_STEPS + 1))  # one writer: each step once
    for r in rows:
        # the allocator's peak is measured on the first steps only (the profiler slows a step)
        assert ("rank_peak_bytes" in r) == (r["step"] <= MEASURED_STEPS)
        if "rank_peak_bytes" in r:
            assert len(r["rank_peak_bytes"]) == 2 and all(p > 0 for p in r["rank_peak_bytes"])
            assert r["peak_bytes"] == max(r["rank_peak_bytes"])
        assert len(r["rank_work"]) == 2 and r["work_ratio"] == pytest.approx(max(r["rank_work"]))
        assert sum(r["rank_cells"]) in (8, 7) and min(r["rank_cells"]) >= 1
    state = torch.load(dp_run / "checkpoints" / "step-00000009.pt", map_location="cpu", weights_only=True)
    assert len(state["rng_ranks"]) == 2


def test_dp_kill_and_resume_bit_identical(dp_run, data_dir, plan_file, tmp_path):
    out = tmp_path / "resumed"
    res = train(data_dir, out, plan_file, launch=False, stop_after=4)
    assert res.returncode == 0, res.stderr[-4000:]
    assert not (out / "model.pt").exists()
    res = train(data_dir, out, plan_file, launch=False)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "resumed from" in res.stderr
    assert_same_model(dp_run, out)
    a, b = metrics(dp_run), metrics(out)
    assert [r["step"] for r in b] == list(range(1, N_STEPS + 1))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]


@pytest.mark.parametrize("seconds, written", [(1e-9, [3, 6, 9]), (1e9, [])])
def test_dp_checkpoint_seconds_decided_by_rank_0(dp_run, data_dir, plan_file, tmp_path, seconds, written):
    """``train.checkpoint_seconds`` > 0 on a mesh: rank 0's clock decides for every rank
    (a broadcast at each multiple of ``checkpoint_every``; ranks deciding apart would
    hang in the checkpoint's collectives). Passed at once (1e-9 s): a checkpoint at every
    multiple; never (1e9 s): none. The model is the reference run's either way."""
    out = tmp_path / "run"
    res = train(data_dir, out, plan_file, settings={**DP_SETTINGS, "checkpoint_seconds": seconds})
    assert res.returncode == 0, res.stderr[-4000:]
    assert f"at least {seconds:g} s apart" in res.stderr
    assert sorted(int(p.stem.split("-")[1]) for p in (out / "checkpoints").glob("step-*.pt")) == written
    assert_same_model(dp_run, out)


TP_PLAN = {
    "mesh": {"dp": 1, "tp": 2},
    "world_size": 2,
    "strategies": [{"id": f"S{i}", "name": n} for i, n in enumerate(BUILT_IN, start=1)],
    "chunk_size": 4,
    "key_first": True,
}  # fmt: skip


# float64: in float32, Adam turns the rounding differences of a reordered sum in
# gradients that vanish in exact arithmetic into steps of up to ~lr, so two correct runs
# drift apart by ~1e-4 at step 2 and ~1e-2 by step 9; in float64 they stay within 1e-10.
TP_SETTINGS = {**DP_SETTINGS, "dtype": "float64"}


def train_tp(data_dir: Path, out: Path, plan: Path, *extra: str, processes: int = 2, stop_after: int | None = None) -> subprocess.CompletedProcess:
    """``ampflow train`` with the trainer's own model (dropout on), under torchrun or not."""
    args = ["train", "--data", data_dir, "--out", out, "--model", json.dumps(MODEL.to_dict()),
            "--train", json.dumps(TP_SETTINGS), "--plan", plan, *extra]  # fmt: skip
    if processes > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}", "-m", "ampflow.cli", *args]
    else:
        cmd = [sys.executable, "-m", "ampflow.cli", *args]
    return subprocess.run([str(x) for x in cmd], capture_output=True, text=True, timeout=300, env=_env(out, stop_after))


@pytest.fixture(scope="module")
def tp_plan(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("tp-plan") / "plan.json"
    p.write_text(json.dumps(TP_PLAN))
    return p


@pytest.fixture(scope="module")
def tp_run(data_dir, tp_plan, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tp") / "run"
    res = train_tp(data_dir, out, tp_plan)
    assert res.returncode == 0, res.stderr[-4000:]
    return out


def test_tp_run_follows_one_process(tp_run, data_dir, tp_plan, tmp_path):
    one = tmp_path / "one"
    res = train_tp(data_dir, one, tp_plan, processes=1)
    assert res.returncode == 0, res.stderr[-4000:]
    got, ref = metrics(tp_run), metrics(one)
    assert len(got) == len(ref) == N_STEPS
    for a, b in zip(got, ref):
        for term, value in b["loss"].items():
            assert a["loss"][term] == pytest.approx(value, rel=1e-8, abs=1e-12), f"step {a['step']} {term}"
    for r in got:  # every rank's per-stratum bytes (on the measured steps), and the mesh
        assert r["mesh"] == {"dp": 1, "tp": 2}
        if r["step"] <= MEASURED_STEPS:
            assert len(r["rank_stratum_bytes"]) == 2 and all(len(m) == len(r["stratum_bytes"]) for m in r["rank_stratum_bytes"])
    # the consolidated model has the single-process names and shapes
    sa, sb = torch.load(tp_run / "model.pt", weights_only=True)["state_dict"], torch.load(one / "model.pt", weights_only=True)["state_dict"]
    assert {k: v.shape for k, v in sa.items()} == {k: v.shape for k, v in sb.items()}


def test_tp_kill_and_resume_bit_identical(tp_run, data_dir, tp_plan, tmp_path):
    out = tmp_path / "resumed"
    res = train_tp(data_dir, out, tp_plan, stop_after=4)
    assert res.returncode == 0, res.stderr[-4000:]
    res = train_tp(data_dir, out, tp_plan)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "resumed from" in res.stderr
    assert_same_model(tp_run, out)
    assert [r["loss"] for r in metrics(tp_run)] == [r["loss"] for r in metrics(out)]


def test_tp_checkpoint_resumes_in_one_process(tp_run, data_dir, tp_plan, tmp_path):
    out = tmp_path / "moved"
    res = train_tp(data_dir, out, tp_plan, stop_after=6)
    assert res.returncode == 0, res.stderr[-4000:]
    res = train_tp(data_dir, out, tp_plan, processes=1)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "resumed from" in res.stderr and "step 6" in res.stderr
    a, b = metrics(tp_run), metrics(out)
    assert [r["step"] for r in b] == list(range(1, N_STEPS + 1))
    assert [r["loss"] for r in a[:6]] == [r["loss"] for r in b[:6]]
    for x, y in zip(a[6:], b[6:]):
        assert y["loss"]["total"] == pytest.approx(x["loss"]["total"], rel=1e-8)


def test_mesh_not_matching_the_world_is_refused(data_dir, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({**PLAN, "mesh": {"dp": 2, "tp": 2}}))
    res = train(data_dir, tmp_path / "bad", plan, launch=False)
    assert res.returncode != 0
    assert "mesh" in res.stderr and "2 launched processes" in res.stderr
