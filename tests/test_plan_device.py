"""The plan records the device it trains on, decided when it is made, and training obeys
it: a plan for cuda where no GPU is visible is refused, never run on CPU cores. Older
plans (no ``device``) train where ``train.device`` says. ``amp.devices: auto`` counts
the GPUs of the devices record, and a config that needs a GPU names its key where there
is none.

The GPUs a test needs are played by a devices record (``devices.json``) and, for torch,
by :mod:`fake_cuda` (every process of a command sees the GPUs it is told).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from fake_cuda import fake_cuda_env
from helpers import GIB, host, plan_for, profile

from ampflow.amp.decide.diagnose import plan_device
from ampflow.base.errors import InputError
from ampflow.cli import main
from ampflow.contract.allocation import ClusterOffer, plan_on_gpus, train_allocation
from ampflow.contract.config import TrainConfig, amp_devices, check_amp_devices, gpu_settings, require_gpus
from ampflow.contract.plan import PLAN_VERSION, Plan
from ampflow.report.plan_text import device_text, explain
from ampflow.train.device import run_device


# ------------------------------------------------------------------ the plan's field
def test_plan_json_carries_the_device_and_old_plans_still_load(tmp_path):
    pl = plan_for(2, {"device": "cpu"}, host(16, gpus=1))
    assert PLAN_VERSION == 4 and pl.device == "cpu"
    path = pl.write(tmp_path / "plan.json")
    assert json.loads(path.read_text())["device"] == "cpu"
    back = Plan.read(path)
    assert back == pl and back.device == "cpu" and back.path == str(path)
    assert back.dumps() == pl.dumps()  # where it was read from is no part of the plan
    # a plan written before version 4: no device, so train.device decides
    old = {k: v for k, v in json.loads(path.read_text()).items() if k != "device"}
    old["version"] = 3
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert Plan.read(tmp_path / "old.json").device == ""
    assert "not recorded" in device_text(Plan.read(tmp_path / "old.json"))
    with pytest.raises(InputError, match="device: must be one of cpu, cuda") as err:
        Plan.from_dict({"device": "tpu"}, tmp_path / "bad.json")
    assert "bad.json" in str(err.value) and "'tpu'" in str(err.value)
    with pytest.raises(InputError, match="unknown plan key"):
        Plan.from_dict({"path": "x"})  # not a key of the JSON


@pytest.mark.parametrize(
    "setting, gpus, expected",
    [("cpu", 0, "cpu"), ("cpu", 2, "cpu"), ("cuda", 2, "cuda"), ("cuda", 0, "cuda"), ("auto", 2, "cuda"), ("auto", 0, "cpu")],
)
def test_the_device_is_decided_when_the_plan_is_made(setting, gpus, expected):
    """train.device cpu/cuda as set; auto: cuda when devices.json lists a GPU. The
    plan's cpu section and the job's allocation follow the same device."""
    pl = plan_for(2, {"device": setting}, host(16, gpus=gpus))
    assert pl.device == expected
    assert bool(pl.cpu) == (expected == "cpu")
    assert plan_on_gpus(pl) == (expected == "cuda")
    assert train_allocation(pl, ClusterOffer(gpus_per_node=4)).gpus == (expected == "cuda")
    why = next(r for r in pl.reasons if r.startswith("device:"))
    assert f"device: {expected}" in why
    if setting == "auto":
        assert ("lists 2 GPU(s)" if gpus else "lists no GPU") in why
    if setting == "cpu" and gpus:
        assert "the 2 GPU(s) devices.json lists are left unused" in why
    assert f"device               {expected} (2 process(es)" in explain(pl)


def test_without_train_or_devices_record_nothing_is_decided():
    assert plan_device(None, None) == ("", "")
    from helpers import linear_estimate

    from ampflow.amp.decide.diagnose import diagnose

    pl = diagnose(profile(), 2, 80 * GIB, 1.0, estimate=linear_estimate)
    assert pl.device == "" and plan_on_gpus(pl)  # as before: no cpu section = a GPU plan


def test_the_plan_page_shows_the_device(tmp_path):
    from ampflow.report.plan import plan_page

    page = plan_page(plan_for(2, {"device": "auto"}, host(16, gpus=2)), tmp_path / "plan.html", "gpu").read_text()
    assert "trains on" in page and "cuda (2 process(es): one process per GPU, NCCL)" in page


# ------------------------------------------------------------------ the run obeys it
def test_run_device_is_the_plans_and_a_cuda_plan_without_a_gpu_is_refused(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cuda = Plan.from_dict({"mesh": {"dp": 2}, "device": "cuda"}, tmp_path / "plan.json")
    with pytest.raises(InputError) as err:
        run_device(TrainConfig(device="auto"), cuda)
    msg = str(err.value)
    assert msg.startswith(f"{tmp_path / 'plan.json'}: device: ") and "no CUDA GPU is visible" in msg
    assert "(value: 'cuda')" in msg and "train.device: cpu" in msg
    # the plan decides, whatever train.device says; without a device, train.device does
    cpu = Plan.from_dict({"mesh": {"dp": 2}, "device": "cpu"})
    assert run_device(TrainConfig(device="cuda"), cpu)[0] == "cpu"
    assert run_device(TrainConfig(device="cpu"), Plan.from_dict({"mesh": {"dp": 2}})) == ("cpu", "train.device cpu")
    assert run_device(TrainConfig(device="auto"), None)[0] == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert run_device(TrainConfig(device="cpu"), cuda)[0] == "cuda"
    assert run_device(TrainConfig(device="auto"), None)[0] == "cuda"


def test_the_trainer_refuses_a_cuda_plan_without_a_gpu(tmp_path, monkeypatch):
    import torch
    from helpers import batched_paired_data

    from ampflow.contract.config import ModelConfig
    from ampflow.train.trainer import Trainer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(InputError, match="no CUDA GPU is visible"):
        Trainer(batched_paired_data(batches=False), ModelConfig(latent_dim=4, hidden_dim=8, heads=2, window=2), TrainConfig(threads=1),
                tmp_path / "out", plan=Plan.from_dict({"device": "cuda"}))  # fmt: skip


def test_cli_refuses_a_cuda_plan_without_a_gpu_before_starting_anything(tmp_path):
    """`ampflow train --launch` (the train rule's command) with a plan for cuda on a host
    whose torch sees no GPU: one line naming plan.json, the device and the fix; nothing
    started (the data folder does not even exist), no output folder."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"mesh": {"dp": 2, "tp": 1}, "world_size": 2, "device": "cuda"}))
    env = {k: v for k, v in fake_cuda_env(tmp_path / "site", 0).items() if not k.startswith("SLURM_")}
    cmd = [sys.executable, "-m", "ampflow.cli", "train", "--launch", "--data", str(tmp_path / "none"), "--out", str(tmp_path / "out"),
           "--train", json.dumps({"device": "auto"}), "--plan", str(plan)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert str(plan) in lines[0] and "device" in lines[0] and "'cuda'" in lines[0] and "train.device: cpu" in lines[0]
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()


# ------------------------------------------------------------------ amp.devices: auto
def test_amp_devices_auto_counts_the_gpus_of_the_record():
    assert check_amp_devices(2) == 2 and check_amp_devices("3") == 3 and check_amp_devices("auto") == "auto"
    for bad in (0, -1, True, "two", 1.5):
        with pytest.raises(InputError, match="amp.devices"):
            check_amp_devices(bad)
    assert amp_devices("auto", host(16, gpus=3)) == 3 and amp_devices(2, host(16, gpus=3)) == 2
    with pytest.raises(InputError) as err:
        amp_devices("auto", {**host(16), "nvml": "unavailable: NVML Shared Library Not Found"})
    msg = str(err.value)
    assert msg.startswith("amp.devices: ") and "(value: 'auto')" in msg and "none is visible" in msg and "NVML" in msg


def test_cli_diagnose_with_devices_auto(tmp_path):
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps(profile()))
    two = tmp_path / "two.json"
    two.write_text(json.dumps(host(16, gpus=2)))
    out = tmp_path / "plan.json"
    assert main(["diagnose", str(prof), "--devices", "auto", "--device-memory", "auto", "--devices-file", str(two),
                 "--train", json.dumps({"device": "cuda"}), "--out", str(out)]) == 0  # fmt: skip
    pl = Plan.read(out)
    assert pl.inputs.devices == 2 and pl.world == 2 and pl.device == "cuda" and pl.inputs.device_memory_bytes == 80 * GIB
    none = tmp_path / "none.json"
    none.write_text(json.dumps(host(16)))
    assert main(["diagnose", str(prof), "--devices", "auto", "--device-memory", "1", "--devices-file", str(none),
                 "--train", json.dumps({"device": "cuda"}), "--out", str(tmp_path / "no.json")]) != 0  # fmt: skip
    assert not (tmp_path / "no.json").exists()


def test_a_config_that_needs_a_gpu_names_its_key_where_there_is_none():
    import yaml
    from conftest import REPO

    gpu = yaml.safe_load((REPO / "config/demo-gpu.yaml").read_text())
    demo = yaml.safe_load((REPO / "config/demo.yaml").read_text())
    assert gpu_settings(gpu) == [("train.device", "cuda"), ("amp.devices", "auto"), ("amp.device_memory_gb", "auto")]
    assert gpu_settings(demo) == []
    with pytest.raises(InputError) as err:
        require_gpus(gpu, {**host(16), "cuda_visible_devices": ""})
    msg = str(err.value)
    assert msg.startswith("train.device: ") and "(value: 'cuda')" in msg
    assert "amp.devices: auto" in msg and "amp.device_memory_gb: auto" in msg and "nothing was run" in msg
    require_gpus(gpu, host(16, gpus=1))
    require_gpus(demo, host(16))
    # the GPU demo is the CPU demo's data and settings, planned for the GPUs
    assert gpu["inputs"] == demo["inputs"] and gpu["configs"] == demo["configs"] and gpu["model"] == demo["model"]
    assert gpu["dataset"] != demo["dataset"]
