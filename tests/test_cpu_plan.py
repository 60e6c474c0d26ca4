"""CPU-sized runs: the plan's torch threads per process (the allocation's cores over the
mesh's processes; an explicit train.threads wins), the host-memory check of the batch,
byte-identical plans for identical inputs, and the devices record and calibration that
feed them. The expected figures are worked out by hand below, not by the code tested."""

from __future__ import annotations

import json

import pytest
from helpers import GIB, host, linear_estimate, plan_for, profile

from ampflow.amp.decide.cpu import threads_per_process, trains_on_cpu
from ampflow.amp.decide.diagnose import diagnose
from ampflow.base.errors import InputError
from ampflow.cli import main
from ampflow.contract.config import TrainConfig
from ampflow.contract.plan import Plan
from ampflow.devices import probe_devices
from ampflow.report.plan_text import explain, threads_text


# ------------------------------------------------------------------ threads
@pytest.mark.parametrize(
    "cores, processes, expected",
    [(16, 1, 16), (16, 2, 8), (16, 3, 5), (64, 8, 8), (2, 2, 1), (2, 4, 1), (1, 1, 1), (6, 4, 1)],
)
def test_threads_are_cores_over_processes(cores, processes, expected):
    pl = plan_for(processes, {"device": "cpu", "threads": "auto"}, host(cores))
    assert pl.mesh.dp * pl.mesh.tp == processes
    assert pl.threads == expected
    assert pl.cpu.cores == cores and pl.cpu.processes == processes and pl.cpu.threads_source == "plan"
    assert f"cpu: {cores} cores / {processes} process(es) -> {expected} thread(s) per process" in " ".join(pl.reasons)
    assert expected * processes <= max(cores, processes)  # never more threads than cores per process


def test_threads_auto_is_the_default_and_auto_device_without_gpus_is_cpu():
    assert TrainConfig().threads == "auto" and TrainConfig().explicit_threads is None
    assert plan_for(2, {}, host(16)).threads == 8


def test_an_explicit_integer_wins_and_the_plan_says_so():
    pl = plan_for(2, {"device": "cpu", "threads": 3}, host(16))
    assert pl.threads == 3 and pl.cpu.threads_source == "train.threads"
    why = " ".join(pl.reasons)
    assert "3 per process, as train.threads sets (an explicit integer wins)" in why and "16 cores / 2 process(es) -> 8" in why
    # more threads than cores: said, not changed
    over = plan_for(2, {"device": "cpu", "threads": 2}, host(2))
    assert over.threads == 2 and "exceed the 2 cores" in " ".join(over.reasons)


@pytest.mark.parametrize("train, devices", [({"device": "cuda"}, host(16)), ({"device": "auto"}, host(16, gpus=2))])
def test_a_gpu_run_has_no_cpu_section(train, devices):
    pl = plan_for(2, train, devices)
    assert pl.cpu is None and pl.threads is None
    assert not any(r.startswith(("cpu", "host memory")) for r in pl.reasons)


def test_no_cores_recorded_gives_one_thread():
    pl = plan_for(2, {"device": "cpu"}, {"devices": []})
    assert pl.threads == 1 and pl.cpu.threads_source == "default"
    assert pl.cpu.host_fits is None  # and the batch is not checked


def test_helpers():
    assert [threads_per_process(c, p) for c, p in [(16, 2), (7, 2), (1, 4), (0, 1)]] == [8, 3, 1, 1]
    assert trains_on_cpu("cpu", host(gpus=4)) and not trains_on_cpu("cuda", host()) and trains_on_cpu("auto", None)
    with pytest.raises(InputError):
        TrainConfig(threads=0)
    with pytest.raises(InputError):
        TrainConfig(threads="many")


# ------------------------------------------------------------------ batch
def test_batch_that_fits_host_memory():
    pl = plan_for(2, {"device": "cpu"}, host(16, available=GIB))
    # per process: 1000 + 10 x 64 peak, and 32 cells x 400 bytes of data batch; two processes
    assert pl.cpu.host_need_bytes == 2 * (1000 + 640 + 32 * 400) == 28880
    assert pl.cpu.host_fits is True and pl.cpu.largest_fitting_batch is None and pl.cpu.batch_size == 64
    assert any(r.startswith("host memory: batch 64 needs") and r.endswith(": fits.") for r in pl.reasons)


def test_batch_that_does_not_fit_names_one_that_would():
    pl = plan_for(2, {"device": "cpu"}, host(16, available=20000))
    # per process 1000 + 10 B + ceil(B / 2) x 400 <= 10000: B = 42 gives 9820, B = 43 gives 10230
    assert pl.cpu.host_fits is False and pl.cpu.largest_fitting_batch == 42
    assert pl.cpu.batch_size == 64  # the configured batch is not changed
    assert any("WARNING, does not fit; train.batch_size 42 would" in r for r in pl.reasons)
    assert "does NOT fit; batch 42 would" in explain(pl)
    # the budget fraction applies to the available memory: half of 40000 is the same 20000
    assert plan_for(2, {"device": "cpu"}, host(16, available=40000), fraction=0.5).cpu.largest_fitting_batch == 42
    # not even two cells: said
    none = plan_for(2, {"device": "cpu"}, host(16, available=1000))
    assert none.cpu.largest_fitting_batch is None and any("no batch of 2 or more would" in r for r in none.reasons)


# ------------------------------------------------------------------ determinism, reading, showing
def test_identical_inputs_give_byte_identical_plans():
    a = plan_for(4, {"device": "cpu", "threads": "auto"}, host(16, available=20000)).dumps()
    b = plan_for(4, {"device": "cpu", "threads": "auto"}, host(16, available=20000)).dumps()
    assert a == b
    assert Plan.from_dict(json.loads(a)).dumps() == a


def test_an_older_plan_reads_without_threads():
    doc = json.loads(plan_for(2, {"device": "cpu"}).dumps())
    doc["version"] = 2
    del doc["cpu"]
    old = Plan.from_dict(doc)
    assert old.cpu is None and old.threads is None and "not planned" in threads_text(old)


def test_explain_shows_threads_and_why():
    text = explain(plan_for(2, {"device": "cpu"}, host(16)))
    assert "cpu threads" in text and "8 per process (16 cores, 2 process(es); cores / processes)" in text
    assert "cpu: 16 cores / 2 process(es) -> 8 thread(s) per process" in text


def test_cli_devices_cores_and_diagnose_from_a_devices_file(tmp_path):
    dev = tmp_path / "devices.json"
    assert main(["devices", "--cores", "1", "--out", str(dev)]) == 0
    rec = json.loads(dev.read_text())
    assert rec["cpu"]["cores"] == 1 and rec["cpu"]["affinity_cores"] >= 1
    assert probe_devices(10**6)["cpu"]["cores"] == rec["cpu"]["affinity_cores"]  # the cap only lowers it
    fake = tmp_path / "fake.json"
    fake.write_text(json.dumps(host(12, available=64 * GIB)))
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps(profile()))
    outs = []
    for i in range(2):
        out = tmp_path / f"plan{i}.json"
        assert main(["diagnose", str(prof), "--devices", "3", "--device-memory", "80", "--devices-file", str(fake),
                     "--train", json.dumps({"device": "cpu", "threads": "auto"}), "--out", str(out)]) == 0  # fmt: skip
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    assert Plan.read(tmp_path / "plan0.json").threads == 4  # 12 cores / 3 processes


def test_calibration_times_with_the_plans_threads(tmp_path):
    fake = tmp_path / "devices.json"
    fake.write_text(json.dumps(host(4)))
    cal = tmp_path / "calibration.json"
    assert main(["calibrate", "--model", json.dumps({"window": 8}), "--train", json.dumps({"device": "cpu", "threads": "auto"}),
                 "--devices-file", str(fake), "--processes", "2", "--anchors", "256", "--blocks", "4", "--reps", "1",
                 "--out", str(cal)]) == 0  # fmt: skip
    assert json.loads(cal.read_text())["device"] == "cpu (2 threads)"  # 4 cores / 2 processes


def test_plan_page_shows_threads(tmp_path):
    from ampflow.report.plan import plan_page

    page = plan_page(plan_for(2, {"device": "cpu"}, host(16, available=20000)), tmp_path / "plan.html", "cpu").read_text()
    assert "CPU threads per process" in page and "8 per process (16 cores, 2 process(es); cores / processes)" in page
    assert "does NOT fit; batch 42 would" in page


def test_a_calibration_timed_with_other_threads_is_named():
    from dataclasses import replace

    from ampflow.amp.cost.model import DEFAULT_CONSTANTS

    def with_source(source):
        c = replace(DEFAULT_CONSTANTS, source=source)
        return diagnose(profile(), 2, 80 * GIB, 1.0, estimate=linear_estimate, constants=c, train=TrainConfig(device="cpu"), host=host(16))

    assert any("timed with 1 thread(s) per process, this plan gives 8" in r for r in with_source("calibrated on cpu (1 thread)").reasons)
    assert not any("timed with" in r for r in with_source("calibrated on cpu (8 threads)").reasons)
