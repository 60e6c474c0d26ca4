"""The launcher: one world of dp x tp processes per job, one process per device.

What one host cannot show (a SLURM job of two nodes, a node with GPUs) is played by
stand-in ``scontrol``/``srun`` scripts on PATH that record their arguments, and by a
patched ``torch.cuda.device_count``; what it can (the CPU cores a process may use) is
restricted for real with ``taskset``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ampflow.base.errors import InputError
from ampflow.contract.allocation import ClusterOffer, train_allocation
from ampflow.contract.plan import Plan
from ampflow.train import launch as L

ARGV = ["train", "--data", "d", "--out", "o"]

# scontrol show job -o as SLURM 22.05 prints it (abridged), with a Command and a
# Comment whose text looks like fields: the real ones come first
JOB_2_NODES = (
    "JobId=4242 JobName=7f3c UserId=me(1000) JobState=RUNNING NodeList=gpu[017-018] "
    "BatchHost=gpu017 NumNodes=2 NumCPUs=16 NumTasks=2 CPUs/Task=8 ReqB:S:C:T=0:0:*:* "
    "TRES=cpu=16,mem=16000M,node=2,billing=16,gres/gpu=8 MinCPUsNode=8 Features=(null) "
    "Command=/bin/sh -c NumNodes=9 NodeList=x WorkDir=/w Comment=rule_train_wildcards_cfg=500kb_s10 "
    "TresPerNode=gres:gpu:4"
)
JOB_1_NODE_2_TASKS = (
    "JobId=77 JobName=7f3c JobState=RUNNING NodeList=node1 BatchHost=node1 NumNodes=1 NumCPUs=2 "
    "NumTasks=2 CPUs/Task=1 TRES=cpu=2,mem=2000M,node=1,gres/gpu=2 TresPerJob=gres:gpu:2"
)


def stand_ins(root: Path, job_line: str, hosts: list[str]) -> tuple[str, Path]:
    """scontrol (answering `show job -o` and `show hostnames`) and srun, recording argv."""
    bindir, calls = root / "bin", root / "calls"
    bindir.mkdir()
    calls.mkdir()
    script = textwrap.dedent(f"""\
        #!{sys.executable}
        import json, sys
        from pathlib import Path
        name = Path(sys.argv[0]).name
        with open({str(calls)!r} + "/" + name + ".jsonl", "a") as fh:
            fh.write(json.dumps(sys.argv[1:]) + "\\n")
        if name == "scontrol" and sys.argv[1:3] == ["show", "job"]:
            print({job_line!r})
        elif name == "scontrol" and sys.argv[1:3] == ["show", "hostnames"]:
            print("\\n".join({hosts!r}))
        """)
    for name in ("scontrol", "srun"):
        (bindir / name).write_text(script)
        (bindir / name).chmod(0o755)
    return os.pathsep.join([str(bindir), os.environ.get("PATH", "")]), calls


def recorded(calls: Path, name: str) -> list[list[str]]:
    path = calls / f"{name}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this host has ``n`` GPUs visible."""

    def set_gpus(n: int):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)

    return set_gpus


@pytest.fixture
def started(monkeypatch):
    """Processes the launcher starts (scontrol queries pass through to the stand-in)."""
    runs = []
    real = subprocess.run

    def fake_run(cmd, *a, **k):
        if cmd[0] == "scontrol":
            return real(cmd, *a, **k)
        runs.append(list(cmd))
        if cmd[0] == "srun":  # the stand-in records the whole 2-node command
            return real(cmd, *a, **k)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(L.subprocess, "run", fake_run)
    return runs


def test_parse_scontrol_keeps_the_first_field():
    f = L.parse_scontrol_job(JOB_2_NODES)
    assert f["NumNodes"] == "2" and f["NodeList"] == "gpu[017-018]" and f["NumTasks"] == "2"
    assert L._gres_gpus(f["TresPerNode"]) == 4
    assert L._gres_gpus("gres/gpu:a100:2") == 2 and L._gres_gpus("gres/gpu=3") == 3 and L._gres_gpus("") is None


def test_one_node_two_tasks_starts_one_world(tmp_path, monkeypatch, gpus, started):
    """A job of 1 node x 2 tasks (SLURM_* stripped but the job id, as the executor
    plugin leaves it): exactly one torchrun of dp x tp = 2 processes, no srun."""
    path, calls = stand_ins(tmp_path, JOB_1_NODE_2_TASKS, ["node1"])
    monkeypatch.setenv("PATH", path)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    gpus(2)
    assert L.launch(2, ARGV, "auto") == 0
    assert len(started) == 1, started
    cmd = started[0]
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--standalone" in cmd and "--nproc-per-node=2" in cmd and "--nnodes=2" not in cmd
    assert recorded(calls, "srun") == []
    assert recorded(calls, "scontrol")[0] == ["show", "job", "-o", "77"]


def test_two_nodes_one_torchrun_per_node(tmp_path, monkeypatch, gpus, started):
    """A job of 2 nodes x 4 GPUs and a plan of 8: the job's own srun, one task per node,
    each a torchrun of 4 meeting on the first node."""
    path, calls = stand_ins(tmp_path, JOB_2_NODES, ["gpu017", "gpu018"])
    monkeypatch.setenv("PATH", path)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    gpus(4)
    assert L.launch(8, ARGV, "cuda") == 0
    (srun,) = recorded(calls, "srun")
    head = srun.index(sys.executable)
    assert srun[:head] == ["--jobid=4242", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--overlap", "--kill-on-bad-exit=1"]
    assert srun[head:] == [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=4",
                           "--rdzv-backend=c10d", "--rdzv-endpoint=gpu017:29500", "--rdzv-id=4242", "-m", "ampflow.cli", *ARGV]  # fmt: skip
    # 8 processes over 2 nodes of 4 GPUs: 7 would not divide, 10 would put 5 on a node of 4
    with pytest.raises(InputError, match="do not divide"):
        L.launch_command(7, ARGV, "cuda", env={"SLURM_JOB_ID": "4242"})
    with pytest.raises(InputError, match="need 5 GPUs per node; the job has 4"):
        L.launch_command(10, ARGV, "cuda", env={"SLURM_JOB_ID": "4242"})


def test_two_processes_on_one_gpu_are_refused(monkeypatch, gpus, started):
    """The plan's 2 processes in a 1-GPU allocation: refused before any process starts."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    gpus(1)
    with pytest.raises(InputError) as err:
        L.launch(2, ARGV, "auto")
    msg = str(err.value)
    assert "2 GPUs, 1 visible (CUDA_VISIBLE_DEVICES=0)" in msg and "\n" not in msg
    assert "amp.devices: 1" in msg and "train.device: cpu" in msg  # both ways out
    assert started == []
    gpus(2)
    assert L.launch(2, ARGV, "auto") == 0 and len(started) == 1


DEMO = Path(__file__).resolve().parents[1] / "config/demo.yaml"


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 cores for the demo's 2 CPU processes")
def test_the_demo_on_a_one_gpu_machine_starts_on_cpu_cores(monkeypatch, gpus, started):
    """config/demo.yaml plans 2 processes; on a machine with one GPU and a CUDA torch its
    train.device (cpu) starts them on CPU cores instead of refusing."""
    import yaml

    demo = yaml.safe_load(DEMO.read_text())
    assert demo["amp"]["devices"] == 2 and demo["train"]["device"] == "cpu"
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    gpus(1)
    assert L.launch(demo["amp"]["devices"], ARGV, demo["train"]["device"]) == 0
    assert len(started) == 1 and "--nproc-per-node=2" in started[0]


def test_the_trainer_names_its_device_and_the_gpus_it_leaves(gpus, tmp_path, caplog):
    """No silent fallback: with one GPU visible and train.device cpu (the demo's), the
    trainer's log names the device, the GPU left unused and the process count."""
    import logging

    import yaml
    from helpers import batched_paired_data

    from ampflow.contract.config import ModelConfig, TrainConfig
    from ampflow.train.trainer import Trainer

    gpus(1)
    settings = TrainConfig.from_dict({**yaml.safe_load(DEMO.read_text())["train"], "threads": 1})
    with caplog.at_level(logging.INFO, logger="ampflow.train.trainer"):
        Trainer(batched_paired_data(batches=False), ModelConfig(latent_dim=4, hidden_dim=8, heads=2, window=2), settings, tmp_path)
    assert "device: cpu (train.device cpu; 1 CUDA GPU(s) visible, not used), 1 process(es)" in caplog.text


def test_a_rank_without_a_gpu_of_its_own_is_refused(gpus):
    gpus(1)
    with pytest.raises(InputError, match="2 GPUs, 1 visible"):
        L.check_rank_device({"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    gpus(2)
    L.check_rank_device({"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"})


def test_a_launcher_in_a_step_of_several_tasks_is_refused(started):
    with pytest.raises(InputError, match="one of 2 tasks"):
        L.launch_command(2, ARGV, "cpu", env={"SLURM_STEP_NUM_TASKS": "2"})


@pytest.mark.skipif(not shutil.which("taskset") or (os.cpu_count() or 1) < 2, reason="needs taskset and 2 cores")
def test_cli_refuses_a_world_larger_than_its_cores(tmp_path):
    """`ampflow train --launch` on one core with a plan of 2 CPU processes: one line,
    non-zero exit, nothing started (the data folder does not even exist)."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"mesh": {"dp": 2, "tp": 1}, "world_size": 2}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    cmd = ["taskset", "-c", "0", sys.executable, "-m", "ampflow.cli", "train", "--launch", "--data", str(tmp_path / "none"),
           "--out", str(tmp_path / "out"), "--train", json.dumps({"device": "cpu"}), "--plan", str(plan)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "2 CPU cores, 1 visible" in lines[0], r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()


# ------------------------------------------------------------- the job's allocation
def plan(dp: int, tp: int, cpu: dict | None = None) -> Plan:
    return Plan.from_dict({"mesh": {"dp": dp, "tp": tp}, "world_size": dp * tp, "cpu": cpu or {}})


def test_allocation_from_plan_and_offer():
    offer = ClusterOffer(gpu_partition="gpu", gpus_per_node=4, cpus_per_gpu=2, mem_mb_per_gpu=3000)
    one = train_allocation(plan(2, 1), offer).resources()
    assert one == {"gpu": 2, "cpus_per_gpu": 2, "mem_mb": 6000, "slurm_partition": "gpu", "nodes": 1}
    two = train_allocation(plan(2, 4), offer).resources()
    assert two == {"gpu": 0, "nodes": 2, "tasks": 2, "cpus_per_task": 8, "mem_mb": 12000, "mpi": "srun",
                   "slurm_partition": "gpu", "slurm_extra": "--gpus-per-node=4 --ntasks-per-node=1"}  # fmt: skip
    # 6 processes on nodes of 4: 2 nodes of 3
    assert train_allocation(plan(3, 2), offer).per_node == 3
    with pytest.raises(InputError, match="cluster.gpus_per_node"):
        train_allocation(plan(5, 1), offer)  # 5 over 2 nodes
    with pytest.raises(InputError, match="cluster.gpus_per_node"):
        train_allocation(plan(1, 1), ClusterOffer(gpus_per_node=0))
    cpu = train_allocation(plan(2, 1, {"cores": 2, "host_need_bytes": 4 << 30}), offer).resources()
    assert cpu == {"mem_mb": 2 * 1000 + 5120}
    with pytest.raises(InputError, match="cluster.cpus_per_gpu"):
        ClusterOffer.from_dict({"cpus_per_gpu": 0})
