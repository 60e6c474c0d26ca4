"""A plan applies through the library API in one process, and plans what the run trains.

Three bugs this file pins down: ``Trainer(plan=...)`` in one process once ignored the plan's
chunked attention (S3) and key-first decode (S4), which only the command line applied; a
plan could only switch them on, so ``model.chunk`` in the config ran chunked under a plan
that chose one block;
and the profile once planned every run as float32, so a float64 run was planned with half
its memory. The referees are independent of the plan code: the model's own config path
(``ModelConfig(chunk=..., key_first=...)``, no plan), and the bytes the trainer measures
on the CPU (the allocator's peak of a step, from the profiler's allocation timeline).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from helpers import MODEL, SETTINGS, prepare

from ampflow.amp.decide.diagnose import diagnose
from ampflow.amp.decide.signals import evaluate_signals
from ampflow.amp.memory.predict import profile_memory
from ampflow.amp.profile import profile_data
from ampflow.contract.config import TrainConfig
from ampflow.contract.plan import Plan, PlannedStrategy
from ampflow.contract.strategies import CHUNKED_ATTENTION, KEY_FIRST_DECODE
from ampflow.demo import write_demo
from ampflow.train.data import load_paired
from ampflow.train.trainer import Trainer

SHORT = {**SETTINGS, "pretrain": {"epochs": 1}, "finetune": {"epochs": 0}}  # 3 steps
S3_S4 = Plan(
    strategies=(PlannedStrategy("S3", CHUNKED_ATTENTION), PlannedStrategy("S4", KEY_FIRST_DECODE)),
    chunk_size=3,
    key_first=True,
)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("plan-data")
    return prepare(write_demo(root / "demo", n_cells=24, seed=0, n_genes=300), root / "work")


@pytest.fixture(scope="module")
def paired(data_dir):
    return load_paired(data_dir)


def rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_one_process_trainer_runs_the_plans_chunk_and_key_first(paired, tmp_path):
    train = TrainConfig.from_dict(SHORT)
    planned = Trainer(paired, MODEL, train, tmp_path / "planned", plan=S3_S4)
    assert planned.mesh.world == 1
    assert planned.applied_settings() == {"chunk": 3, "key_first": True}
    assert planned.fit()
    # the same run with the settings in the model config instead of a plan
    by_config = tmp_path / "by_config"
    assert Trainer(paired, dataclasses.replace(MODEL, chunk=3, key_first=True), train, by_config).fit()
    plain = tmp_path / "plain"
    assert Trainer(paired, MODEL, train, plain).fit()
    a, b, c = rows(tmp_path / "planned"), rows(by_config), rows(plain)
    assert len(a) == len(b) == len(c) == 3
    # key-first saves each stratum's gathered keys (F_k x D) instead of the anchors'
    # (n x D), chunked attention saves per-chunk pieces: the bytes show which kernels ran
    # (which of the two holds more depends on F_k against n)
    assert [r["peak_bytes"] for r in a] == [r["peak_bytes"] for r in b]
    assert [r["stratum_bytes"] for r in a] == [r["stratum_bytes"] for r in b]
    assert all(x["peak_bytes"] != y["peak_bytes"] for x, y in zip(a, c)), (a[0]["peak_bytes"], c[0]["peak_bytes"])
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    saved = torch.load(tmp_path / "planned" / "model.pt", weights_only=True)
    assert saved["plan_settings"] == {"chunk": 3, "key_first": True}


def test_a_plan_without_s3_s4_runs_one_block_whatever_the_config_says(paired, tmp_path):
    """The plan is the only route to S3/S4: a config asking for chunked, key-first
    attention under a plan that chose neither runs one block, plain decode (what the
    memory model predicted for that plan). Referee: the run of the plain config, no plan."""
    train = TrainConfig.from_dict(SHORT)
    asked = dataclasses.replace(MODEL, chunk=3, key_first=True)
    one_block = Plan()  # a plan that chose neither S3 nor S4
    planned = Trainer(paired, asked, train, tmp_path / "planned", plan=one_block)
    assert planned.applied_settings() == {"chunk": 0, "key_first": False}
    assert planned.fit()
    assert Trainer(paired, MODEL, train, tmp_path / "plain").fit()
    a, c = rows(tmp_path / "planned"), rows(tmp_path / "plain")
    assert [r["peak_bytes"] for r in a] == [r["peak_bytes"] for r in c]
    assert [r["loss"] for r in a] == [r["loss"] for r in c]
    # without a plan the config's settings are what the model runs
    assert Trainer(paired, asked, train, tmp_path / "by_config").applied_settings() == {"chunk": 3, "key_first": True}


def _profile(data_dir: Path, train: dict) -> dict:
    profile = profile_data(data_dir, MODEL.to_dict(), train)
    profile["signals"] = evaluate_signals(profile)
    profile["memory"] = profile_memory(profile)
    return profile


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_plan_predicts_the_measured_peak_of_the_runs_dtype(data_dir, paired, tmp_path, dtype):
    """The plan for a float64 run predicts what a float64 step holds, about twice the
    float32 plan's bytes (index tensors and Adam's step counters stay as they are):
    the allocator's peak of a steady-state step within 10 %."""
    settings = {**SHORT, "dtype": dtype}
    plan = diagnose(_profile(data_dir, settings), 1, 64 * 2**30)
    if dtype == "float64":
        plan32 = diagnose(_profile(data_dir, {**SHORT, "dtype": "float32"}), 1, 64 * 2**30)
        ratio = plan.predicted_peak_bytes / plan32.predicted_peak_bytes
        assert 1.9 < ratio <= 2.0, ratio
    out = tmp_path / dtype
    assert Trainer(paired, MODEL, TrainConfig.from_dict(settings), out, plan=plan).fit()
    steady = rows(out)[1]  # after the first optimizer step, a full batch of batch_size cells
    assert steady["peak_source"] == "allocator"
    assert abs(steady["peak_bytes"] - plan.predicted_peak_bytes) <= 0.10 * steady["peak_bytes"], (steady, plan.peak_scope)


def test_unknown_strategy_names_are_refused_with_the_file_and_key(tmp_path):
    """A plan naming a strategy the trainer cannot apply is refused: when read (the file,
    the key, the value) and by parallelize (never trained with the strategy left out)."""
    from ampflow.base.errors import InputError
    from ampflow.parallel.parallelize import parallelize

    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"mesh": {"dp": 1, "tp": 1}, "strategies": [{"id": "S3", "name": CHUNKED_ATTENTION}, {"id": "S9", "name": "offload"}]}))
    with pytest.raises(InputError) as e:
        Plan.read(path)
    assert str(path) in str(e.value) and "strategies[1].name" in str(e.value) and "'offload'" in str(e.value), str(e.value)
    built = Plan(strategies=(PlannedStrategy("S9", "offload"),))
    with pytest.raises(InputError, match=r"strategies.*offload"):
        parallelize(torch.nn.Module(), built)
