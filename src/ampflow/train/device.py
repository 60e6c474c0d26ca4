"""Where a training run computes and how that device is set up: the plan's device (or
``train.device``'s), the devices this node gives its processes, and the deterministic
mode (``train.deterministic``). Used by the launcher before torchrun starts anything and by
the trainer in each process."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..base.errors import InputError
from ..contract.config import TrainConfig
from ..contract.plan import Plan


def local_device_count(cuda: bool) -> int:
    """Devices this node gives the run's processes: the GPUs CUDA sees (honouring
    CUDA_VISIBLE_DEVICES), or the CPU cores this process may run on."""
    if cuda:
        return torch.cuda.device_count()
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def uses_cuda(device: str) -> bool:
    """Whether ``train.device`` = ``device`` trains on CUDA here."""
    if device == "auto":
        return torch.cuda.is_available()
    return device == "cuda"


def run_device(train: TrainConfig, plan: Plan | None) -> tuple[str, str]:
    """The device this run trains on (``"cpu"`` or ``"cuda"``) and what decided it.

    A plan that records its device (version 4 on) decides: its budget, its CPU threads
    and the job's allocation were made for that device. A plan for ``cuda`` where no GPU
    is visible is refused (an InputError naming the plan's file, the device and the
    fixes) instead of training on CPU cores what was planned for GPUs. Without a plan,
    or with one that records no device, ``train.device`` decides as it always did
    (``auto``: CUDA when a GPU is visible).
    """
    if plan is not None and plan.device:
        if plan.device == "cuda":
            if not torch.cuda.is_available():
                raise InputError(
                    f"the plan trains on cuda (one process per GPU) but no CUDA GPU is visible here "
                    f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!s}, torch CUDA build "
                    f"{torch.version.cuda or 'none'}); run it where the GPUs it was planned for are, or plan again for CPU "
                    f"cores with train.device: cpu (Snakemake re-runs the diagnose rule when the config changes)",
                    path=plan.source, key="device", value=plan.device,
                )  # fmt: skip
        return plan.device, f"{Path(plan.source).name}'s device"
    return ("cuda" if uses_cuda(train.device) else "cpu"), f"train.device {train.device}"


#: The cuBLAS workspace setting under which PyTorch's cuBLAS calls are deterministic
#: (its documentation's ``:4096:8``; 32 MiB per handle, what plans budget on any GPU).
DETERMINISTIC_CUBLAS = ":4096:8"


def use_deterministic(on: bool, cuda: bool, env=None) -> str:
    """Switch the run to deterministic kernels (``train.deterministic``) and say how.

    Turns on ``torch.use_deterministic_algorithms`` with ``warn_only`` (an operation with
    no deterministic kernel warns, once, instead of stopping a training run) and, on CUDA,
    sets ``CUBLAS_WORKSPACE_CONFIG`` in ``env`` (default ``os.environ``) where unset,
    before the run's first cuBLAS call. On CPU the model's own gathers are deterministic
    either way (``index_select``, whose backward adds in index order); the switch is the
    safety net that makes any CPU ``index_put_(accumulate=True)``, which adds with
    atomics across threads, run serially. Process-wide, as torch's switch is: the
    trainer's process trains one model."""
    if not on:
        torch.use_deterministic_algorithms(False)
        if cuda:
            return "train.deterministic is false: CUDA's atomic index_add_/scatter sums may differ from run to run"
        return "train.deterministic is false: the model's CPU kernels still repeat for a thread count; torch's switch is off"
    torch.use_deterministic_algorithms(True, warn_only=True)
    if not cuda:
        return "deterministic algorithms on (train.deterministic): a run repeats bit for bit for a given thread count"
    env = os.environ if env is None else env
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", DETERMINISTIC_CUBLAS)
    return f"deterministic algorithms on, CUBLAS_WORKSPACE_CONFIG={env['CUBLAS_WORKSPACE_CONFIG']} (train.deterministic)"
