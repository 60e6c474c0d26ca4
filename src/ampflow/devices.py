"""What a job sees: NVML inventory of its accelerators, its CPU cores and host memory, for
planning and for the run record."""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def probe_devices(cores: int | None = None) -> dict:
    """Visible GPUs with name and total memory (bytes); an empty list on CPU-only hosts.
    ``cpu``: this process's cores and the host's memory (:func:`host_cpu`; ``cores``
    caps the cores, e.g. at those the workflow rule was granted).

    ``CUDA_VISIBLE_DEVICES`` is honoured in CUDA's forms: indices, GPU UUIDs
    (``GPU-...``, or a unique prefix of one, as some SLURM sites set them) and MIG
    instances (``MIG-...``), see :func:`visible_devices`. NVML and CUDA number the GPUs
    alike only with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, which ``ampflow``'s entry point
    sets unless the user has; with another order and more than one GPU, a warning.
    """
    info = {
        "host": socket.gethostname(),
        "cpu": host_cpu(cores),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cuda_device_order": os.environ.get("CUDA_DEVICE_ORDER"),
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
        for i, (entry, h) in enumerate(visible_devices(pynvml, os.environ.get("CUDA_VISIBLE_DEVICES"))):
            name = pynvml.nvmlDeviceGetName(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            info["devices"].append(
                {
                    "index": i,  # as CUDA numbers the visible devices
                    "visible_as": entry,
                    "name": name if isinstance(name, str) else name.decode(),
                    "memory_total": int(mem.total),
                    "memory_free": int(mem.free),
                }
            )
        info["nvml"] = "ok"
        if len(info["devices"]) > 1 and info["cuda_device_order"] != "PCI_BUS_ID":
            log.warning("CUDA_DEVICE_ORDER is %s, not PCI_BUS_ID: CUDA may number these %d GPUs in another order than "
                        "NVML does, and device i of the plan may not be torch's cuda:i", info["cuda_device_order"] or "unset",
                        len(info["devices"]))  # fmt: skip
    finally:
        pynvml.nvmlShutdown()
    return info


def visible_devices(nvml, visible: str | None) -> list[tuple[str, object]]:
    """The NVML handles of the devices CUDA makes visible, in CUDA's order, each with
    the ``CUDA_VISIBLE_DEVICES`` entry that named it.

    CUDA's rules: entries are indices, GPU UUIDs (``GPU-<uuid>``, or any prefix of one
    that names a single GPU) or MIG instance UUIDs (``MIG-<uuid>``); the list ends at
    the first entry that names no device (an unknown index, an ambiguous or unknown
    UUID, anything else) and a device named twice ends it too. Unset: every GPU.
    """
    count = nvml.nvmlDeviceGetCount()
    if visible is None:
        return [(str(i), nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]

    def uuid(h) -> str:
        u = nvml.nvmlDeviceGetUUID(h)
        return u if isinstance(u, str) else u.decode()

    gpus = [(uuid(h), h) for h in (nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count))]
    out, seen = [], set()
    for entry in (e.strip() for e in visible.split(",")):
        handle, key = None, None
        if entry.isdigit() and int(entry) < count:
            key, handle = gpus[int(entry)]
        elif entry.startswith("GPU-"):
            found = [(u, h) for u, h in gpus if u.startswith(entry)]
            if len(found) == 1:
                key, handle = found[0]
        elif entry.startswith("MIG-"):
            try:
                handle, key = nvml.nvmlDeviceGetHandleByUUID(entry), entry
            except nvml.NVMLError:
                handle = None
        if handle is None or key in seen:
            break  # CUDA stops at the first entry it cannot use
        seen.add(key)
        out.append((entry, handle))
    return out


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
