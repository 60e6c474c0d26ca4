"""Per-chunk outputs and their ``.done`` markers.

A chunk's vectors are written to ``{chunk}.npy`` through a temporary name (fsync,
``os.replace``), then ``{chunk}.done``: JSON with the output's sha256 and size, the
chunk input's sha256, the sequence count, the model id, the settings that shape the
numbers, the time it was finished (``finished``, seconds since the epoch, and ``time``,
readable) and what the chunk took (``worker``, ``seconds``, tokens). A marker is never
empty. On a restart a chunk is skipped only
when its marker parses, names the same input, model and settings, and the output on disk
has the recorded size and checksum; anything else (no marker, a truncated output, other
weights) is computed again.

The markers are also the record of the extraction's progress: :func:`progress_rows`
rebuilds it from them, so a run that finds every chunk done writes the same progress
file as the run that computed them.
"""

from __future__ import annotations

import hashlib
import io
import json
import time
from datetime import datetime
from pathlib import Path

import numpy as np

from ..io.atomic import atomic_path, write_text_atomic


def sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def output_path(out_dir, chunk: str) -> Path:
    return Path(out_dir) / f"{chunk}.npy"


def marker_path(out_dir, chunk: str) -> Path:
    return Path(out_dir) / f"{chunk}.done"


def write_chunk(out_dir, chunk: str, vectors: np.ndarray, expect: dict, **extra) -> dict:
    """Write ``vectors`` (n, dim) atomically, then the marker; return the marker.

    ``expect`` holds what a later run must match (``input_sha256``, ``model``,
    ``settings``); ``extra`` is recorded as is (device, seconds, tokens, ...).
    """
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(vectors, dtype=np.float32), allow_pickle=False)
    data = buf.getvalue()
    out = output_path(out_dir, chunk)
    with atomic_path(out) as tmp:
        tmp.write_bytes(data)
    marker = {
        "chunk": chunk,
        **expect,
        "output": out.name,
        "output_sha256": hashlib.sha256(data).hexdigest(),
        "output_bytes": len(data),
        "n_sequences": int(vectors.shape[0]),
        "dim": int(vectors.shape[1]),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "finished": round(time.time(), 3),
        **extra,
    }
    write_text_atomic(marker_path(out_dir, chunk), json.dumps(marker, indent=1, sort_keys=True) + "\n")
    return marker


def check_marker(out_dir, chunk: str, n_sequences: int, expect: dict) -> str | None:
    """None when the chunk is done and intact, else why it must be computed."""
    mpath = marker_path(out_dir, chunk)
    if not mpath.exists():
        return "no marker"
    try:
        marker = json.loads(mpath.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return "unreadable marker"
    if not isinstance(marker, dict):
        return "unreadable marker"
    for key, want in expect.items():
        if marker.get(key) != want:
            return f"marker made with another {key.replace('_', ' ')}"
    if marker.get("n_sequences") != n_sequences:
        return "marker has another sequence count"
    out = output_path(out_dir, chunk)
    if not out.is_file():
        return "output missing"
    if out.stat().st_size != marker.get("output_bytes"):
        return "output size differs from the marker"
    if sha256_file(out) != marker.get("output_sha256"):
        return "output checksum differs from the marker"
    return None


def load_chunk(out_dir, chunk: str, n_sequences: int) -> np.ndarray:
    """The chunk's vectors, checked against its marker's checksum."""
    out = output_path(out_dir, chunk)
    data = out.read_bytes()
    marker = json.loads(marker_path(out_dir, chunk).read_text())
    if hashlib.sha256(data).hexdigest() != marker["output_sha256"]:
        raise RuntimeError(f"{out}: changed after its marker was written; run the extraction again")
    arr = np.load(io.BytesIO(data), allow_pickle=False)
    if arr.shape[0] != n_sequences:
        raise RuntimeError(f"{out}: {arr.shape[0]} vectors, expected {n_sequences}")
    return arr


def _finished(marker: dict) -> float:
    """When the chunk was finished (seconds since the epoch); markers written before
    ``finished`` was recorded have only ``time``, to the second."""
    if isinstance(marker.get("finished"), (int, float)):
        return float(marker["finished"])
    return datetime.strptime(marker["time"], "%Y-%m-%dT%H:%M:%S%z").timestamp()


def progress_rows(out_dir, chunks: list[dict]) -> list[dict]:
    """The extraction's progress, rebuilt from the markers of ``chunks`` (the split
    manifest's entries, every one done): one row per chunk in the order they finished.

    Rows are ``{"time", "sequences", "total", "chunk", "n", "seconds", "worker"}``:
    ``sequences`` is the running count of embedded sequences, ``total`` those of the
    whole input. A first row at ``sequences`` 0 is the start of the first chunk to
    finish (its finish time less its compute seconds). Chunks computed by several runs
    (a crash, a re-run) all count, each at the time its marker was written. Empty when
    there is no chunk.
    """
    done = []
    for c in chunks:
        marker = json.loads(marker_path(out_dir, c["name"]).read_text())
        done.append((_finished(marker), c["name"], marker))
    done.sort(key=lambda d: (d[0], d[1]))
    total = sum(int(c["n"]) for c in chunks)
    if not done:
        return []
    first = done[0]
    start = first[0] - float(first[2].get("seconds") or 0.0)
    rows = [{"time": round(start, 3), "sequences": 0, "total": total, "chunk": None, "n": 0, "seconds": 0.0, "worker": None}]
    count = 0
    for t, name, marker in done:
        count += int(marker["n_sequences"])
        rows.append({
            "time": t, "sequences": count, "total": total, "chunk": name, "n": int(marker["n_sequences"]),
            "seconds": float(marker.get("seconds") or 0.0), "worker": marker.get("worker"),
        })  # fmt: skip
    return rows


def progress_text(rows: list[dict]) -> str:
    """The rows as JSON lines (sorted keys: the same rows give the same bytes)."""
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)
