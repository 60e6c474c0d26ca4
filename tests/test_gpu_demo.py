"""The demo (config/demo.yaml) on a machine with one GPU: its plan says it trains on cpu,
and its train rule, the real command Snakemake runs (``ampflow train --launch``), starts
the plan's two processes on CPU cores, saying so, instead of refusing two ranks on one
GPU. The one GPU is played by :mod:`fake_cuda` in every process the rule starts (the
launcher and torchrun's children); nothing of CUDA itself is touched, so a CPU run that
reached for the GPU (an RNG state, a tensor) would fail here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import workflow_copy
from fake_cuda import fake_cuda_env

pytestmark = [pytest.mark.slow, pytest.mark.dist]

BIN = Path(sys.executable).parent
CFG = "500kb_s10"
# checkpoints every 2 steps: each holds RNG states, which a CPU run must not read from a GPU
QUICK = "train: {pretrain: {epochs: 2}, finetune: {epochs: 1}, early_stopping: {patience: 0}, checkpoint_every: 2}\n"


def snakemake(root: Path, target: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ if env is None else env)
    env["PATH"] = f"{BIN}{os.pathsep}{env['PATH']}"
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    cmd = [str(BIN / "snakemake"), target, "--profile", "profiles/local", "--cores", "2", "--configfile", "config/demo.yaml", "config/quick.yaml"]
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """The demo's data (60 cells, seed 0) prepared and planned by the workflow, up to
    one configuration's plan.json."""
    from ampflow.demo import write_demo

    root = workflow_copy(tmp_path_factory.mktemp("gpu-demo"))
    (root / "config/quick.yaml").write_text(QUICK)
    write_demo(root / "resources/demo", n_cells=60, seed=0)
    r = snakemake(root, f"results/demo/amp/{CFG}/plan.json")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return root


def test_the_demo_plan_says_it_trains_on_cpu(planned):
    plan = json.loads((planned / f"results/demo/amp/{CFG}/plan.json").read_text())
    assert plan["version"] == 4 and plan["device"] == "cpu"
    assert plan["mesh"]["dp"] * plan["mesh"]["tp"] == 2 and "world_size" not in plan
    assert any(r.startswith("device: cpu, as train.device sets") for r in plan["reasons"])


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="the demo's plan is 2 processes on CPU cores")
def test_the_demo_train_rule_on_a_one_gpu_machine(planned, tmp_path):
    """Snakemake runs the demo's train rule with one GPU visible to torch in every
    process: exit 0, no refusal, and the log names the device, the unused GPU and the
    two processes."""
    r = snakemake(planned, f"results/demo/train/{CFG}/model.pt", fake_cuda_env(tmp_path / "site", 1))
    log_path = planned / f"logs/demo/train.{CFG}.log"
    log = log_path.read_text() if log_path.exists() else ""
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:] + log[-3000:]
    assert "launching 2 processes" in log
    assert "device: cpu (plan.json's device cpu; train.device cpu; 1 CUDA GPU(s) visible, not used), 2 process(es)" in log, log[-3000:]
    assert "refuse" not in log.lower() and "GPUs, 1 visible" not in log
    assert (planned / f"results/demo/train/{CFG}/model.pt").exists()
