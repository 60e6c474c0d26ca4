"""What accelerators a job sees: NVML inventory, for planning and for the run record."""

from __future__ import annotations

import os
import socket


def probe_devices() -> dict:
    """Visible GPUs with name and total memory (bytes); an empty list on CPU-only hosts.

    ``CUDA_VISIBLE_DEVICES`` is honoured (with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so
    that NVML and CUDA indices agree).
    """
    info = {
        "host": socket.gethostname(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "devices": [],
    }
    try:
        import pynvml
    except ImportError:
        info["nvml"] = "not installed"
        return info
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        info["nvml"] = f"unavailable: {e}"
        return info
    try:
        count = pynvml.nvmlDeviceGetCount()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        indices = list(range(count))
        if visible is not None:
            indices = [int(v) for v in visible.split(",") if v.strip().isdigit() and int(v) < count]
        for i in indices:
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            info["devices"].append(
                {
                    "index": i,
                    "name": name if isinstance(name, str) else name.decode(),
                    "memory_total": int(mem.total),
                    "memory_free": int(mem.free),
                }
            )
        info["nvml"] = "ok"
    finally:
        pynvml.nvmlShutdown()
    return info
