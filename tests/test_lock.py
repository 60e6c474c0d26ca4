"""requirements.lock, pyproject.toml and envs/*.yaml name the same versions.

The lock (written by ``make lock``, installed by ``make install`` and so by CI) is the
referee between the files: every requirement of pyproject.toml (its runtime dependencies
and its ``test`` extra) is locked at a version inside pyproject's bounds, and every package
a conda environment of the workflow lists is pinned there to the lock's version, under
conda-forge's name for it. The environment the tests run in is checked against the lock
too: it is what ``make install`` made of it.
"""

from __future__ import annotations

import re

import pytest
import tomllib
import yaml
from conftest import REPO, load_script
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

LOCK = REPO / "requirements.lock"
ENV_FILES = sorted((REPO / "envs").glob("*.yaml"))
# conda-forge's names of the packages whose PyPI (and so the lock's) names differ
CONDA_TO_PYPI = {"pytorch": "torch", "python-isal": "isal", "python-igraph": "igraph"}
# platform-only requirements of torch's CUDA wheels: each build brings its own (scripts/lock.py)
CUDA_RUNTIME = re.compile(r"^(nvidia-.*|cuda-.*|triton)$")
CONDA_PIN = re.compile(r"^([A-Za-z0-9_.-]+)=([0-9][A-Za-z0-9_.!+-]*)$")


def parse_lock(text: str, source: str = "requirements.lock") -> dict[str, Version]:
    """Canonical name -> exact version; anything but ``name==version`` is an error naming the line."""
    pins: dict[str, Version] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        if req.marker or req.extras or req.url or len(specs) != 1 or specs[0].operator != "==" or "*" in specs[0].version:
            raise AssertionError(f"{source} line {number}: {line!r} is not an exact pin name==version")
        name = canonicalize_name(req.name)
        if name in pins:
            raise AssertionError(f"{source} line {number}: {req.name} pinned twice")
        pins[name] = Version(specs[0].version)
    return pins


def lock_python(text: str) -> Version:
    """The Python the lock was resolved with, from its header (scripts/lock.py writes it)."""
    m = re.search(r"^# Resolved with Python (\d+\.\d+\.\d+) ", text, re.M)
    assert m, "requirements.lock: no '# Resolved with Python X.Y.Z' line in its header (make lock writes it)"
    return Version(m.group(1))


def env_mismatches(env: dict, lock: dict[str, Version], python: Version, source: str) -> list[str]:
    """What in a conda environment (its parsed yaml) differs from the lock, one message each."""
    problems, pip_lines = [], None
    for dep in env.get("dependencies") or []:
        if isinstance(dep, dict):
            pip_lines = dep.get("pip")
            continue
        if dep == "pip":  # the installer, as the Makefile leaves it (not in the lock)
            continue
        m = CONDA_PIN.match(dep)
        if not m:
            problems.append(f"{source}: {dep!r} is not pinned as name=version")
            continue
        name, version = m.group(1), Version(m.group(2))
        if name == "python":
            if version != Version(f"{python.major}.{python.minor}"):
                problems.append(f"{source}: python={version}, the lock was resolved with Python {python}")
            continue
        pypi = canonicalize_name(CONDA_TO_PYPI.get(name, name))
        if pypi not in lock:
            problems.append(f"{source}: {name} ({pypi} on PyPI) is not in requirements.lock")
        elif version != lock[pypi]:
            problems.append(f"{source}: {name}={version}, requirements.lock has {pypi}=={lock[pypi]}")
    if pip_lines is None or "-c ../requirements.lock" not in pip_lines:
        problems.append(f"{source}: its pip section does not constrain the package's install with -c ../requirements.lock")
    return problems


@pytest.fixture(scope="module")
def lock_text() -> str:
    return LOCK.read_text()


@pytest.fixture(scope="module")
def lock(lock_text) -> dict[str, Version]:
    return parse_lock(lock_text)


@pytest.fixture(scope="module")
def project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_lock_is_exact_pins_without_build_labels_or_cuda_runtime(lock, project):
    assert len(lock) > 50, f"requirements.lock pins only {len(lock)} packages: the transitive dependencies are missing"
    labelled = {name: v for name, v in lock.items() if v.local}
    assert not labelled, f"requirements.lock: build labels (+cpu, +cuXXX) pin one build: {labelled}"
    direct = {canonicalize_name(Requirement(r).name) for r in project["dependencies"]}
    cuda = sorted(name for name in lock if CUDA_RUNTIME.match(name) and name not in direct)
    assert not cuda, f"requirements.lock: {cuda} belong to one torch build and would force CUDA wheels onto CPU installs"
    assert "pip" not in lock, "requirements.lock pins pip, which the Makefile upgrades before installing the lock"


@pytest.mark.parametrize("group", ["dependencies", "test"])
def test_pyproject_requirements_are_locked_within_their_bounds(lock, project, group):
    reqs = project["dependencies"] if group == "dependencies" else project["optional-dependencies"][group]
    assert reqs
    for spec in reqs:
        req = Requirement(spec)
        name = canonicalize_name(req.name)
        assert name in lock, f"pyproject.toml {group}: {req.name} is not in requirements.lock (run make lock)"
        assert req.specifier.contains(lock[name], prereleases=True), f"pyproject.toml {group}: {spec!r}, requirements.lock has {name}=={lock[name]}"


def test_lock_python_meets_requires_python(lock_text, project):
    python = lock_python(lock_text)
    assert SpecifierSet(project["requires-python"]).contains(python), f"requirements.lock was resolved with Python {python}: {project['requires-python']}"


@pytest.mark.parametrize("env_file", ENV_FILES, ids=lambda p: p.name)
def test_env_file_pins_the_lock(env_file, lock, lock_text):
    env = yaml.safe_load(env_file.read_text())
    assert env.get("dependencies"), f"{env_file.name}: no dependencies"
    assert env_mismatches(env, lock, lock_python(lock_text), env_file.name) == []
    # conda runs the pip section beside the env file: the constraint's path is the lock
    assert (env_file.parent / "../requirements.lock").resolve() == LOCK.resolve()


def test_env_check_names_each_mismatch(lock, lock_text):
    """A control for the check above: an env file off the lock in every way it can be."""
    off = str(lock["torch"]) + ".1"
    bad = {
        "dependencies": [
            "python=3.9",
            "pip",
            f"pytorch={off}",
            "numpy>=1.24",
            "not-a-locked-package=1.0",
            {"pip": ["-e ../"]},
        ]
    }
    problems = env_mismatches(bad, lock, lock_python(lock_text), "bad.yaml")
    assert len(problems) == 5, problems
    assert any("python=3.9" in p for p in problems)
    assert any(f"pytorch={off}" in p and f"torch=={lock['torch']}" in p for p in problems)
    assert any("'numpy>=1.24' is not pinned" in p for p in problems)
    assert any("not-a-locked-package" in p and "not in requirements.lock" in p for p in problems)
    assert any("-c ../requirements.lock" in p for p in problems)


def test_parse_lock_rejects_loose_lines():
    assert parse_lock("# header\nNumPy==2.4.6\nsome_pkg==1.0\n") == {"numpy": Version("2.4.6"), "some-pkg": Version("1.0")}
    for text in ("numpy>=2\n", "numpy==2.*\n", "numpy==2.4.6; sys_platform == 'linux'\n", "numpy==1\nnumpy==2\n"):
        with pytest.raises(AssertionError, match="requirements.lock line"):
            parse_lock(text)


def test_lock_script_keeps_what_is_needed_and_drops_build_labels():
    lock_script = load_script("lock")
    frozen = ["Jinja2==3.1.6", "pip==26.3", "torch==2.13.0+cpu", "nvidia-nccl-cu13==2.29.7", "stray==1.0"]
    keep = {"jinja2": "3.1.6", "torch": "2.13.0+cpu"}
    assert lock_script.lock_lines(frozen, keep) == (["Jinja2==3.1.6", "torch==2.13.0"], ["pip", "nvidia-nccl-cu13", "stray"])
    with pytest.raises(SystemExit, match="absent from pip freeze: sympy"):
        lock_script.lock_lines(frozen, {**keep, "sympy": "1.14.0"})
    with pytest.raises(SystemExit, match="not name==version"):
        lock_script.lock_lines(["ampflow @ file:///src"], keep)


def test_installed_environment_is_the_lock(lock):
    """The packages the tests run with are the lock's (``make install``), and the lock is
    what ``make lock`` would write from them: nothing of ampflow[test]'s dependency tree is
    missing from the lock, nothing in it is unused. torch's release is left out of the
    comparison: ``make install TORCH=...`` may install another on purpose."""
    needed = load_script("lock").needed()
    assert set(needed) == set(lock), (
        f"ampflow[test] here needs, beyond the lock: {sorted(set(needed) - set(lock))}; "
        f"the lock holds, unneeded here: {sorted(set(lock) - set(needed))} (make lock, or make install)"
    )
    differ = {name: (needed[name], str(lock[name])) for name in lock if name != "torch" and Version(needed[name]) != lock[name]}
    assert not differ, f"installed (left) versions differ from requirements.lock's (right): {differ}; make install installs the lock"
