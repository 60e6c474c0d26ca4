"""The GPU memory a command's processes hold, as NVML sees it from outside, beside what
the plan predicted for it.

The trainer's ``peak_bytes`` and ``bench_memory_model.py`` read the caching allocator from
inside the process; that view leaves out the CUDA context, the allocator's cache and
anything a library allocates past it. NVML (the driver's view, what ``nvidia-smi`` shows
and what an out-of-memory error follows) is the outside referee. This runs a command,
samples NVML every ``--interval`` seconds while it runs, and prints:

* the peak of the memory NVML charges to the command's processes (the command and every
  descendant: ``make demo-gpu`` runs Snakemake, which runs ``ampflow train``), summed per
  device at each sample; where NVML reports no process of the tree (a container with its
  own PID namespace: NVML gives the host's PIDs) or no per-process figure, the device's
  used memory above what it held before the command started;
* for each plan given (``--plan``, a path or a glob read after the command ends): the
  plan's ``predicted_peak_bytes`` (the step's tensors), what a device holds for it with
  the CUDA overheads (:meth:`ampflow.amp.memory.cuda.CudaOverheads.device_bytes`: cuBLAS
  workspaces, rounding, the fragmentation allowance and the context) and NVML's peak
  over that.

The exit status is the command's (2 without NVML or a GPU). Linux only (the process tree
is read from ``/proc``)::

    python scripts/nvml_peak.py --plan 'results/demo-gpu/amp/*/plan.json' -- make demo-gpu
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

MIB = 2**20


def process_tree(root: int, proc: Path = Path("/proc")) -> set[int]:
    """``root`` and every process descended from it, from the parent PIDs in
    ``/proc/<pid>/stat`` (a process that exits between the listing and the read is
    skipped)."""
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo += children.get(pid, [])
    return tree


@dataclass
class Peaks:
    """What the samples found (bytes)."""

    baseline: list[int]  # each device's used memory before the command
    process_peak: int = 0  # the tree's NVML memory, summed over devices, at its largest sample
    process_peak_by_device: list[int] = field(default_factory=list)
    device_peak_over_baseline: int = 0  # the largest sum over devices of used - baseline
    pids: set[int] = field(default_factory=set)  # the tree's PIDs NVML reported
    samples: int = 0

    @property
    def outside(self) -> int:
        """The figure to compare: the processes' own where NVML charged any to them,
        otherwise the devices' growth over their idle level."""
        return self.process_peak if self.pids else self.device_peak_over_baseline

    @property
    def source(self) -> str:
        return "the command's processes" if self.pids else "device used above its level before the command"


class Sampler:
    """Sample ``nvml`` (the ``pynvml`` module, initialised) for the process tree of
    ``root`` on every visible device, from a thread, until :meth:`stop`."""

    def __init__(self, nvml, handles: list, interval: float = 0.05, tree=process_tree):
        self.nvml, self.handles, self.interval, self.tree = nvml, handles, interval, tree
        self.peaks = Peaks(baseline=[int(nvml.nvmlDeviceGetMemoryInfo(h).used) for h in handles],
                           process_peak_by_device=[0] * len(handles))  # fmt: skip
        self.root: int | None = None
        self.error = ""  # why sampling stopped early, if it did
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        tree = self.tree(self.root) if self.root is not None else set()
        total, grown = 0, 0
        for i, h in enumerate(self.handles):
            grown += int(self.nvml.nvmlDeviceGetMemoryInfo(h).used) - self.peaks.baseline[i]
            try:
                running = self.nvml.nvmlDeviceGetComputeRunningProcesses(h)
            except self.nvml.NVMLError:
                running = []
            mine = [p for p in running if p.pid in tree and p.usedGpuMemory is not None]
            self.peaks.pids.update(p.pid for p in mine)
            on_device = sum(int(p.usedGpuMemory) for p in mine)
            self.peaks.process_peak_by_device[i] = max(self.peaks.process_peak_by_device[i], on_device)
            total += on_device
        self.peaks.process_peak = max(self.peaks.process_peak, total)
        self.peaks.device_peak_over_baseline = max(self.peaks.device_peak_over_baseline, grown)
        self.peaks.samples += 1

    def start(self, root: int) -> Sampler:
        self.root = root
        self._thread = threading.Thread(target=self._run, name="nvml-peak", daemon=True)
        self._thread.start()
        return self

    def _sample_or_stop(self) -> bool:
        """One sample; False (and :attr:`error` set) once NVML has failed."""
        if self.error:
            return False
        try:
            self.sample()
        except Exception as e:  # noqa: BLE001 - said with the figures, which stop at this sample
            self.error = f"{type(e).__name__}: {e}"
            return False
        return True

    def _run(self) -> None:
        while not self._stop.is_set() and self._sample_or_stop():
            self._stop.wait(self.interval)

    def stop(self) -> Peaks:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample_or_stop()  # the last state, in case the command ended between two samples
        return self.peaks


def plan_lines(patterns: list[str], peaks: Peaks, overheads) -> list[str]:
    """One line per plan file matched by ``patterns``: its prediction beside NVML's peak."""
    lines = []
    paths = sorted({p for pattern in patterns for p in glob.glob(pattern)})
    if patterns and not paths:
        lines.append(f"plan: no file matches {', '.join(patterns)}")
    from ampflow.contract.plan import Plan

    for path in paths:
        predicted = Plan.read(path).predicted_peak_bytes
        device = overheads.device_bytes(predicted)
        lines.append(
            f"plan {path}: predicted step tensors {predicted / MIB:.1f} MiB; on the device with context, workspaces and "
            f"fragmentation {device / MIB:.1f} MiB; NVML peak / that = {peaks.outside / device:.3f}"
        )
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], usage="%(prog)s [options] -- command ...")
    ap.add_argument("--interval", type=float, default=0.05, help="seconds between samples (default 0.05)")
    ap.add_argument("--plan", action="append", default=[], help="plan.json path or glob to compare with (repeatable)")
    ap.add_argument("--json-out", type=Path, help="also write the figures here")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("no command given (put it after --)")
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as e:  # ImportError, or NVMLError on a host without a driver
        print(f"nvml-peak: no NVML here ({e}); nothing run", file=sys.stderr)
        return 2
    try:
        from ampflow.devices import visible_devices

        handles = [h for _, h in visible_devices(pynvml, os.environ.get("CUDA_VISIBLE_DEVICES"))]
        if not handles:
            print("nvml-peak: NVML sees no GPU this process may use; nothing run", file=sys.stderr)
            return 2
        # from NVML, not torch: torch would open a CUDA context of its own in this process
        capability = tuple(pynvml.nvmlDeviceGetCudaComputeCapability(handles[0]))
        sampler = Sampler(pynvml, handles, a.interval)
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd)
        sampler.start(proc.pid)
        try:
            rc = proc.wait()
        finally:
            peaks = sampler.stop()
        seconds = time.perf_counter() - t0
    finally:
        pynvml.nvmlShutdown()
    by_device = ", ".join(f"{b / MIB:.0f}" for b in peaks.process_peak_by_device)
    print(
        f"nvml-peak: {peaks.outside / MIB:.1f} MiB at the peak ({peaks.source}); processes {peaks.process_peak / MIB:.1f} MiB "
        f"(per device {by_device}; {len(peaks.pids)} PID(s) seen), devices above their level before {peaks.device_peak_over_baseline / MIB:.1f} MiB "
        f"(before: {', '.join(f'{b / MIB:.0f}' for b in peaks.baseline)} MiB); {peaks.samples} samples in {seconds:.1f} s; command exit {rc}"
    )
    if sampler.error:
        print(f"nvml-peak: sampling stopped early ({sampler.error}): the figures above are a lower bound")
    if a.plan:
        from ampflow.amp.memory.cuda import cuda_overheads

        for line in plan_lines(a.plan, peaks, cuda_overheads(capability)):
            print(line)
    if a.json_out:
        a.json_out.write_text(json.dumps({"command": cmd, "exit": rc, "seconds": seconds, "outside_bytes": peaks.outside, "source": peaks.source,
                                          "process_peak_bytes": peaks.process_peak, "device_peak_over_baseline_bytes": peaks.device_peak_over_baseline,
                                          "baseline_bytes": peaks.baseline, "pids": sorted(peaks.pids), "samples": peaks.samples}, indent=1))  # fmt: skip
    return rc


if __name__ == "__main__":
    sys.exit(main())
