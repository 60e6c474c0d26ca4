"""One extraction worker process: load the model once, then compute chunks on request.

Started by :class:`~ampflow.extract.pool.WorkerPool` with the ``spawn`` method and its
device already chosen through ``CUDA_VISIBLE_DEVICES`` in its environment, so torch
sees exactly one GPU (``cuda:0``) or none. This module imports torch only inside
functions: nothing touches CUDA before the environment is in place.

Messages to the parent (one pipe per worker): ``("ready", wid, info)``,
``("batch", wid, sequences, tokens, padded_tokens)``, ``("done", wid, chunk, info)``,
``("error", wid, text, is_input_error)``. The parent answers ``ready`` and ``done`` with
the next chunk (a dict from the split manifest) or ``None`` to stop.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..io.errors import InputError
from .chunks import read_chunk
from .config import ModelSpec
from .cache import VectorCache

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    """What every worker of one extraction needs (picklable).

    ``ident`` names the cache folder the vectors go to (model fingerprint, kind, compute
    dtype; ``cache.VectorCache``); ``layers`` are resolved (0..n_layers).
    """

    spec: ModelSpec
    folder: str
    layers: tuple
    work: str
    cache_root: str
    ident: dict
    device: str = "cpu"  # cpu | cuda (the worker's one visible GPU)
    threads: int = 1
    delay: float = 0.0  # seconds to wait after each chunk (tests: a window to kill in)
    oom_above: int | None = None  # tests: batches of more padded tokens run out of memory
    # TEST ONLY: simulate a hung device (a stuck kernel or driver call). A worker that
    # creates ``hang_once`` exclusively (O_EXCL) sleeps forever, in ``hang_in`` ("chunk":
    # before the first batch of its chunk; "load": before it says it is ready); the
    # ones after it, finding the file, do not. ``hang_times`` > 1 hangs that many workers
    # (files ``hang_once``, ``hang_once.1``, ...): a chunk that hangs every worker.
    hang_once: str | None = None
    hang_in: str = "chunk"
    hang_times: int = 1

    def hang_if_told(self, phase: str, what: str) -> None:
        """TEST ONLY: sleep forever if this worker claims one of the hang files."""
        if self.hang_once is None or phase != self.hang_in:
            return
        for i in range(self.hang_times):
            try:
                fd = os.open(self.hang_once + (f".{i}" if i else ""), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                continue
            os.write(fd, what.encode())  # which worker hung where, for the test to check
            os.close(fd)
            log.warning("test hook: hanging (%s)", what)
            while True:
                time.sleep(3600)

    @property
    def chunk_dir(self) -> Path:
        return Path(self.work) / "queue"

    def cache(self) -> VectorCache:
        return VectorCache(self.cache_root, self.ident)


def compute_chunk(embedder, job: Job, chunk: dict, label: str, on_batch: Callable | None = None, cache=None) -> dict:
    """Embed one chunk file and store its vectors in the cache; the shard's marker."""
    keys, seqs = read_chunk(job.chunk_dir / f"{chunk['name']}.fa", chunk["sha256"])
    t0 = time.monotonic()
    arrays, stats = embedder.embed(seqs, on_batch)
    seconds = time.monotonic() - t0
    for s in stats["splits"]:
        log.warning(
            "%s: a batch of %d sequences (%d padded tokens) ran out of memory; split in two and run again",
            chunk["name"], s["sequences"], s["padded_tokens"],
        )  # fmt: skip
    return (cache or job.cache()).write(chunk["sha256"], keys, arrays, worker=label, seconds=round(seconds, 3), chunk=chunk["name"], **stats)


def worker_label(wid: int, device: str) -> str:
    if device == "cpu":
        return f"worker {wid} (cpu)"
    return f"worker {wid} (GPU {os.environ.get('CUDA_VISIBLE_DEVICES', '?')})"


def worker_main(wid: int, conn, job: Job) -> None:
    """Entry point of a worker process."""
    label = worker_label(wid, job.device)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, force=True,
        format=f"%(asctime)s %(levelname)s {label}: %(message)s",
    )  # fmt: skip
    parent = os.getppid()

    def on_batch(n: int, tokens: int, padded: int) -> None:
        if os.getppid() != parent:  # the pool is gone: stop instead of computing for nobody
            os._exit(0)
        conn.send(("batch", wid, n, tokens, padded))

    try:
        import torch

        from .models import load_embedder

        torch.set_num_threads(job.threads)
        t0 = time.monotonic()
        job.hang_if_told("load", f"{label} load")
        # GPU workers load one after another: each reads and converts the weights through
        # host buffers on the way to its device. CPU workers share the file's pages and
        # load at once.
        lock = Path(job.work) / "model-load.lock" if job.device == "cuda" else None
        embedder = load_embedder(job.spec, job.folder, list(job.layers), device=job.device, lock=lock)
        embedder.inject_oom_above = job.oom_above
        cache = job.cache()
        info = {"label": label, "load_seconds": round(time.monotonic() - t0, 2)}
        log.info("model loaded in %.1f s on %s (%s)", info["load_seconds"], job.device, embedder.dtype)
        conn.send(("ready", wid, info))
        while True:
            chunk = conn.recv()
            if chunk is None:
                # everything is on disk and acknowledged: skip the interpreter's slow
                # teardown of torch and transformers (seconds the job would wait)
                logging.shutdown()
                os._exit(0)
            job.hang_if_told("chunk", f"{label} {chunk['name']}")
            marker = compute_chunk(embedder, job, chunk, label, on_batch, cache)
            if job.delay:
                time.sleep(job.delay)
            conn.send(("done", wid, chunk["name"], {k: marker[k] for k in ("n_sequences", "seconds", "tokens", "padded_tokens", "splits")}))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the parent went away
    except InputError as e:
        _report(conn, wid, str(e), True)
    except Exception:
        _report(conn, wid, traceback.format_exc(), False)


def _report(conn, wid: int, text: str, is_input: bool) -> None:
    try:
        conn.send(("error", wid, text, is_input))
    except (BrokenPipeError, OSError):
        pass
    sys.exit(1)
