"""Test doubles of an extraction worker process: hung, or slow to load its model.

The pool spawns each worker with ``ampflow.extract.pool.worker_main`` as its target; a test
replaces that with one of these (``monkeypatch.setattr(pool, "worker_main", partial(...))``).
A spawned process does not inherit the parent's patches, so each double patches, in its
own process, what the real worker calls (``models.load_embedder``, ``worker.compute_chunk``)
and then runs the real :func:`ampflow.extract.worker.worker_main`: the progress reporting
and the pool's deadlines under test are the production ones.

Which worker misbehaves is decided by a file: the first worker to create ``hook``
exclusively (``O_EXCL``) does, and writes into it what it is and where; the ones after
it, finding the file, do not (``times`` > 1: files ``hook``, ``hook.1``, ... for that many
workers).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def claim(hook: str, times: int, what: str) -> bool:
    """Whether this worker is one of the ``times`` that misbehave (it wrote ``what``)."""
    for i in range(times):
        try:
            fd = os.open(hook + (f".{i}" if i else ""), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            continue
        os.write(fd, what.encode())
        os.close(fd)
        return True
    return False


def hang_forever() -> None:
    """A main thread stuck (as in a driver call): no module, no byte, no batch any more."""
    while True:
        time.sleep(3600)


def hanging_worker(wid, conn, job, hook: str, phase: str = "chunk", times: int = 1) -> None:
    """The real worker, except that (once, or ``times`` times) it hangs forever: before its
    model is loaded (``phase="load"``), or before the first batch of a chunk (``"chunk"``).
    The hook file says ``"{label} load"`` or ``"{label} {chunk}"``."""
    from ampflow.extract import models, worker

    label = worker.worker_label(wid, job.device)
    if phase == "load":
        load = models.load_embedder

        def hung_load(*args, **kwargs):
            if claim(hook, times, f"{label} load"):
                hang_forever()
            return load(*args, **kwargs)

        models.load_embedder = hung_load
    else:
        compute = worker.compute_chunk

        def hung_compute(embedder, job_, chunk, *args, **kwargs):
            if claim(hook, times, f"{label} {chunk['name']}"):
                hang_forever()
            return compute(embedder, job_, chunk, *args, **kwargs)

        worker.compute_chunk = hung_compute
    worker.worker_main(wid, conn, job)


def slow_loading_worker(wid, conn, job, seconds: float, hook: str | None = None, stall_after: float | None = None) -> None:
    """The real worker on a slow file system: before loading its model it reads the
    model's weights file a page every 0.25 s for ``seconds`` (bytes read: progress, but
    not a load that ends soon). With ``stall_after``, the worker that claims ``hook``
    stops reading after that many seconds and hangs; it writes ``{"label", "stopped":
    time.time(), "read": bytes}`` into ``hook`` as it stops. The workers after it, finding
    ``hook`` taken, load at normal speed."""
    from ampflow.extract import models, worker

    label = worker.worker_label(wid, job.device)
    load = models.load_embedder

    def slow_load(spec, folder, *args, **kwargs):
        stall = stall_after is not None and claim(hook, 1, label)
        slow = seconds if stall_after is None or stall else 0.0
        weights = sorted(Path(folder).glob("*.safetensors")) or sorted(p for p in Path(folder).iterdir() if p.is_file())
        fd = os.open(weights[0], os.O_RDONLY)
        size, done, t0 = os.fstat(fd).st_size, 0, time.monotonic()
        try:
            while time.monotonic() - t0 < slow:
                if stall and time.monotonic() - t0 >= stall_after:
                    Path(hook).write_text(json.dumps({"label": label, "stopped": time.time(), "read": done}))
                    hang_forever()
                done += len(os.pread(fd, 4096, done % max(size - 4096, 1)))
                time.sleep(0.25)
        finally:
            os.close(fd)
        return load(spec, folder, *args, **kwargs)

    models.load_embedder = slow_load
    worker.worker_main(wid, conn, job)
