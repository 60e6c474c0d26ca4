"""The shell commands of README.md, run as written in a fresh copy of the repository.

Every fenced code block of the README has a language. ``bash`` blocks are run, in the
order they appear, as one script (so ``source .venv/bin/activate`` carries over), unless
the line before the block says why not::

    <!-- not run: needs a SLURM cluster -->

The copy gets every file git knows (tracked or not ignored) and, as ``.venv``, a link to
the environment the tests run in, with its install stamp newer than ``pyproject.toml``
and ``requirements.lock`` so that ``make`` uses it as it is instead of installing again.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SHELL = {"bash", "sh", "shell"}
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(.+?)\s*-->$")
FENCE = re.compile(r"^```(\S*)\s*$")
STAMP = ".ampflow-installed"  # the Makefile's install stamp inside the venv
MARK = "=== README block at line {line} ==="


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    language: str
    text: str
    skip: str | None  # why it is not run, from the marker; None = run it

    @property
    def runnable(self) -> bool:
        return self.language in SHELL and self.skip is None


def parse_blocks(markdown: str) -> list[Block]:
    """Fenced code blocks with their language and not-run reason."""
    lines = markdown.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, language = i, m.group(1)
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        if j == len(lines):
            raise ValueError(f"README line {start + 1}: code block never closed")
        prev = next((lines[k].strip() for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        marker = NOT_RUN.match(prev)
        blocks.append(Block(start + 1, language, "\n".join(lines[start + 1 : j]), marker.group(1) if marker else None))
        i = j + 1
    return blocks


def script(blocks: list[Block]) -> str:
    """The runnable blocks as one bash script, each announced by :data:`MARK`."""
    parts = ["set -euo pipefail"]
    for b in blocks:
        if b.runnable:
            parts += [f"echo '{MARK.format(line=b.line)}'", "set -x", b.text, "set +x"]
    return "\n".join(parts) + "\n"


def split_output(output: str) -> dict[int, str]:
    """The combined output per README block line (what :func:`script` printed)."""
    out: dict[int, str] = {}
    current = None
    for ln in output.splitlines(keepends=True):
        m = re.match(r"^=== README block at line (\d+) ===$", ln.strip())
        if m:
            current = int(m.group(1))
            out[current] = ""
        elif current is not None:
            out[current] += ln
    return out


def _source_files(repo: Path) -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo, capture_output=True, check=True).stdout
        files = [Path(p) for p in listed.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        files = [p.relative_to(repo) for name in ("workflow", "config", "profiles", "envs", "src", "scripts", "resources")
                 if (repo / name).exists() for p in (repo / name).rglob("*") if p.is_file()]  # fmt: skip
        files += [Path(n) for n in ("README.md", "Makefile", "pyproject.toml", "requirements.lock") if (repo / n).exists()]
    return [f for f in files if (repo / f).is_file() and not f.parts[0].startswith(".venv")]


def fresh_copy(repo: Path, dest: Path) -> Path:
    """``repo``'s files into ``dest`` (modification times kept) with ``.venv`` linked to this environment."""
    for rel in _source_files(repo):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / rel, dest / rel)
    venv = Path(sys.prefix)
    (dest / ".venv").symlink_to(venv, target_is_directory=True)
    stamp = venv / STAMP
    if not stamp.exists():  # installed by hand (pip install -e .): record it as make would
        stamp.touch()
    # make compares the stamp with pyproject.toml and the lock: keep the copy's older than the stamp
    old = stamp.stat().st_mtime - 60
    for name in ("pyproject.toml", "requirements.lock"):
        os.utime(dest / name, (old, old))
    return dest


def in_venv() -> bool:
    return sys.prefix != getattr(sys, "base_prefix", sys.prefix)


def run_readme(repo: Path, dest: Path, timeout: int = 2400) -> tuple[subprocess.CompletedProcess, list[Block]]:
    """Copy ``repo`` to ``dest`` and run its README's runnable blocks there, as a user
    would: with this environment's ``bin`` taken off ``PATH`` (the README activates it)."""
    blocks = parse_blocks((repo / "README.md").read_text())
    fresh_copy(repo, dest)
    venv_bin = str(Path(sys.prefix) / "bin")
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p and os.path.realpath(p) != os.path.realpath(venv_bin))
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    env["PATH"] = path
    (dest / "readme_commands.sh").write_text(script(blocks))
    # one stream, so that each command's output follows it (set -x traces go to stderr)
    proc = subprocess.run(["bash", "readme_commands.sh"], cwd=dest, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)  # fmt: skip
    (dest / "readme_commands.log").write_text(proc.stdout)
    return proc, blocks
