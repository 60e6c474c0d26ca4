"""One extraction worker process: load the model once, then compute chunks on request.

Started by :class:`~ampflow.extract.pool.WorkerPool` with the ``spawn`` method and its
device already chosen through ``CUDA_VISIBLE_DEVICES`` in its environment, so torch
sees exactly one GPU (``cuda:0``) or none. This module imports torch only inside
functions: nothing touches CUDA before the environment is in place.

Messages to the parent (one pipe per worker): ``("ready", wid, info)``,
``("batch", wid, sequences, tokens, padded_tokens)``, ``("done", wid, chunk, info)``,
``("progress", wid, counters)``, ``("error", wid, text, is_input_error)``. The parent
answers ``ready`` and ``done`` with the next chunk (a dict from the split manifest) or
``None`` to stop.

Liveness is progress, not time. The pool kills a worker that makes no progress for its
deadline (``load_deadline`` while loading, ``deadline`` while computing a chunk), so the
worker says when it gets work done. Batches and chunks are messages of their own. Loading
a model has no such steps the worker could count (``weights.load_model`` takes no
callback, and most of the time of a small model goes to importing torch and
transformers), so :class:`ProgressReporter`, a thread started first thing in the worker,
samples counters that grow only when the *main* thread gets work done:

* ``modules``: modules imported (``len(sys.modules)``);
* ``read``: bytes the main thread passed through ``read``/``pread`` (``rchar`` of
  ``/proc/self/task/<tid>/io``: Python files, tokenizer, config, the weights read with
  ``pread`` to be converted or moved to a GPU);
* ``fetched``: bytes the main thread caused to be fetched from storage (``read_bytes``;
  also page faults on memory-mapped weights from a cold file system);
* ``batches``: batches computed.

It sends them, every :data:`PROGRESS_INTERVAL` seconds, only when one grew. A main thread
hung in a driver call, a stalled file system read or a sleep grows none of them, so the
reporter falls silent although its own thread is alive: a heartbeat that only said
"alive" would hide exactly the hangs the deadline is there to find. CPU time is not
counted either: a host thread spinning on a stuck GPU burns it. Slowness (a loaded node,
a slow file system) is not silence: a load that goes on reading is never killed, however
long it takes. The thread's own reads of ``/proc`` count in its own task, not the main
thread's; on a system without per-thread I/O counters only modules and batches count.

GPU workers load one after another (a file lock, as ``weights.load_lock``): a worker
waiting for its turn makes no progress of its own, so it says ``("waiting", wid,
counters)`` before it blocks and ``("turn", wid, counters)`` when it has the lock; the
pool counts the progress of the workers loading meanwhile as its progress
(:class:`~ampflow.extract.pool.WorkerPool`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from ..base.errors import InputError
from .cache import VectorCache
from .chunks import read_chunk
from .config import ModelSpec

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

    @property
    def chunk_dir(self) -> Path:
        return Path(self.work) / "queue"

    def cache(self) -> VectorCache:
        return VectorCache(self.cache_root, self.ident)


PROGRESS_INTERVAL = 1.0  # seconds between looks at the counters


class ProgressReporter:
    """Counters of the work the calling (main) thread gets done, sent to the pool by a
    thread of its own whenever one of them grew (see the module's docstring).

    ``send`` is called with ``("progress", wid, counters)`` from the reporter's thread;
    the caller makes it safe to use beside its own sends (one lock). ``batch()`` counts a
    finished batch. The thread ends with :meth:`stop`, or when ``send`` fails (the pool
    is gone).
    """

    def __init__(self, wid: int, send: Callable, interval: float = PROGRESS_INTERVAL):
        self.wid = wid
        self.send = send
        self.interval = interval
        self.batches = 0
        self._io = f"/proc/self/task/{threading.get_native_id()}/io"
        self._stop = threading.Event()
        self._best: dict = {}
        self._lock = threading.Lock()  # counters compared and sent in one order
        self._thread = threading.Thread(target=self._run, name="extract-progress", daemon=True)

    def start(self) -> ProgressReporter:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def batch(self) -> None:
        self.batches += 1

    def counters(self) -> dict:
        out = {"modules": len(sys.modules), "batches": self.batches}
        try:
            with open(self._io, "rb") as fh:
                fields = dict(line.split(b":", 1) for line in fh.read().splitlines() if b":" in line)
            out["read"] = int(fields[b"rchar"])
            out["fetched"] = int(fields[b"read_bytes"])
        except (OSError, KeyError, ValueError):
            pass  # no per-thread I/O counters here: modules and batches only
        return out

    def grew(self) -> dict | None:
        """The counters when one is above its highest value yet, else None."""
        now = self.counters()
        if not any(v > self._best.get(k, -1) for k, v in now.items()):
            return None
        for k, v in now.items():
            self._best[k] = max(v, self._best.get(k, -1))
        return now

    def say(self, kind: str) -> None:
        """Send ``(kind, wid, counters)`` now, from the calling thread; progress messages
        after it carry counters above these."""
        with self._lock:
            self.grew()
            self.send((kind, self.wid, self.counters()))

    def _run(self) -> None:
        while True:
            with self._lock:
                counters = self.grew()
                if counters is not None:
                    try:
                        self.send(("progress", self.wid, counters))
                    except (OSError, ValueError):
                        return  # the pipe is closed: the pool is gone, or we are ending
            if self._stop.wait(self.interval):
                return


def load_turn(path: Path, progress: ProgressReporter):
    """The job's model-loading lock (:func:`~ampflow.extract.weights.load_lock`), saying
    ``waiting`` before blocking on another worker's turn and ``turn`` once it is ours."""
    from .weights import load_lock  # torch: imported in the worker, not in the pool

    return load_lock(path, on_wait=lambda: progress.say("waiting"), on_turn=lambda: progress.say("turn"))


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
    lock = threading.Lock()

    def send(msg: tuple) -> None:
        with lock:  # the reporter's thread sends too: one message at a time on the pipe
            conn.send(msg)

    progress = ProgressReporter(wid, send).start()  # before anything slow (imports)
    label = worker_label(wid, job.device)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, force=True,
        format=f"%(asctime)s %(levelname)s {label}: %(message)s",
    )  # fmt: skip
    parent = os.getppid()

    def on_batch(n: int, tokens: int, padded: int) -> None:
        if os.getppid() != parent:  # the pool is gone: stop instead of computing for nobody
            os._exit(0)
        progress.batch()
        send(("batch", wid, n, tokens, padded))

    try:
        import torch

        from .models import load_embedder

        torch.set_num_threads(job.threads)
        t0 = time.monotonic()
        # GPU workers load one after another: each reads and converts the weights through
        # host buffers on the way to its device. CPU workers share the file's pages and
        # load at once.
        turn = load_turn(Path(job.work) / "model-load.lock", progress) if job.device == "cuda" else nullcontext()
        with turn:
            embedder = load_embedder(job.spec, job.folder, list(job.layers), device=job.device)
        cache = job.cache()
        info = {"label": label, "load_seconds": round(time.monotonic() - t0, 2), **progress.counters()}
        log.info("model loaded in %.1f s on %s (%s)", info["load_seconds"], job.device, embedder.dtype)
        send(("ready", wid, info))
        while True:
            chunk = conn.recv()
            if chunk is None:
                # everything is on disk and acknowledged: skip the interpreter's slow
                # teardown of torch and transformers (seconds the job would wait)
                progress.stop()
                logging.shutdown()
                os._exit(0)
            marker = compute_chunk(embedder, job, chunk, label, on_batch, cache)
            send(("done", wid, chunk["name"], {k: marker[k] for k in ("n_sequences", "seconds", "tokens", "padded_tokens", "splits")}))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the parent went away
    except InputError as e:
        progress.stop()
        _report(send, wid, str(e), True)
    except Exception:
        progress.stop()
        _report(send, wid, traceback.format_exc(), False)


def _report(send, wid: int, text: str, is_input: bool) -> None:
    try:
        send(("error", wid, text, is_input))
    except (BrokenPipeError, OSError):
        pass
    sys.exit(1)
