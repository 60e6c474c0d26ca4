"""What a CUDA device holds beyond the memory model's tensors, and the plan's budget.

The memory model (:func:`ampflow.amp.memory.predict.predict`) counts the bytes of the
tensors a training step holds: on CPU that is the allocator's peak (the profiler sums
the bytes asked for). On CUDA the trainer's ``peak_bytes`` is
``torch.cuda.max_memory_allocated()``, and the device holds more than that:

* **cuBLAS / cuBLASLt workspaces**, allocated through the caching allocator on the
  first matrix product of each (handle, stream) and kept for the life of the process:
  inside ``memory_allocated()`` and ``max_memory_allocated()``. Their size
  (:func:`cublas_workspace_bytes`, :func:`cublaslt_workspace_bytes`) follows
  ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE:COUNT`` pairs in KiB, summed) or the default of
  PyTorch's ``CublasHandlePool.cpp`` (32 MiB on sm90, H100/H200; ``:4096:2:16:8``,
  8 MiB + 128 KiB, elsewhere), plus cuBLASLt's own ``CUBLASLT_WORKSPACE_SIZE`` (KiB,
  default 1 MiB) unless ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=1`` makes it share
  cuBLAS's. A training step has at least two handles: the forward pass's thread and the
  autograd engine's device thread (each thread reserves its own handle), hence
  ``handles=2``. These defaults are read from PyTorch's sources and move between
  releases: the measured base is the authority.
* **block rounding**: every block is a multiple of 512 B (:data:`BLOCK`,
  :func:`round_block`), so ``allocated`` exceeds the bytes asked for by up to 511 B
  per live tensor; ``memory_stats()["requested_bytes.all.peak"]`` is free of it.
* **the cache and fragmentation** (``reserved - allocated``): segments the allocator
  keeps, and blocks split so that a free piece cannot serve the next request. An
  out-of-memory error follows ``reserved``, not ``allocated``.
* **the CUDA context** (kernels, the driver's own buffers, about 0.5 GiB) and NCCL's
  buffers: outside the allocator entirely.

Choice: the model stays a model of the tensors (its CPU tests keep holding it to the
CPU allocator), and the CUDA overheads are **measured apart** where they can be and
**budgeted** where they cannot. The trainer's CUDA rows carry ``base_bytes`` (allocated
when the step began) and ``held_bytes`` (the step's tensors among them), so
``peak_bytes - (base_bytes - held_bytes)`` is the step's allocated peak net of the
workspaces, to compare with the model; ``peak_requested_bytes`` is the same without the
rounding. The plan's budget (:func:`plan_budget`) takes the context, the workspaces
(:func:`cuda_overheads`) and a fragmentation allowance off the device's memory before
the predicted peak is compared with it. Rounding is a bound there, not a term:
:data:`LIVE_TENSORS` blocks of up to 511 B each.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ...base.errors import InputError

log = logging.getLogger(__name__)

MIB = 2**20
#: The caching allocator's block granularity (``kMinBlockSize``): every allocation is
#: rounded up to a multiple of it.
BLOCK = 512
#: The cuBLAS workspace PyTorch allocates when ``CUBLAS_WORKSPACE_CONFIG`` is unset:
#: 32 MiB on compute capability 9.0 (Hopper), ``:4096:2:16:8`` elsewhere.
CUBLAS_DEFAULT_SM90 = 4096 * 8 * 1024
CUBLAS_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8
#: cuBLASLt's workspace when ``CUBLASLT_WORKSPACE_SIZE`` (KiB) is unset.
CUBLASLT_DEFAULT = 1024 * 1024
#: (handle, stream) pairs of a training step: the caller's thread and the autograd
#: engine's device thread.
HANDLES = 2
#: The CUDA context and the driver's buffers, outside the allocator (about 0.5 GiB on
#: H100 with CUDA 12; lazy module loading keeps it near that).
CONTEXT_BYTES = 512 * MIB
#: ``reserved / allocated - 1`` allowed at the peak: the allocator's cache and
#: fragmentation. A planning assumption, to be replaced by what ``make gpu-check``
#: measures (its ``peak_reserved_bytes`` against ``peak_bytes``).
FRAGMENTATION = 0.10
#: Live tensors at a step's peak for the rounding bound (each up to 511 B over).
LIVE_TENSORS = 4096
#: The capability assumed when none is known and no GPU is visible: the one with the
#: largest default workspace (sm90).
DEFAULT_CAPABILITY = (9, 0)

_PAIRS = re.compile(r":([0-9]+):([0-9]+)")
_TRUE = {"1", "true", "yes", "on", "y"}


def round_block(nbytes: int) -> int:
    """Bytes the caching allocator takes for a request of ``nbytes`` (a multiple of
    :data:`BLOCK`; 0 stays 0)."""
    n = int(nbytes)
    if n < 0:
        raise InputError("must be >= 0", key="nbytes", value=nbytes)
    return -(-n // BLOCK) * BLOCK


def _capability(capability) -> tuple[int, int]:
    if capability is None:
        try:
            import torch

            if torch.cuda.is_available():
                return tuple(torch.cuda.get_device_capability())
        except Exception:  # pragma: no cover - a broken driver: plan as for sm90
            pass
        return DEFAULT_CAPABILITY
    try:
        major, minor = (int(x) for x in capability)
    except (TypeError, ValueError):
        raise InputError("must be (major, minor)", key="capability", value=capability) from None
    if major < 1 or minor < 0:
        raise InputError("must be (major >= 1, minor >= 0)", key="capability", value=capability)
    return major, minor


def cublas_workspace_bytes(capability=None, env: Mapping[str, str] | None = None) -> int:
    """One cuBLAS handle's workspace, as PyTorch chooses it.

    ``CUBLAS_WORKSPACE_CONFIG`` holds ``:SIZE:COUNT`` pairs (SIZE in KiB); the
    workspace is the sum of ``SIZE * 1024 * COUNT`` over them (``:4096:8`` is 32 MiB,
    ``:16:8`` 128 KiB). Unset, or without a pair PyTorch can parse (it warns and
    falls back), it is the default of the device's compute capability
    (``capability``: ``(major, minor)``; default the current GPU's, else sm90).
    """
    env = os.environ if env is None else env
    cap = _capability(capability)
    default = CUBLAS_DEFAULT_SM90 if cap == (9, 0) else CUBLAS_DEFAULT
    val = env.get("CUBLAS_WORKSPACE_CONFIG")
    if val is None:
        return default
    pairs = _PAIRS.findall(val)
    if not pairs:
        log.warning("CUBLAS_WORKSPACE_CONFIG=%r has no :SIZE:COUNT pair: PyTorch uses its default, %d bytes", val, default)
        return default
    return sum(int(size) * 1024 * int(count) for size, count in pairs)


def cublaslt_workspace_bytes(capability=None, env: Mapping[str, str] | None = None) -> int:
    """cuBLASLt's own workspace per handle: ``CUBLASLT_WORKSPACE_SIZE`` KiB (default
    1 MiB; an unparsable value keeps the default), capped at the cuBLAS workspace
    unless ``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` is set false; 0 when it is set true
    (cuBLASLt then uses cuBLAS's workspace)."""
    env = os.environ if env is None else env
    unified = env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE")
    if unified is not None and unified.strip().lower() in _TRUE:
        return 0
    size = CUBLASLT_DEFAULT
    val = env.get("CUBLASLT_WORKSPACE_SIZE")
    if val is not None:
        try:
            size = int(val) * 1024
        except ValueError:
            log.warning("CUBLASLT_WORKSPACE_SIZE=%r is not a whole number of KiB: PyTorch uses %d bytes", val, size)
    if unified is None:  # the size is capped at cuBLAS's (PyTorch's unified default)
        size = min(size, cublas_workspace_bytes(capability, env))
    return size


@dataclass(frozen=True)
class CudaOverheads:
    """What one CUDA device holds beyond the model's tensors (bytes), and the
    fragmentation allowed on top of the allocated peak.

    Attributes
    ----------
    workspace_bytes : int
        cuBLAS + cuBLASLt workspaces of every handle (allocated: inside
        ``max_memory_allocated``).
    rounding_bytes : int
        Bound of the 512 B rounding of the live tensors (allocated).
    context_bytes : int
        CUDA context, outside the allocator.
    fragmentation : float
        ``reserved / allocated - 1`` allowed at the peak.
    """

    workspace_bytes: int
    rounding_bytes: int
    context_bytes: int
    fragmentation: float

    def allocated(self, predicted: int) -> int:
        """The allocated peak (``max_memory_allocated``) of a step whose tensors
        peak at ``predicted`` bytes, at most."""
        return int(predicted) + self.workspace_bytes + self.rounding_bytes

    def device_bytes(self, predicted: int) -> int:
        """Device memory such a step needs: its reserved peak and the context."""
        return math.ceil(self.allocated(predicted) * (1 + self.fragmentation)) + self.context_bytes


def cuda_overheads(capability=None, env: Mapping[str, str] | None = None, handles: int = HANDLES,
                   context_bytes: int = CONTEXT_BYTES, fragmentation: float = FRAGMENTATION,
                   live_tensors: int = LIVE_TENSORS) -> CudaOverheads:  # fmt: skip
    """The :class:`CudaOverheads` of a device of compute ``capability`` under the
    environment ``env`` (default ``os.environ``), with ``handles`` cuBLAS handles."""
    if handles < 1:
        raise InputError("must be >= 1", key="handles", value=handles)
    if context_bytes < 0:
        raise InputError("must be >= 0", key="context_bytes", value=context_bytes)
    if not 0 <= fragmentation < 1:
        raise InputError("must be in [0, 1)", key="fragmentation", value=fragmentation)
    if live_tensors < 0:
        raise InputError("must be >= 0", key="live_tensors", value=live_tensors)
    per_handle = cublas_workspace_bytes(capability, env) + cublaslt_workspace_bytes(capability, env)
    return CudaOverheads(handles * per_handle, live_tensors * (BLOCK - 1), int(context_bytes), float(fragmentation))


def plan_budget(device_memory: int, budget_fraction: float, device: str = "cuda", overheads: CudaOverheads | None = None) -> int:
    """Bytes the memory model's predicted peak may reach on one device.

    On CPU (``device == "cpu"``) ``floor(device_memory * budget_fraction)``, as before.
    On CUDA (``"cuda"`` or ``"auto"``) the context comes off the device's memory, the
    share ``budget_fraction`` of the rest is what the reserved peak may reach, the
    fragmentation allowance divides it into the allocated peak, and the workspaces
    and the rounding bound come off that (``overheads``: default
    :func:`cuda_overheads` of the current GPU or sm90):
    ``floor((device_memory - context) * budget_fraction / (1 + fragmentation)) -
    workspaces - rounding``, never below 0.
    """
    if device_memory <= 0:
        raise InputError("must be > 0", key="device_memory", value=device_memory)
    if not 0 < budget_fraction <= 1:
        raise InputError("must be in (0, 1]", key="budget_fraction", value=budget_fraction)
    if device not in ("cpu", "cuda", "auto"):
        raise InputError("must be auto, cpu or cuda", key="train.device", value=device)
    if device == "cpu":
        return math.floor(device_memory * budget_fraction)
    o = overheads or cuda_overheads()
    usable = max(int(device_memory) - o.context_bytes, 0)
    return max(math.floor(usable * budget_fraction / (1 + o.fragmentation)) - o.workspace_bytes - o.rounding_bytes, 0)
