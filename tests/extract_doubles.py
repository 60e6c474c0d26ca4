"""Test doubles of extraction: the pool in this process, workers that hang, load slowly,
run out of memory or take their time.

:class:`InlinePool` is the pool's interface without processes; a test puts it in the
real pool's place with :func:`pool_class` (``ampflow.extract.run.WorkerPool`` replaced).

The pool spawns each worker with ``ampflow.extract.pool.worker_main`` as its target; a test
replaces that with one of the worker doubles here (``monkeypatch.setattr(pool,
"worker_main", partial(...))``). A spawned process does not inherit the parent's patches,
so each double patches, in its own process, what the real worker calls
(``models.load_embedder``, ``worker.compute_chunk``, the ``Embedder``'s batches) and then
runs the real :func:`ampflow.extract.worker.worker_main`: the progress reporting and the
pool's deadlines under test are the production ones.

Which worker misbehaves is decided by a file: the first worker to create ``hook``
exclusively (``O_EXCL``) does, and writes into it what it is and where; the ones after
it, finding the file, do not (``times`` > 1: files ``hook``, ``hook.1``, ... for that many
workers).

A command run as a process of its own (``ampflow extract``, Snakemake and the jobs it
starts) gets its doubles from the environment :func:`doubles_env` makes: a
``sitecustomize.py`` first on PYTHONPATH (:mod:`process_doubles`) loads this file in
every Python process where :data:`ENV` is set, and :func:`install` patches the extraction
modules as they are imported.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from process_doubles import after_import, process_env


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


# ---------------------------------------------------------------- the pool in this process
class InlinePool:
    """The pool's interface without processes: one worker in the calling process.

    Loaded models are kept per (folder, layers, device, spec) for the life of the
    process. Deadlines are accepted for the pool's interface and ignored: a hang here
    hangs the caller.
    """

    _models: dict = {}

    def __init__(self, job, slots: list[str | None], max_attempts: int = 2, deadline: float = 0.0, load_deadline: float = 0.0):
        self.job = job
        self.device = "cpu" if slots[0] is None else "cuda"

    def run(self, chunks: list[dict], progress=None) -> list[dict]:
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(self.job.threads)
        try:
            return self._run(chunks, progress)
        finally:
            torch.set_num_threads(threads)

    def _run(self, chunks: list[dict], progress) -> list[dict]:
        from ampflow.extract.models import load_embedder
        from ampflow.extract.worker import compute_chunk

        key = (self.job.folder, self.job.layers, self.device, self.job.spec)
        if key not in self._models:
            self._models[key] = load_embedder(self.job.spec, self.job.folder, list(self.job.layers), device=self.device)
        embedder = self._models[key]
        cache = self.job.cache()
        stats = Counter()

        def on_batch(n: int, tokens: int, padded: int) -> None:
            stats.update(tokens=tokens, padded_tokens=padded)
            if progress is not None:
                progress.update(n)

        for c in chunks:
            marker = compute_chunk(embedder, self.job, c, "inline", on_batch, cache)
            stats.update(chunks=1, sequences=marker["n_sequences"], seconds=marker["seconds"], splits=len(marker["splits"]))
        return [{"worker": "inline", **stats}]


@contextmanager
def pool_class(cls):
    """Extraction jobs started inside run their chunks on ``cls`` instead of the
    ``WorkerPool`` (None: the real one)."""
    import pytest

    from ampflow.extract import run

    with pytest.MonkeyPatch.context() as m:
        if cls is not None:
            m.setattr(run, "WorkerPool", cls)
        yield


# ---------------------------------------------------------------- out of memory, slow chunks
def out_of_memory_above(tokens: int, patch: Callable = setattr) -> None:
    """Batches of more than ``tokens`` padded tokens (rows x longest row, packed or not)
    raise ``torch.OutOfMemoryError`` before they run, as on a full GPU: the back-off is
    tested on the CPU. ``patch``: ``monkeypatch.setattr`` in a test's process, plain
    ``setattr`` in a process of the double's own."""
    from ampflow.extract.models import Embedder

    batch, packed = Embedder.embed_batch, Embedder.embed_packed

    def check(rows: int, longest: int) -> None:
        if rows * longest > tokens:
            import torch

            raise torch.OutOfMemoryError(f"injected: {rows} x {longest} tokens > {tokens}")

    def embed_batch(self, members):
        check(len(members), max(len(t.ids) for t in members))
        return batch(self, members)

    def embed_packed(self, members, rows):
        check(len(rows), max(sum(len(members[j].ids) for j in r) for r in rows))
        return packed(self, members, rows)

    patch(Embedder, "embed_batch", embed_batch)
    patch(Embedder, "embed_packed", embed_packed)


def slow_chunks(seconds: float) -> None:
    """Every worker of this process waits ``seconds`` after computing each chunk, before
    saying it is done: a window to kill the job in."""
    from ampflow.extract import worker

    compute = worker.compute_chunk

    def slow_compute(*args, **kwargs):
        marker = compute(*args, **kwargs)
        time.sleep(seconds)
        return marker

    worker.compute_chunk = slow_compute


def oom_worker(wid, conn, job, tokens: int) -> None:
    """The real worker, whose batches of more than ``tokens`` padded tokens run out of
    memory (:func:`out_of_memory_above`)."""
    from ampflow.extract import worker

    out_of_memory_above(tokens)
    worker.worker_main(wid, conn, job)


# ---------------------------------------------------------------- doubles of other processes
ENV = "AMPFLOW_TEST_EXTRACT_DOUBLES"  # JSON: {"chunk_delay": seconds, "oom_above": tokens}

# what each double patches: the module it waits for, and how
_PATCHES = {"chunk_delay": ("ampflow.extract.worker", slow_chunks), "oom_above": ("ampflow.extract.models", out_of_memory_above)}


def install(doubles: str) -> None:
    """Install the doubles given as JSON (keys of :data:`_PATCHES`) in this process: each
    at once where its module is imported already, else the moment it is."""
    for key, value in json.loads(doubles).items():
        module, patch = _PATCHES[key]
        after_import(module, lambda _module, patch=patch, value=value: patch(value))


def doubles_env(folder: Path, env: dict | None = None, **doubles) -> dict:
    """An environment (``env``, or this process's) in which every Python process has the
    given doubles: ``chunk_delay=seconds`` (:func:`slow_chunks`), ``oom_above=tokens``
    (:func:`out_of_memory_above`) (:func:`process_doubles.process_env`)."""
    unknown = set(doubles) - set(_PATCHES)
    if unknown:
        raise ValueError(f"no such double: {sorted(unknown)}")
    return process_env(folder, env, **{ENV: json.dumps(doubles)})
