"""What a job sees: NVML inventory of its accelerators, its CPU cores and host memory, for
planning and for the run record."""

from __future__ import annotations

import os
import socket


def probe_devices(cores: int | None = None) -> dict:
    """Visible GPUs with name and total memory (bytes); an empty list on CPU-only hosts.
    ``cpu``: this process's cores and the host's memory (:func:`host_cpu`; ``cores``
    caps the cores, e.g. at those the workflow rule was granted).

    ``CUDA_VISIBLE_DEVICES`` is honoured (with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so
    that NVML and CUDA indices agree).
    """
    info = {
        "host": socket.gethostname(),
        "cpu": host_cpu(cores),
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


def host_cpu(cores: int | None = None) -> dict:
    """This process's CPU cores and host memory (JSON, integers; None where unknown).

    ``affinity_cores`` is the cores this process may run on (``os.sched_getaffinity``:
    a SLURM job's or a container's cores, not the machine's); ``cores`` is that, capped
    at ``cores`` when given (the cores the workflow rule was granted: a local Snakemake
    run does not pin its jobs). Memory from ``/proc/meminfo`` (``MemTotal``,
    ``MemAvailable``), in bytes.
    """
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count() or 1
    mem = {}
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    mem[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return {
        "affinity_cores": affinity,
        "cores": min(affinity, int(cores)) if cores else affinity,
        "memory_total_bytes": mem.get("MemTotal"),
        "memory_available_bytes": mem.get("MemAvailable"),
    }
