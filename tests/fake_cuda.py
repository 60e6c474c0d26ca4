"""Make every Python process of a test (torchrun's children included) report ``n`` CUDA
GPUs: a ``sitecustomize.py`` in a folder put first on PYTHONPATH, active only where
AMPFLOW_FAKE_CUDA_GPUS is set. It patches ``torch.cuda.is_available`` and
``torch.cuda.device_count`` the moment ``torch`` is imported (an import hook: importing
torch eagerly would slow every process, Snakemake's included). Nothing else of CUDA is
faked, so code that really touched a GPU (a CUDA tensor, an RNG state) would fail: a run
meant to leave the GPUs alone must not.
"""

from __future__ import annotations

from pathlib import Path

from process_doubles import after_import, process_env

ENV = "AMPFLOW_FAKE_CUDA_GPUS"


def install(value: str) -> None:
    """In this process: torch reports ``int(value)`` CUDA GPUs, from its import on."""
    n = int(value)

    def patch(torch):
        torch.cuda.is_available = lambda: n > 0
        torch.cuda.device_count = lambda: n

    after_import("torch", patch)


def fake_cuda_env(folder: Path, gpus: int, env: dict | None = None) -> dict:
    """An environment in which every Python process sees ``gpus`` CUDA GPUs (torch's
    view; NVML, and so ``ampflow devices``, still sees the real ones)."""
    return process_env(folder, env, **{ENV: int(gpus)})
