"""Make every Python process of a test (torchrun's children included) report ``n`` CUDA
GPUs: a ``sitecustomize.py`` in a folder put first on PYTHONPATH, active only where
AMPFLOW_FAKE_CUDA_GPUS is set. It patches ``torch.cuda.is_available`` and
``torch.cuda.device_count`` the moment ``torch`` is imported (an import hook: importing
torch eagerly would slow every process, Snakemake's included). Nothing else of CUDA is
faked, so code that really touched a GPU (a CUDA tensor, an RNG state) would fail: a run
meant to leave the GPUs alone must not.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "AMPFLOW_FAKE_CUDA_GPUS"

SITECUSTOMIZE = f"""\
import os
import sys

_N = os.environ.get({ENV!r})
if _N is not None:
    import importlib.abc
    import importlib.util

    _N = int(_N)

    def _patch(torch):
        torch.cuda.is_available = lambda: _N > 0
        torch.cuda.device_count = lambda: _N

    class _FakeCudaFinder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != "torch":
                return None
            sys.meta_path.remove(self)  # find the real torch, once
            spec = importlib.util.find_spec("torch")
            if spec is None or spec.loader is None:
                return spec
            real = spec.loader.exec_module

            def exec_module(module):
                real(module)
                _patch(module)

            spec.loader.exec_module = exec_module
            return spec

    if "torch" in sys.modules:
        _patch(sys.modules["torch"])
    else:
        sys.meta_path.insert(0, _FakeCudaFinder())
"""


def fake_cuda_env(folder: Path, gpus: int, env: dict | None = None) -> dict:
    """An environment in which every Python process sees ``gpus`` CUDA GPUs (torch's
    view; NVML, and so ``ampflow devices``, still sees the real ones)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([str(folder), *filter(None, [env.get("PYTHONPATH")])])
    env[ENV] = str(int(gpus))
    return env
