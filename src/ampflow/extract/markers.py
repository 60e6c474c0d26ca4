"""The shards' ``.done`` markers as the record of an extraction's progress.

Every computed chunk ends in a shard of the vector cache and its marker (``cache.py``):
the time it was finished (``finished``, seconds since the epoch, and ``time``,
readable) and what it took (``worker``, ``seconds``, tokens, batches split after running
out of memory). :func:`progress_rows` rebuilds an input's progress from the markers of
the shards its sequences are in, so a run that finds every sequence cached writes the
same progress file as the run that computed them.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime


def sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _finished(marker: dict) -> float:
    """When the chunk was finished (seconds since the epoch); markers without
    ``finished`` have only ``time``, to the second."""
    if isinstance(marker.get("finished"), (int, float)):
        return float(marker["finished"])
    return datetime.strptime(marker["time"], "%Y-%m-%dT%H:%M:%S%z").timestamp()


def progress_rows(markers: list[dict], counts: dict[str, int], total: int) -> list[dict]:
    """An input's progress: one row per shard holding some of its sequences, in the
    order they were finished.

    ``counts`` maps shard names to the input's sequences found in each (the index's
    choice of shard for every key); ``total`` is the input's sequence count. Rows are
    ``{"time", "sequences", "total", "chunk", "n", "seconds", "worker", "splits"}``:
    ``sequences`` is the running count. A first row at ``sequences`` 0 is the start of the
    first shard to finish (its finish time less its compute seconds). Shards computed by
    several runs, or for another input sharing sequences, all count, each at the time
    its marker was written. Empty when no shard counts.
    """
    done = sorted(((_finished(m), m["shard"], m) for m in markers if counts.get(m["shard"])), key=lambda d: (d[0], d[1]))
    if not done:
        return []
    first = done[0]
    start = first[0] - float(first[2].get("seconds") or 0.0)
    rows = [{"time": round(start, 3), "sequences": 0, "total": total, "chunk": None, "n": 0, "seconds": 0.0, "worker": None, "splits": 0}]
    count = 0
    for t, name, marker in done:
        count += counts[name]
        rows.append({
            "time": t, "sequences": count, "total": total, "chunk": name, "n": counts[name],
            "seconds": float(marker.get("seconds") or 0.0), "worker": marker.get("worker"),
            "splits": len(marker.get("splits") or []),
        })  # fmt: skip
    return rows


def progress_text(rows: list[dict]) -> str:
    """The rows as JSON lines (sorted keys: the same rows give the same bytes)."""
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)
