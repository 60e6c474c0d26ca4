"""Test doubles in processes a test starts (``ampflow`` commands, torchrun's ranks,
Snakemake and its jobs): one ``sitecustomize.py``, put first on PYTHONPATH by
:func:`process_env`, installs in every Python process the doubles the environment names.

Each double is a module of this folder with an ``install(value)`` function, named here
with the environment variable that turns it on (:data:`DOUBLES`). The sitecustomize loads
a double's module by its path (the tests' folder is not put on the child's ``sys.path``)
only where its variable is set, so a process without doubles runs as it would. A double
patches a module the moment it is first imported (:func:`after_import`), so a process that
never imports it (Snakemake, for a torch double) does not pay for the import.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: environment variable -> the module (in this folder) whose ``install(value)`` it calls
DOUBLES = {
    "AMPFLOW_FAKE_CUDA_GPUS": "fake_cuda",
    "AMPFLOW_TEST_EXTRACT_DOUBLES": "extract_doubles",
    "AMPFLOW_TEST_STOP_AFTER": "trainer_doubles",
}

SITECUSTOMIZE = f"""\
import os

_DOUBLES = {DOUBLES!r}
if any(os.environ.get(v) is not None for v in _DOUBLES):
    import importlib.util
    import sys

    def _load(name):
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, os.path.join({str(HERE)!r}, name + ".py"))
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        return sys.modules[name]

    _load("process_doubles")
    for _var, _name in _DOUBLES.items():
        if os.environ.get(_var) is not None:
            _load(_name).install(os.environ[_var])
"""


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs the patches registered for a module right after it is executed (the first
    time it is imported); finds no module itself."""

    def __init__(self):
        self.patches: dict[str, list[Callable]] = {}

    def find_spec(self, name, path=None, target=None):
        todo = self.patches.pop(name, None)
        if todo is None:
            return None
        spec = next((s for f in sys.meta_path if f is not self and (s := f.find_spec(name, path, target)) is not None), None)
        if spec is None or spec.loader is None:
            return spec
        real = spec.loader.exec_module

        def exec_module(module):
            real(module)
            for patch in todo:
                patch(module)

        spec.loader.exec_module = exec_module
        return spec


_FINDER = _AfterImport()


def after_import(module: str, patch: Callable) -> None:
    """``patch(module)`` now where ``module`` is imported already, else the moment it is."""
    if module in sys.modules:
        patch(sys.modules[module])
        return
    _FINDER.patches.setdefault(module, []).append(patch)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def process_env(folder: Path, env: dict | None = None, **values) -> dict:
    """An environment (``env``, or this process's) in which every Python process has the
    doubles given as ``VARIABLE=value`` (keys of :data:`DOUBLES`, added to those ``env``
    sets already); the ``sitecustomize.py`` is written into ``folder``."""
    unknown = set(values) - set(DOUBLES)
    if unknown:
        raise ValueError(f"no such double: {sorted(unknown)}; known: {sorted(DOUBLES)}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ if env is None else env)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(folder)]
    env["PYTHONPATH"] = os.pathsep.join([str(folder), *paths])
    env.update({k: str(v) for k, v in values.items()})
    return env
