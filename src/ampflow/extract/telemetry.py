"""GPU telemetry: a thread that samples NVML utilisation and memory per GPU into JSONL.

One line per GPU per sample: time, seconds since the start, the worker's
``CUDA_VISIBLE_DEVICES`` entry, NVML name, GPU and memory-controller utilisation (%),
memory used and total (bytes). Without GPUs (CPU workers) or without NVML the file gets
one line with a ``note`` saying why nothing was sampled. ``torch.cuda.memory_usage``
would be a percentage of time, not bytes; NVML gives the device's own view, other
processes included.

Each start appends to the same file (a re-run keeps the work folder), so a job killed
in the middle of a write leaves a half-written last line that the next start would glue
its first line onto: :meth:`GpuSampler.start` cuts such a tail first, and the report's
reader skips one at the end of the file (the job that wrote it never restarted).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

#: The note of a job whose workers ran on the CPU; the report recognises it by this text.
CPU_NOTE = "no GPU in use (CPU workers): nothing sampled"


def drop_partial_tail(path: Path) -> int:
    """Cut a last line that has no newline (a writer killed mid-line) off ``path``; the
    number of bytes cut. Every complete line ends with one, so nothing whole is lost."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return 0
    if size == 0:
        return 0
    with open(path, "rb+") as fh:
        fh.seek(-1, 2)
        if fh.read(1) == b"\n":
            return 0
        fh.seek(0)
        keep = fh.read().rfind(b"\n") + 1
        fh.truncate(keep)
    log.warning("telemetry: %s ended in a half-written line (%d bytes, a killed job): cut before appending", path, size - keep)
    return size - keep


def _nvml_handles(pynvml, entries: list[str]):
    handles = []
    for e in entries:
        if e.isdigit():
            handles.append((e, pynvml.nvmlDeviceGetHandleByIndex(int(e))))
        else:  # a UUID, as SLURM and MIG may set
            handles.append((e, pynvml.nvmlDeviceGetHandleByUUID(e)))
    return handles


class GpuSampler:
    """Append samples of ``entries`` (``CUDA_VISIBLE_DEVICES`` values) to ``path`` every
    ``interval`` seconds, from a daemon thread, between :meth:`start` and :meth:`stop`."""

    def __init__(self, path, entries: list[str], interval: float = 5.0, run: str = ""):
        self.path = Path(path)
        self.entries = list(entries)
        self.interval = interval
        self.run = run or time.strftime("%Y-%m-%dT%H:%M:%S")
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.note = ""

    def _write(self, rows: list[dict]) -> None:
        with open(self.path, "a") as fh:
            for r in rows:
                fh.write(json.dumps(r, sort_keys=True) + "\n")

    def start(self) -> GpuSampler:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        drop_partial_tail(self.path)
        if not self.entries:
            self.note = CPU_NOTE
        else:
            try:
                import pynvml

                pynvml.nvmlInit()
                self._handles = _nvml_handles(pynvml, self.entries)
                self._nvml = pynvml
            except Exception as e:  # no NVML library, no driver, a MIG UUID NVML cannot resolve
                self.note = f"NVML unavailable ({type(e).__name__}: {e}): nothing sampled"
        if self.note:
            log.info("telemetry: %s", self.note)
            self._write([{"run": self.run, "time": time.time(), "note": self.note}])
            return self
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="gpu-telemetry", daemon=True)
        self._thread.start()
        return self

    def sample(self) -> list[dict]:
        nv = self._nvml
        now, rows = time.time(), []
        for entry, h in self._handles:
            util = nv.nvmlDeviceGetUtilizationRates(h)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            name = nv.nvmlDeviceGetName(h)
            rows.append(
                {
                    "run": self.run,
                    "time": now,
                    "elapsed": round(time.monotonic() - self._t0, 3),
                    "gpu": entry,
                    "name": name if isinstance(name, str) else name.decode(),
                    "utilization_gpu": int(util.gpu),
                    "utilization_memory": int(util.memory),
                    "memory_used": int(mem.used),
                    "memory_total": int(mem.total),
                }
            )
        return rows

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                rows = self.sample()
            except Exception as e:  # a GPU fell off the bus: say so once, stop sampling
                self._write([{"run": self.run, "time": time.time(), "note": f"sampling stopped: {e}"}])
                return
            self.samples.extend(rows)
            self._write(rows)
            self._stop.wait(self.interval)

    def stop(self) -> dict:
        """Stop sampling; mean GPU utilisation and peak memory per GPU over the samples."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._nvml.nvmlShutdown()
        summary = {}
        for entry in self.entries:
            rows = [r for r in self.samples if r["gpu"] == entry]
            if rows:
                summary[entry] = {
                    "samples": len(rows),
                    "mean_utilization_gpu": round(sum(r["utilization_gpu"] for r in rows) / len(rows), 1),
                    "peak_memory_used": max(r["memory_used"] for r in rows),
                }
        return summary
