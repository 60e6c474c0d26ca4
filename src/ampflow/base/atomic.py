"""Atomic outputs: a file or folder appears under its final name only when complete."""

from __future__ import annotations

import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path


def _fsync_tree(path: Path) -> None:
    if path.is_dir():
        for child in path.rglob("*"):
            if child.is_file():
                _fsync_file(child)
        _fsync_dir(path)
    elif path.exists():
        _fsync_file(path)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(final: Path) -> Path:
    """A hidden sibling of ``final`` that keeps its extension (some writers dispatch on it)."""
    return final.parent / f".tmp-{os.getpid()}-{final.name}"


@contextmanager
def atomic_path(final):
    """Yield a temporary path next to ``final``; on success fsync and ``os.replace`` it.

    Works for files and folders. On an exception the temporary is removed and the
    final name is untouched, so nothing half-written ever appears under it.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(final)
    _remove(tmp)
    try:
        yield tmp
        _fsync_tree(tmp)
        if tmp.is_dir() and final.exists():
            # os.replace cannot swap a folder over a non-empty folder
            _remove(final)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
    except BaseException:
        _remove(tmp)
        raise


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def remove_stale_temps(final) -> list[Path]:
    """Remove temporaries of ``final`` left by killed processes; the paths removed.

    Call only while no other process can be writing ``final`` (e.g. under a lock).
    """
    final = Path(final)
    pattern = re.compile(r"\.tmp-\d+-" + re.escape(final.name) + "$")
    gone = []
    if final.parent.is_dir():
        for p in final.parent.iterdir():
            if pattern.match(p.name):
                _remove(p)
                gone.append(p)
    return gone


def write_text_atomic(final, text: str) -> None:
    """Write ``text`` to ``final`` atomically."""
    with atomic_path(final) as tmp:
        tmp.write_text(text)
