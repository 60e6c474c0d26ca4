"""The package's import layers (scripts/import_layers.py): the tree as it is has no circle,
no arrow back up and a foundation that imports nothing of ampflow; a planted upward
import, a circle and a foundation import are each found (the script is run on a copy)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _run(repo: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(repo / "scripts/import_layers.py"), "--check"], capture_output=True, text=True, cwd=repo)


def test_the_tree_keeps_its_layers():
    r = _run(REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "circles between nodes: 0" in r.stdout and "circles between modules of one node: 0" in r.stdout, r.stdout
    assert "arrows back up (against the layers in pyproject.toml): 0" in r.stdout, r.stdout
    assert "the foundation (ampflow.base) imports of ampflow: nothing" in r.stdout, r.stdout
    floors = r.stdout.split("floors")[1].split("edges")[0]
    assert "0  ampflow.base" in floors and "ampflow.cli" in floors.splitlines()[1], floors


def _copy(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "src" / "ampflow", repo / "src" / "ampflow", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "scripts", repo / "scripts", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", repo / "pyproject.toml")
    return repo


def test_planted_violations_are_found(tmp_path):
    repo = _copy(tmp_path)
    # an import back up, inside a function (where the extraction circle used to hide)
    with open(repo / "src/ampflow/model/layers.py", "a") as fh:
        fh.write("\n\ndef _planted():\n    from ..train import trainer  # noqa: F401\n")
    # a circle between two modules of one package
    with open(repo / "src/ampflow/extract/checkpoint.py", "a") as fh:
        fh.write("\n\ndef _planted():\n    from .weights import load_model  # noqa: F401\n")
    # the foundation importing the contract
    with open(repo / "src/ampflow/base/jit.py", "a") as fh:
        fh.write("\nfrom ..contract import plan  # noqa: E402, F401\n")
    r = _run(repo)
    assert r.returncode == 1, r.stdout
    assert "ampflow.model -> ampflow.train" in r.stdout, r.stdout
    # model -> train -> parallel -> model, and base -> contract -> base
    assert "circles between nodes: 2" in r.stdout and "ampflow.base <-> ampflow.contract" in r.stdout, r.stdout
    assert "ampflow.extract.checkpoint <-> " in r.stdout or "<-> ampflow.extract.checkpoint" in r.stdout, r.stdout
    assert "the foundation (ampflow.base) imports of ampflow: ampflow.contract" in r.stdout, r.stdout
