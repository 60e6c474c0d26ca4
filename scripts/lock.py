#!/usr/bin/env python
"""Write ``requirements.lock`` from the environment this Python runs in.

Run by ``make lock`` with the Python of a fresh virtualenv into which ampflow (``-e
".[test]"``) and one torch were just installed from pyproject.toml's bounds. The lock is
that environment's ``pip freeze``, narrowed to what ampflow needs:

* the packages reachable from ampflow's requirements and its ``test`` extra (markers
  evaluated here), so nothing installed by hand is locked;
* without torch's platform-only requirements (its CUDA runtime: ``nvidia-*``, ``cuda-*``,
  ``triton``): which torch build an install gets depends on the package index, and each
  build brings its own runtime at the versions it pins, so locking one build's runtime
  would force it onto a CPU install;
* torch's version without its build label (``2.13.0+cpu`` -> ``2.13.0``): ``==2.13.0`` is
  met by every build of that release, so the lock serves CPU and CUDA builds alike;
* setuptools included (torch requires it at run time), pip left out (the installer: the
  Makefile upgrades it before installing the lock).

    python scripts/lock.py requirements.lock
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = "ampflow"
ROOT_EXTRAS = ("test",)
# marker variables that make a requirement hold only on some platforms
PLATFORM_MARKERS = ("platform_system", "sys_platform", "platform_machine", "os_name")

HEADER = """\
# The exact versions that `make install` installs (and so `make demo`, `make test`,
# `make lint` and CI's .ci/run), before ampflow itself with --no-deps: nothing newer comes in.
# Written by `make lock` (scripts/lock.py): a fresh virtualenv of pyproject.toml's newest
# releases within its bounds (torch kept at this file's version unless TORCH names another),
# frozen. Do not edit by hand; tests/test_lock.py holds this file, pyproject.toml and
# envs/*.yaml (the conda environments of the workflow's rules) to the same versions.
#
# torch is pinned without its build label (+cpu, +cu126): `torch==X.Y.Z` is met by every
# build of that release. Where pip is configured with a labelled build (a +cpu wheel in
# find-links or an extra index, as on CI) it takes that one, ranking X.Y.Z+cpu above X.Y.Z;
# otherwise the index's plain wheel (on Linux a CUDA build). A torch of that release already
# in the virtualenv is kept, CPU or CUDA. `make install TORCH="<requirement>"` installs that
# torch in place of this file's line. torch's platform-only requirements (its CUDA runtime:
# nvidia-*, cuda-*, triton) are not listed: each build brings the versions it pins, and
# listing one build's would force them onto CPU installs.
"""


def freeze() -> list[str]:
    """``pip freeze`` of this environment: every distribution (setuptools too), no editables."""
    out = subprocess.run([sys.executable, "-m", "pip", "freeze", "--all", "--exclude-editable"], capture_output=True, text=True, check=True).stdout
    return [ln for ln in out.splitlines() if ln.strip() and not ln.startswith("#")]


def requirements(dist: metadata.Distribution, extras: set[str]) -> list[Requirement]:
    """``dist``'s requirements that hold here with ``extras`` requested, torch's platform-only ones left out."""
    kept = []
    for spec in dist.requires or []:
        req = Requirement(spec)
        if req.marker is not None:
            if not any(req.marker.evaluate({"extra": extra}) for extra in extras | {""}):
                continue
            if canonicalize_name(dist.metadata["Name"]) == "torch" and any(var in str(req.marker) for var in PLATFORM_MARKERS):
                continue
        kept.append(req)
    return kept


def needed() -> dict[str, str]:
    """Canonical name -> installed version of every distribution ampflow[test] reaches."""
    found: dict[str, str] = {}
    todo: list[tuple[str, set[str]]] = [(ROOT, set(ROOT_EXTRAS))]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, extras = todo.pop()
        key = (canonicalize_name(name), frozenset(extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"lock: {name} is required but not installed in {sys.prefix}") from None
        if key[0] != ROOT:
            found[key[0]] = dist.version
        for req in requirements(dist, extras):
            todo.append((req.name, set(req.extras)))
    return found


def lock_lines(frozen: list[str], keep: dict[str, str]) -> tuple[list[str], list[str]]:
    """The frozen lines of the packages in ``keep`` (build labels dropped), and the names left out."""
    lines, dropped = [], []
    for ln in frozen:
        if "==" not in ln or " @ " in ln:
            raise SystemExit(f"lock: pip freeze gave {ln!r}, not name==version: install that package from an index")
        name, version = ln.split("==", 1)
        if canonicalize_name(name) not in keep:
            dropped.append(name)
            continue
        lines.append(f"{name}=={version.split('+', 1)[0]}")
    missing = set(keep) - {canonicalize_name(ln.split("==", 1)[0]) for ln in lines}
    if missing:
        raise SystemExit(f"lock: required but absent from pip freeze: {', '.join(sorted(missing))}")
    # pip freeze's order (by name), so that the lock and a freeze diff line by line
    return sorted(lines, key=lambda ln: ln.split("==", 1)[0].lower()), dropped


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the lock file to write (requirements.lock)")
    args = ap.parse_args(argv)
    lines, dropped = lock_lines(freeze(), needed())
    where = f"# Resolved with Python {platform.python_version()} on {platform.system()} {platform.machine()}.\n"
    text = HEADER + where + "\n".join(lines) + "\n"
    fd, tmp = tempfile.mkstemp(dir=args.out.resolve().parent, prefix=f".{args.out.name}.")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, args.out)
    print(f"lock: {len(lines)} packages written to {args.out}; left out: {', '.join(dropped) or 'none'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
