"""A pool of extraction workers, one per visible GPU (or N on the CPU), fed chunk by chunk.

The parent keeps the queue of chunks and hands the next one to whichever worker asks,
so a slow device simply asks less often. Each worker has its own pipe: a worker that
dies cannot corrupt a shared queue, its pipe just closes. The parent waits on every
pipe and every process sentinel at once (``multiprocessing.connection.wait``): a worker
that dies while computing a chunk has the chunk put back at the front of the queue and
is replaced on the same device; after ``max_attempts`` deaths on one chunk, or when no
worker is left, the job stops with a message that says so.

A worker can also hang without dying (a stuck kernel or driver call, a stalled network
file system): alive and silent, it would hold its chunk until the scheduler's time limit
ends the whole job. So each worker has a deadline, counted from its last progress, not
from its start: one that makes no progress for ``deadline`` seconds while computing a
chunk, or for ``load_deadline`` seconds while loading its model, is killed and then
handled exactly like a death. Progress is what the worker reports
(:mod:`~ampflow.extract.worker`): a finished batch or chunk, and while loading, counters
that grow only as its main thread gets work done (modules imported, bytes read), never a
bare "still alive". A node so loaded that a worker needs minutes to import torch and
read a model is slow, not hung, and keeps its worker. GPU workers load one after
another: one waiting for its turn makes progress whenever a worker that is loading does
(one hung holding the lock is killed at its own deadline, which frees the lock).

Devices: ``CUDA_VISIBLE_DEVICES`` is set in each worker's environment before it starts
(spawn, never fork), so torch in the worker sees exactly its own GPU.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import time
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import wait

from ..base.errors import InputError
from ..base.progress import Progress
from .worker import Job, worker_main

log = logging.getLogger(__name__)


def cuda_unusable() -> str | None:
    """None when torch can run on a GPU here, else why not (one line).

    Asked in the parent before any worker starts: a GPU allocation (``CUDA_VISIBLE_DEVICES``
    set by SLURM) with a CPU-only torch, or no driver, would otherwise kill every worker
    with a traceback. The parent only counts devices; the workers, spawned, make their
    own CUDA contexts.
    """
    import torch

    if not torch.backends.cuda.is_built():
        return f"torch {torch.__version__} is built without CUDA"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False (no driver, or no GPU visible)"
    if torch.cuda.device_count() < 1:
        return "torch counts no CUDA device"
    return None


def gpu_slots(gpus: int) -> list[str]:
    """``CUDA_VISIBLE_DEVICES`` entries for up to ``gpus`` workers, one per GPU torch can use.

    Honours an existing ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs, as SLURM or a user
    set it), cut to the devices torch counts; otherwise the GPUs torch counts. Empty
    when none is usable (see :func:`cuda_unusable`).
    """
    if cuda_unusable() is not None:
        return []
    import torch

    count = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [v.strip() for v in visible.split(",") if v.strip() and v.strip() != "-1"][:count]
    else:
        entries = [str(i) for i in range(count)]
    return entries[:gpus]


def choose_devices(device: str, gpus: int, cpu_workers: int) -> tuple[str, list[str | None]]:
    """``("cuda", slots)`` or ``("cpu", [None] * cpu_workers)`` for the config's device.

    ``cuda`` without a usable GPU is an InputError naming ``extract.device``; ``auto``
    falls back to the CPU workers with one warning saying why.
    """
    if device == "cpu" or (device == "auto" and gpus < 1):
        return "cpu", [None] * cpu_workers
    why = cuda_unusable() if gpus >= 1 else "extract.gpus is 0"
    slots = gpu_slots(gpus) if why is None else []
    if not slots:
        why = why or "no GPU visible (CUDA_VISIBLE_DEVICES)"
        if device == "cuda":
            raise InputError(f"no usable GPU: {why}", key="extract.device", value=device)
        log.warning("extract.device auto: no usable GPU (%s); running %d CPU worker(s) (extract.cpu_workers)", why, cpu_workers)
        return "cpu", [None] * cpu_workers
    return "cuda", slots


@contextmanager
def _environ(values: dict):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def _counters_text(counters: dict) -> str:
    if not counters:
        return "none reported"
    units = {"read": "bytes read", "fetched": "bytes fetched from storage", "modules": "modules", "batches": "batches"}
    return ", ".join(f"{v} {units.get(k, k)}" for k, v in counters.items())


@dataclass
class _Worker:
    wid: int
    slot: int
    proc: mp.Process
    conn: object
    label: str = ""
    task: dict | None = None
    progress: dict = field(default_factory=dict)  # its last reported counters (worker.ProgressReporter)
    quiet: float = 0.0  # longest wait between two signs of progress while loading
    partial: int = 0  # sequences of the current chunk already counted in the progress
    state: str = "loading"  # loading (or waiting for its turn) -> busy (a chunk) / stopped (told to stop); ending
    since: float = field(default_factory=time.monotonic)  # start, or its last progress
    stats: Counter = field(default_factory=Counter)
    started: float = field(default_factory=time.monotonic)


class WorkerPool:
    """Run a :class:`~ampflow.extract.worker.Job` over chunks with one worker per slot.

    Parameters
    ----------
    job
        Model, folder, layer, work folder, marker expectations, device kind.
    slots
        One entry per worker: a ``CUDA_VISIBLE_DEVICES`` value, or None for a CPU worker.
    max_attempts
        Workers one chunk may take down before the job fails; also the deaths in a row
        (without a finished chunk in between) after which a device gets no new worker.
        A worker killed at its deadline counts as a death.
    deadline
        Seconds a worker computing a chunk may go without progress (a finished batch or
        chunk, bytes read) before it is taken for hung and killed. One batch is seconds even for
        ESM-2 15B on a full token budget of 1022-residue sequences, and reading a chunk
        or writing its output is seconds more; 600 s leaves room for a slow first batch
        (CUDA kernels loaded, memory allocated) on a busy node, yet a hang costs ten
        minutes, not the rest of a multi-day allocation.
    load_deadline
        Seconds a worker loading its model (from its start to ``ready``) may go without
        progress (modules imported, bytes read) before it is taken for hung and killed.
        A load that goes on reading is never killed, however slow the node or its file
        system; the longest step without a report is one tensor's read (ESM-2 15B's
        largest is ~400 MB of float32, seconds even at 100 MB/s) or one shared library
        loaded. The default, 1800 s, is generous on purpose: a shared file system that
        stalls for minutes and then recovers is not taken for a hang.
    """

    kill_grace = 5.0  # seconds between SIGTERM and SIGKILL, and waited after SIGKILL

    def __init__(self, job: Job, slots: list[str | None], max_attempts: int = 2, deadline: float = 600.0, load_deadline: float = 1800.0):
        self.job = job
        self.slots = slots
        self.max_attempts = max_attempts
        self.deadline = deadline
        self.load_deadline = load_deadline
        self.ctx = mp.get_context("spawn")
        self.workers: dict[int, _Worker] = {}
        self.finished: list[_Worker] = []
        self.failures = Counter()  # deaths per slot since its last finished chunk
        self._next_wid = 0

    # ---------------------------------------------------------------- processes
    def _start(self, slot: int) -> None:
        wid = self._next_wid
        self._next_wid += 1
        dev = self.slots[slot]
        parent_conn, child_conn = self.ctx.Pipe()
        env = {
            # before the worker imports torch: its one GPU, or none at all on the CPU
            "CUDA_VISIBLE_DEVICES": dev if dev is not None else "",
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "OMP_NUM_THREADS": str(self.job.threads),
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        with _environ(env):
            proc = self.ctx.Process(target=worker_main, args=(wid, child_conn, self.job), name=f"extract-worker-{wid}", daemon=True)
            proc.start()
        child_conn.close()
        self.workers[wid] = _Worker(wid, slot, proc, parent_conn, label=f"worker {wid} ({'cpu' if dev is None else 'GPU ' + dev})")

    def _stop_all(self) -> None:
        for w in self.workers.values():
            if w.proc.is_alive():
                w.proc.terminate()
        for w in self.workers.values():
            w.proc.join(timeout=10)
            self._end(w, terminate=False)

    def _end(self, w: _Worker, terminate: bool) -> None:
        """See that ``w``'s process is gone: SIGTERM if asked, SIGKILL after a grace.

        Joins are bounded: a process stuck in an uninterruptible driver call ignores even
        SIGKILL until the call returns, and must not stop the pool with it.
        """
        if terminate and w.proc.is_alive():
            w.proc.terminate()
        w.proc.join(self.kill_grace)
        if w.proc.is_alive():
            w.proc.kill()
            w.proc.join(self.kill_grace)
        if w.proc.is_alive():
            log.error("%s (pid %d) outlives SIGKILL (stuck in the kernel or driver); leaving it behind", w.label, w.proc.pid)

    # ---------------------------------------------------------------- protocol
    def _give(self, w: _Worker, pending: deque) -> None:
        if w.state == "ending":  # a message read after its process ended: no chunk for it
            w.task = None
            return
        w.task = pending.popleft() if pending else None
        w.partial = 0
        w.state = "busy" if w.task is not None else "stopped"
        try:
            w.conn.send(w.task)
        except (BrokenPipeError, OSError):
            pass  # it just died: its sentinel fires next and the chunk goes back

    def _handle(self, w: _Worker, msg: tuple, pending: deque, progress: Progress | None) -> None:
        kind = msg[0]
        now = time.monotonic()
        if kind == "progress":
            counters = msg[2]
            if any(v > w.progress.get(k, -1) for k, v in counters.items()):
                self._progressed(w, now)
                w.progress = {k: max(v, w.progress.get(k, -1)) for k, v in counters.items()}
            return  # the same counters again: alive, but no progress
        if kind in ("waiting", "turn"):  # for the model-loading lock (GPU workers)
            if w.state in ("loading", "waiting"):
                w.state = "waiting" if kind == "waiting" else "loading"
                w.since = now
            w.progress = {k: max(v, w.progress.get(k, -1)) for k, v in msg[2].items()}
            return
        self._progressed(w, now)
        if kind == "ready":
            log.info(
                "%s: model loaded in %.1f s, at most %.1f s without progress (extract.load_deadline %g s)",
                w.label, now - w.started, w.quiet, self.load_deadline,
            )  # fmt: skip
            if progress is not None and progress.done == 0:
                progress.restart_clock()  # rates from the first loaded model on
            self._give(w, pending)
        elif kind == "batch":
            _, _, n, tokens, padded = msg
            w.partial += n
            w.stats["tokens"] += tokens
            w.stats["padded_tokens"] += padded
            if progress is not None:
                progress.update(n)
        elif kind == "done":
            _, _, name, info = msg
            w.stats["chunks"] += 1
            w.stats["sequences"] += info["n_sequences"]
            w.stats["seconds"] += info["seconds"]
            w.stats["splits"] += len(info.get("splits") or [])
            self.failures[w.slot] = 0
            log.info("%s: %s done, %d sequences in %.1f s", w.label, name, info["n_sequences"], info["seconds"])
            self._give(w, pending)
        elif kind == "error":
            _, _, text, is_input = msg
            self._stop_all()
            if is_input:
                raise InputError(text)
            raise RuntimeError(f"{w.label} failed:\n{text}")

    def _progressed(self, w: _Worker, now: float) -> None:
        if w.state == "loading":
            w.quiet = max(w.quiet, now - w.since)
            for other in self.workers.values():
                if other.state == "waiting":  # its turn comes as this load goes on
                    other.since = now
        w.since = now

    def _drain(self, w: _Worker, pending: deque, progress) -> None:
        try:
            while w.conn.poll():
                self._handle(w, w.conn.recv(), pending, progress)
        except (EOFError, OSError):
            pass

    def _gone(self, w: _Worker, pending: deque, progress: Progress | None, hung: str | None = None) -> None:
        """A worker's process ended: a clean stop, or a death with or without a chunk.

        ``hung``: it did not end, it was silent past its deadline (why, in words); it is
        killed here and from then on treated as a death.
        """
        was, w.state = w.state, "ending"
        self._end(w, terminate=hung is not None)
        self._drain(w, pending, progress)  # what it sent before it ended
        w.conn.close()
        del self.workers[w.wid]
        self.finished.append(w)
        if w.task is None and w.proc.exitcode == 0:
            return
        why = hung or _exit_text(w.proc.exitcode)
        if hung:
            w.stats["hung"] += 1
        if w.task is not None and self._finished(w.task):
            # died after writing the chunk's output and marker, before saying so
            log.warning("%s died (%s) after finishing %s", w.label, why, w.task["name"])
            w.stats["chunks"] += 1
            w.stats["sequences"] += w.task["n"]
        elif w.task is not None:
            name = w.task["name"]
            self.attempts[name] += 1
            if progress is not None:
                progress.done -= w.partial
            if self.attempts[name] >= self.max_attempts:
                self._stop_all()
                hint = (
                    "a hung GPU or file system (or, if one batch can truly take that long, a longer deadline)"
                    if hung else "out-of-memory kills (a smaller tokens_per_batch helps)"
                )  # fmt: skip
                raise RuntimeError(
                    f"{name}: {self.attempts[name]} worker(s) died or hung computing it (last: {w.label}, {why}); "
                    f"giving up after extract.max_attempts = {self.max_attempts}. Finished chunks are kept; "
                    f"look for {hint} and run again"
                )
            log.warning("%s died (%s) while computing %s; the chunk goes back to the queue", w.label, why, name)
            pending.appendleft(w.task)
        else:
            log.warning("%s died (%s) %s", w.label, why, "while loading its model" if was in ("loading", "waiting") else "between chunks")
        self.failures[w.slot] += 1
        if pending and self.failures[w.slot] < self.max_attempts:
            log.info("starting a new worker in its place")
            self._start(w.slot)
        elif pending:
            log.warning("not replacing %s: %d worker(s) in a row died on its device", w.label, self.failures[w.slot])

    def _limit(self, w: _Worker) -> float | None:
        """Seconds ``w`` may stay silent now; None when it owes nothing (told to stop)."""
        return {"loading": self.load_deadline, "waiting": self.load_deadline, "busy": self.deadline}.get(w.state)

    def _timeout(self) -> float | None:
        """Seconds to the nearest deadline, so that a hang is noticed when it is due."""
        due = [w.since + limit for w in self.workers.values() if (limit := self._limit(w)) is not None]
        return max(0.0, min(due) - time.monotonic()) if due else None

    def _kill_hung(self, pending: deque, progress: Progress | None) -> None:
        """Kill and replace every worker without progress past its deadline.

        The sign of life is progress (a finished batch, counters of work that grew), not
        a heartbeat: a heartbeat thread in the worker would go on beating while its main
        thread is stuck in a CUDA call, and the hang would never be seen.
        """
        now = time.monotonic()
        for w in list(self.workers.values()):
            limit = self._limit(w)
            if limit is None or now - w.since < limit or w.conn.poll():
                continue  # (a message waiting in its pipe: not silent, read on the next pass)
            silent = now - w.since
            doing = {"loading": "loading its model", "waiting": "waiting for its turn to load"}.get(w.state) or f"computing {w.task['name']}"
            log.warning(
                "%s without progress for %.1f s while %s (%.1f s since it started; last counters %s), "
                "past its %g s deadline: taken for hung (not crashed), killing it",
                w.label, silent, doing, now - w.started, _counters_text(w.progress), limit,
            )  # fmt: skip
            self._gone(w, pending, progress, hung=f"killed after {silent:.1f} s without progress, past the {limit:g} s deadline")

    def _finished(self, chunk: dict) -> bool:
        """Whether the chunk's shard is in the cache (its name starts with the chunk's hash)."""
        return any(self.job.cache().shard_dir.glob(f"{chunk['sha256'][:16]}-*.done"))

    # ---------------------------------------------------------------- run
    def run(self, chunks: list[dict], progress: Progress | None = None) -> list[dict]:
        """Compute every chunk; per-worker statistics (label, chunks, sequences, seconds;
        ``hung``: 1 for a worker killed at its deadline)."""
        pending = deque(chunks)
        self.attempts = Counter()
        try:
            for slot in range(min(len(self.slots), len(pending))):
                self._start(slot)
            while pending or any(w.task is not None for w in self.workers.values()):
                if not self.workers:
                    raise RuntimeError(f"every extraction worker died; {len(pending)} chunk(s) left (see the log above)")
                by_conn = {w.conn: w for w in self.workers.values()}
                by_sentinel = {w.proc.sentinel: w for w in self.workers.values()}
                for obj in wait([*by_conn, *by_sentinel], timeout=self._timeout()):
                    if obj in by_conn:
                        w = by_conn[obj]
                        if w.wid not in self.workers:
                            continue
                        try:
                            msg = w.conn.recv()
                        except (EOFError, OSError):
                            self._gone(w, pending, progress)
                            continue
                        self._handle(w, msg, pending, progress)
                    else:
                        w = by_sentinel[obj]
                        if w.wid in self.workers:
                            self._gone(w, pending, progress)
                self._kill_hung(pending, progress)
            # every chunk is done: stopped workers exit by themselves, ones still
            # loading their model are not needed any more
            for w in list(self.workers.values()):
                if w.state == "stopped":
                    w.proc.join(timeout=2)
                self._end(w, terminate=True)
                self.finished.append(w)
            self.workers.clear()
        finally:
            self._stop_all()
        out = {}
        for w in self.finished:
            s = out.setdefault(w.label, Counter())
            s.update(w.stats)
        return [{"worker": label, **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in s.items()}} for label, s in out.items()]
