"""CPU-sized runs: the torch threads per process and the host-memory check of the batch.

When training runs on CPU (``train.device: cpu``, or ``auto`` with no GPU in
``devices.json``), the plan says how many torch threads each process uses: the cores
the allocation gives (``devices.json``'s ``cpu.cores``) divided by the mesh's processes
(dp x tp), at least 1. An explicit integer ``train.threads`` wins, and the plan says so.
No process gets more threads than the cores it has: on a few shared cores a second
thread per process makes small operations wait for the slower thread.

The batch is checked, not changed (a batch size changes what the model learns): every
process on the host holds its predicted peak (which counts its data batch) and one
query block's transient attention scores; when the host's available memory (``cpu.memory_available_bytes``,
times the budget fraction) holds less than that, the plan says so and names the
largest batch that would fit.

Everything here is a pure function of its arguments, so a plan stays one of the
profile, ``devices.json`` and the calibration.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...base.progress import human_bytes
from ...contract.config import TrainConfig
from ...contract.plan_sections import CpuSection
from ...contract.profile import Profile, train_settings


def threads_per_process(cores: int, processes: int) -> int:
    """Torch threads of each of ``processes`` processes sharing ``cores`` cores: at least
    one, never more than a process's share."""
    return max(1, int(cores) // max(1, int(processes)))


def trains_on_cpu(device: str, host: dict | None) -> bool:
    """Whether a run with ``train.device`` = ``device`` trains on CPU, given the devices
    record (``devices.json``; an ``auto`` run trains on CPU when it lists no GPU)."""
    if device == "cpu":
        return True
    if device == "cuda":
        return False
    return not (host or {}).get("devices")


@dataclass(frozen=True)
class BatchNeed:
    """Host bytes a batch size needs over all processes: ``processes x (peak + scores)``."""

    batch_size: int
    need: int


def batch_need(profile: Profile, batch_size: int, processes: int, per_process) -> BatchNeed:
    """Bytes ``batch_size`` needs on the host; ``per_process(profile) -> bytes`` gives one
    process's (peak, transient scores and data batch for that profile)."""
    return BatchNeed(int(batch_size), int(processes) * int(per_process(profile.with_batch_size(batch_size))))


def largest_fitting_batch(profile: Profile, processes: int, per_process, available: int, upto: int) -> int | None:
    """The largest batch size in ``[2, upto]`` whose host bytes fit ``available`` (the
    bytes grow with the batch, so a bisection); None when not even 2 fits."""
    lo, hi = 2, int(upto)
    if batch_need(profile, lo, processes, per_process).need > available:
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if batch_need(profile, mid, processes, per_process).need <= available:
            lo = mid
        else:
            hi = mid - 1
    return lo


def cpu_plan(profile: Profile, train: TrainConfig, host: dict | None, processes: int, budget_fraction: float,
             per_process) -> tuple[CpuSection | None, list[str]]:  # fmt: skip
    """The plan's ``cpu`` section and its reasons; ``(None, [])`` when the run trains on a GPU.

    Parameters
    ----------
    profile : Profile
    train : TrainConfig
        ``device`` and ``threads`` (the batch size is the profile's).
    host : dict or None
        ``devices.json`` (:func:`ampflow.devices.probe_devices`): ``devices`` (GPUs) and
        ``cpu`` (:func:`host_cpu`).
    processes : int
        The mesh's dp x tp.
    budget_fraction : float
        Share of the host's available memory the check allows.
    per_process : callable
        ``per_process(profile) -> bytes`` one process holds at its peak with that
        profile's batch (predicted peak, which counts the data batch, and transient scores).
    """
    if not trains_on_cpu(train.device, host):
        return None, []
    cpu = (host or {}).get("cpu") or {}
    cores = cpu.get("cores")
    reasons = []
    explicit = train.explicit_threads
    figure = threads_per_process(cores, processes) if cores else None
    if explicit is not None:
        threads, source = explicit, "train.threads"
        if figure is None:
            reasons.append(f"cpu threads: {explicit} per process, as train.threads sets (devices.json records no cores to divide).")
        else:
            over = f"; {processes} x {explicit} threads exceed the {cores} cores, so processes will wait on each other" if processes * explicit > cores else ""
            reasons.append(f"cpu threads: {explicit} per process, as train.threads sets (an explicit integer wins); "
                           f"the plan's figure would be {cores} cores / {processes} process(es) -> {figure}{over}.")  # fmt: skip
    elif figure is not None:
        threads, source = figure, "plan"
        reasons.append(f"cpu: {cores} cores / {processes} process(es) -> {figure} thread(s) per process (train.threads: auto).")
    else:
        threads, source = 1, "default"
        reasons.append("cpu threads: 1 per process: train.threads is auto but devices.json records no cores.")
    section = {"cores": cores, "processes": int(processes), "threads": int(threads), "threads_source": source}

    batch = int(train_settings(profile).batch_size)
    available = cpu.get("memory_available_bytes")
    need = batch_need(profile, batch, processes, per_process).need
    section.update({"batch_size": batch, "host_need_bytes": need, "host_available_bytes": available, "host_fits": None, "largest_fitting_batch": None})
    if available:
        allowed = int(available * budget_fraction)
        fits = need <= allowed
        section.update({"host_budget_bytes": allowed, "host_fits": fits})
        head = (f"host memory: batch {batch} needs {human_bytes(need)} over {processes} process(es) (peak with its data "
                f"batch, and transient scores, each) against {human_bytes(allowed)} ({budget_fraction:g} of {human_bytes(available)} available)")  # fmt: skip
        if fits:
            reasons.append(head + ": fits.")
        else:
            best = largest_fitting_batch(profile, processes, per_process, allowed, batch)
            section["largest_fitting_batch"] = best
            if best is None:
                reasons.append(head + ": WARNING, does not fit, and no batch of 2 or more would; the batch size is left as configured.")
            else:
                reasons.append(head + f": WARNING, does not fit; train.batch_size {best} would (left as configured: "
                               "the batch size changes what the model learns).")  # fmt: skip
    else:
        reasons.append(f"host memory: not checked (devices.json records no available memory); batch {batch} needs {human_bytes(need)}.")
    return CpuSection(**section), reasons
