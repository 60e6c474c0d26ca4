"""Shared fixtures: repo paths, the shared real-data folder, a small demo dataset."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# the benchmarks' helpers the tests share (scripts/ is no package): synthetic_shapes, ...
sys.path.insert(1, str(REPO / "scripts"))


#: Session fixtures too costly to build once per worker: their tests form one group.
SHARED_RUNS = ("readme_run",)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`make test` runs ``-n 2 --dist loadgroup``) every test module
    runs in one worker, so that its module-scoped workflow run is built once, and the
    tests of a costly session fixture (the README's commands, ``make demo`` included) run
    in one worker together."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        shared = next((f for f in SHARED_RUNS if f in getattr(item, "fixturenames", ())), None)
        item.add_marker(pytest.mark.xdist_group(shared or item.path.name))


def pytest_report_header(config):
    """The free space where the tests write: the full run needs a few gigabytes, and a run
    on a nearly full disk fails with ``No space left on device`` far from its cause."""
    import tempfile

    where = Path(tempfile.gettempdir())
    free = shutil.disk_usage(where).free
    return f"disk: {free / 1e9:.1f} GB free under {where}"


def load_script(name: str):
    """``scripts/<name>.py`` as a module (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


def shared_data_dir() -> Path | None:
    env = os.environ.get("AMPFLOW_SHARED_DATA")
    for cand in ([Path(env)] if env else []) + [REPO.parent / "shared" / "data"]:
        if cand.is_dir():
            return cand
    return None


@pytest.fixture(scope="module", autouse=True)
def keep_torch_threads():
    """The trainer sets torch's thread count for the process; every test module gets
    the count it started with back (float32 sums elsewhere round by it)."""
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture
def figures(monkeypatch):
    """Every matplotlib Figure saved during the test, in order."""
    from matplotlib.figure import Figure

    saved: list = []
    original = Figure.savefig

    def record(self, *args, **kwargs):
        saved.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    return saved


@pytest.fixture(scope="session")
def shared_data() -> Path:
    d = shared_data_dir()
    if d is None:
        pytest.skip("shared real-data folder not present")
    return d


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory) -> Path:
    """A 16-cell demo dataset, written once per test session."""
    from ampflow.demo import write_demo

    out = tmp_path_factory.mktemp("demo") / "resources" / "demo"
    write_demo(out, n_cells=16, seed=0)
    return out


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real one-node SLURM on this machine (tests/slurm/start_cluster.sh: root; installs
    slurm-wlm where it is missing); the test is skipped, saying why, where it cannot start."""
    from slurm_cluster import ClusterUnavailable, start_cluster

    try:
        return start_cluster()
    except ClusterUnavailable as e:
        pytest.skip(f"no SLURM cluster: {e}")


def workflow_copy(dest: Path) -> Path:
    """Copy what `snakemake` needs (workflow/, config/, profiles/, envs/) into ``dest``."""
    for name in ("workflow", "config", "profiles", "envs"):
        shutil.copytree(REPO / name, dest / name, dirs_exist_ok=True)
    return dest


@pytest.fixture(scope="session")
def readme_run(tmp_path_factory):
    """README.md's runnable commands (``make demo`` first) run once in a fresh copy of
    the repository: ``(copy, completed process, blocks)``. The report tests look at the
    report this run wrote (results/demo/report.zip)."""
    from readme_commands import in_venv, run_readme

    if not in_venv():
        pytest.skip("the README's commands need the tests to run in a virtual environment (as `make test` does)")
    dest = tmp_path_factory.mktemp("readme") / "ampflow"
    dest.mkdir()
    proc, blocks = run_readme(REPO, dest)
    return dest, proc, blocks
