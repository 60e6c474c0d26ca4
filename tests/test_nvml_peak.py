"""``scripts/nvml_peak.py``: the GPU memory of a command's process tree as NVML reports it.

Referees: psutil's own walk of the process tree (an implementation independent of the
script's ``/proc`` reading), and a fake NVML whose memory timeline is scripted, so the
right peak is known: the command's processes summed over devices at the worst sample, a
foreign process never counted, and the device's growth where NVML names no process of
the tree (a container's PID namespace).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from types import SimpleNamespace

import psutil
import pytest
from conftest import load_script

from ampflow.amp.memory.cuda import cuda_overheads

nvml_peak = load_script("nvml_peak")
GIB = 2**30
MARK = "nvml-peak-test-process"


def _spawn_tree() -> subprocess.Popen:
    """A shell with two sleeping children, one of which has a child of its own."""
    return subprocess.Popen(["sh", "-c", "sleep 30 & sh -c 'sleep 30 & wait' & wait"])


def test_process_tree_is_psutils_tree():
    proc = _spawn_tree()
    try:
        deadline = time.monotonic() + 10
        expected = set()
        while time.monotonic() < deadline and len(expected) < 4:  # sh, sleep, sh, sleep
            expected = {proc.pid} | {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
            time.sleep(0.02)
        assert len(expected) == 4
        assert nvml_peak.process_tree(proc.pid) == expected
    finally:
        for c in psutil.Process(proc.pid).children(recursive=True):
            c.kill()
        proc.kill()
        proc.wait()


class FakeNVML:
    """Two GPUs; ``timeline`` is a list of samples, each ``(used per device, [(device,
    pid, bytes), ...])``; every call of :meth:`nvmlDeviceGetMemoryInfo` on device 0 moves
    to the next sample (the last one repeats)."""

    class NVMLError(Exception):
        pass

    def __init__(self, timeline):
        self.timeline, self.i = timeline, -1
        self.gpus = [SimpleNamespace(index=0), SimpleNamespace(index=1)]

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.gpus[i]

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return (9, 0)

    def nvmlDeviceGetMemoryInfo(self, h):
        if h.index == 0:
            self.i = min(self.i + 1, len(self.timeline) - 1)
        return SimpleNamespace(used=self.timeline[self.i][0][h.index])

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=pid, usedGpuMemory=b) for dev, pid, b in self.timeline[self.i][1] if dev == h.index]


def test_the_peak_is_the_trees_memory_summed_over_devices_at_its_worst_sample():
    mine, child, other = 101, 102, 999
    timeline = [
        ([1 * GIB, 1 * GIB], []),  # before the command (the baseline)
        ([3 * GIB, 1 * GIB], [(0, mine, 2 * GIB), (0, other, 5 * GIB)]),
        ([4 * GIB, 3 * GIB], [(0, mine, 3 * GIB), (1, child, 2 * GIB)]),  # the tree's peak: 5 GiB
        ([2 * GIB, 4 * GIB], [(1, child, 3 * GIB), (0, other, 1 * GIB), (1, mine, None)]),  # None: NVML has no figure
    ]
    fake = FakeNVML(timeline)
    s = nvml_peak.Sampler(fake, fake.gpus, tree=lambda root: {root, child})
    s.root = mine
    for _ in range(3):
        s.sample()
    peaks = s.stop()  # samples once more: the last state again
    assert peaks.baseline == [1 * GIB, 1 * GIB]
    assert peaks.process_peak == 5 * GIB
    assert peaks.process_peak_by_device == [3 * GIB, 3 * GIB]
    assert peaks.pids == {mine, child}
    assert peaks.device_peak_over_baseline == 5 * GIB  # (4 - 1) + (3 - 1) at the second sample
    assert (peaks.outside, peaks.source) == (5 * GIB, "the command's processes")


def test_without_the_trees_pids_the_devices_growth_is_the_figure():
    """In a container NVML reports the host's PIDs: none is in the tree."""
    timeline = [([1 * GIB, 0], []), ([6 * GIB, 2 * GIB], [(0, 4242, 5 * GIB), (1, 4243, 2 * GIB)]), ([2 * GIB, 0], [])]
    fake = FakeNVML(timeline)
    s = nvml_peak.Sampler(fake, fake.gpus, tree=lambda root: {root})
    s.root = 7
    s.sample()
    peaks = s.stop()
    assert peaks.pids == set() and peaks.process_peak == 0
    assert peaks.outside == 7 * GIB and "device" in peaks.source


class TreeNVML(FakeNVML):
    """NVML as it is outside a container: every live process whose command line holds
    :data:`MARK` has 1 GiB on device 0; a foreign process 5 GiB on device 1."""

    def __init__(self):
        super().__init__([([2 * GIB, 7 * GIB], [])])

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        if h.index == 1:
            return [SimpleNamespace(pid=1, usedGpuMemory=5 * GIB)]
        return [SimpleNamespace(pid=p.pid, usedGpuMemory=GIB) for p in psutil.process_iter(["cmdline"]) if MARK in (p.info["cmdline"] or [])]


def test_main_runs_the_command_and_sets_nvmls_peak_beside_the_plan(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "pynvml", TreeNVML())
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    predicted = 3 * GIB
    plan = tmp_path / "amp" / "1mb_s10" / "plan.json"
    plan.parent.mkdir(parents=True)
    plan.write_text(json.dumps({"predicted_peak_bytes": predicted}))
    sleeper = "import time, sys; time.sleep(1.5); sys.exit(3)"
    cmd = ["sh", "-c", f'{sys.executable} -c "{sleeper}" {MARK} & {sys.executable} -c "{sleeper}" {MARK}; wait $!']
    rc = nvml_peak.main(["--interval", "0.02", "--plan", str(tmp_path / "amp" / "*" / "plan.json"), "--json-out", str(tmp_path / "o.json"), "--", *cmd])
    out = capsys.readouterr().out
    assert rc == 3  # the command's exit status
    figures = json.loads((tmp_path / "o.json").read_text())
    assert figures["process_peak_bytes"] == 2 * GIB  # two marked processes; the foreign one not counted
    assert len(figures["pids"]) == 2
    device = cuda_overheads((9, 0)).device_bytes(predicted)
    assert f"NVML peak / that = {2 * GIB / device:.3f}" in out
    assert str(plan) in out


def test_main_without_nvml_runs_nothing(monkeypatch, tmp_path):
    class Broken:
        class NVMLError(Exception):
            pass

        def nvmlInit(self):
            raise self.NVMLError("Driver Not Loaded")

    monkeypatch.setitem(sys.modules, "pynvml", Broken())
    marker = tmp_path / "ran"
    assert nvml_peak.main(["--", "touch", str(marker)]) == 2
    assert not marker.exists()


@pytest.mark.parametrize("argv", [[], ["--"]])
def test_a_command_is_required(argv):
    with pytest.raises(SystemExit):
        nvml_peak.main(argv)


def test_a_plan_glob_that_matches_nothing_is_said():
    peaks = nvml_peak.Peaks(baseline=[0], process_peak=GIB, pids={1})
    assert nvml_peak.plan_lines(["/nonexistent/*/plan.json"], peaks, cuda_overheads((9, 0))) == ["plan: no file matches /nonexistent/*/plan.json"]


def test_a_sampling_error_is_said_not_swallowed(monkeypatch, capsys):
    """NVML failing in the middle (a driver reset, a lost GPU) ends the sampling; the
    figures are then a lower bound, and the output says so."""

    class Failing(TreeNVML):
        calls = 0

        def nvmlDeviceGetComputeRunningProcesses(self, h):
            Failing.calls += 1
            if Failing.calls > 2:
                raise RuntimeError("GPU is lost")
            return []

    monkeypatch.setitem(sys.modules, "pynvml", Failing())
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    rc = nvml_peak.main(["--interval", "0.01", "--", sys.executable, "-c", "import time; time.sleep(0.5)"])
    out = capsys.readouterr().out
    assert rc == 0  # the command's status: it ran to its end
    assert "sampling stopped early (RuntimeError: GPU is lost)" in out and "lower bound" in out
    assert Failing.calls == 3  # no sample after the failure, the final one included
