"""Hung extraction workers: alive but without progress, killed at their deadline and
replaced; slow ones that go on making progress are left alone.

Hangs and slow loads are test doubles of the worker process (``extract_doubles.py``),
put in the pool's place with monkeypatch: the first worker to create the hook's file
sleeps forever, before its chunk's first batch or before its model is loaded, or reads
its weights slowly. The pool runs 2 (or 1) spawned CPU workers with a tiny ESM-2; every
result is compared with an undisturbed run of :class:`~extract_doubles.InlinePool`.

No test bounds its wall time: on a loaded node (``stress --cpu 4`` on 2 cores) starting a
worker takes several times as long, and the deadlines, counted from the last progress,
are what is under test.
"""

from __future__ import annotations

import json
import logging
import re
import time
from functools import partial

import anndata as ad
import numpy as np
import pytest
from extract_doubles import InlinePool, hanging_worker, pool_class, slow_loading_worker
from extract_helpers import random_fasta, tiny_models_in

from ampflow.extract import pool as pool_module
from ampflow.extract.config import ExtractSettings, ModelSpec
from ampflow.extract.run import extract_fasta

N = 300  # sequences; 25 per chunk: 12 chunks


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """The tiny ESM-2, a random FASTA, and the referee's vectors (InlinePool, no hang)."""
    folder = tiny_models_in(tmp_path_factory)["esm2"]
    root = tmp_path_factory.mktemp("faults")
    fasta = random_fasta(root / "in.fa", "esm2", N, seed=3, lengths=(5, 120))
    _, out = run(root, fasta, folder, "referee", pool=InlinePool)
    return folder, fasta, ad.read_h5ad(out / "x.h5ad").X


def run(tmp_path, fasta, folder, tag, cpu_workers=2, deadlines=None, pool=None):
    out = tmp_path / tag
    settings = ExtractSettings.from_dict({"sequences_per_file": 25, "cpu_workers": cpu_workers, **(deadlines or {})})
    with pool_class(pool):
        summary = extract_fasta(
            fasta, ModelSpec(kind="esm2", tiny=True), "esm2_tiny", out / "work", out / "x.h5ad", out / "report.tsv",
            out / "telemetry.jsonl", settings=settings, model_folder=folder,
        )  # fmt: skip
    return summary["run"], out


def shard_of(out, chunk) -> dict:
    """The marker of the cache shard computed from queue chunk ``chunk``."""
    marks = [json.loads(p.read_text()) for p in (out / "work" / "cache").glob("*/shards/*.done")]
    (m,) = [m for m in marks if m["chunk"] == chunk]
    return m


def check_result(out, referee) -> float:
    """Every sequence once, in input order, equal to the referee; the largest difference."""
    a = ad.read_h5ad(out / "x.h5ad")
    assert list(a.obs_names) == [f"s{i}" for i in range(N)]
    diff = float(np.abs(a.X - referee).max())
    assert diff < 1e-6
    return diff


def workers_are(monkeypatch, double, **kw) -> None:
    """The pool spawns ``double`` (from extract_doubles) instead of the real worker."""
    monkeypatch.setattr(pool_module, "worker_main", partial(double, **kw))


def test_a_worker_hung_in_a_chunk_is_killed_and_replaced(case, tmp_path, caplog, monkeypatch):
    """One of 2 workers hangs before its chunk's first batch: after the deadline it is
    killed, its chunk goes back to the queue, a new worker on its slot computes it."""
    folder, fasta, referee = case
    hook = tmp_path / "hang"
    caplog.set_level(logging.INFO, logger="ampflow.extract.pool")
    workers_are(monkeypatch, hanging_worker, hook=str(hook))
    t0 = time.monotonic()
    summary, out = run(tmp_path, fasta, folder, "hung", deadlines={"deadline": 4})
    seconds = time.monotonic() - t0
    label, chunk = hook.read_text().rsplit(" ", 1)  # written by the worker that hung
    text = caplog.text
    print(f"hung: {label} on {chunk}; {seconds:.1f} s; workers {summary['workers']}")
    assert f"{label} without progress for" in text and f"while computing {chunk} (" in text and "past its 4 s deadline" in text
    assert f"{label} died (killed after" in text and f"deadline) while computing {chunk}; the chunk goes back" in text
    assert "starting a new worker in its place" in text
    stats = {w["worker"]: w for w in summary["workers"]}
    assert stats[label].get("hung") == 1 and len(stats) == 3
    assert sum(w.get("hung", 0) for w in stats.values()) == 1
    assert sum(w.get("chunks", 0) for w in stats.values()) == 12 and summary["chunks"] == 12
    redone_by = shard_of(out, chunk)["worker"]
    assert redone_by != label and redone_by in stats
    diff = check_result(out, referee)
    print(f"max abs difference to the referee {diff:.3g}; chunk {chunk} redone by {redone_by}")


def test_a_worker_hung_loading_its_model_is_replaced(case, tmp_path, caplog, monkeypatch):
    """The only worker never says ready: after load_deadline without progress it is
    killed and replaced."""
    folder, fasta, referee = case
    hook = tmp_path / "hang"
    caplog.set_level(logging.INFO, logger="ampflow.extract.pool")
    workers_are(monkeypatch, hanging_worker, hook=str(hook), phase="load")
    t0 = time.monotonic()
    summary, out = run(tmp_path, fasta, folder, "hung_load", cpu_workers=1, deadlines={"load_deadline": 12})
    seconds = time.monotonic() - t0
    label = hook.read_text().removesuffix(" load")
    text = caplog.text
    print(f"hung loading: {label}; {seconds:.1f} s; workers {summary['workers']}")
    assert f"{label} without progress for" in text and "while loading its model (" in text and "past its 12 s deadline" in text
    assert f"{label} died (killed after" in text and "starting a new worker in its place" in text
    stats = {w["worker"]: w for w in summary["workers"]}
    assert stats[label] == {"worker": label, "hung": 1}
    assert [w.get("chunks") for w in stats.values() if w["worker"] != label] == [12]
    # the replacement's load may take longer than load_deadline (a loaded node), never
    # that long without progress
    ((_, loaded, quiet),) = [m.groups() for r in caplog.records if (m := LOADED.search(r.getMessage()))]
    print(f"the replacement loaded in {loaded} s, at most {quiet} s without progress (load_deadline 12 s)")
    assert float(quiet) < 12
    print(f"max abs difference to the referee {check_result(out, referee):.3g}")


def test_a_chunk_that_hangs_every_worker_ends_the_job(case, tmp_path, monkeypatch):
    """Every worker hangs on its first chunk: after max_attempts (2) workers killed on it
    the job stops with a message naming the chunk and the deadline, not forever."""
    folder, fasta, _ = case
    workers_are(monkeypatch, hanging_worker, hook=str(tmp_path / "hang"), times=9)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        run(tmp_path, fasta, folder, "always", cpu_workers=1, deadlines={"deadline": 3})
    seconds = time.monotonic() - t0
    print(f"{seconds:.1f} s: {e.value}")
    assert str(e.value).startswith("chunk-00000: 2 worker(s) died or hung computing it")
    assert "past the 3 s deadline" in str(e.value) and "extract.max_attempts = 2" in str(e.value)
    assert sorted(p.name for p in tmp_path.glob("hang*")) == ["hang", "hang.1"]  # two workers, no third
    assert not (tmp_path / "always" / "x.h5ad").exists()


LOAD = 6  # the slow-loading tests' extract.load_deadline (seconds)
LOADED = re.compile(r"(worker \d+ \(cpu\)): model loaded in ([\d.]+) s, at most ([\d.]+) s without progress")


def test_a_worker_that_loads_slowly_but_makes_progress_is_not_killed(case, tmp_path, caplog, monkeypatch):
    """The only worker reads its weights slowly for 3 x load_deadline before its model is
    loaded: bytes read are progress, so it is not killed and computes every chunk."""
    folder, fasta, referee = case
    caplog.set_level(logging.INFO, logger="ampflow.extract.pool")
    workers_are(monkeypatch, slow_loading_worker, seconds=3 * LOAD)
    summary, out = run(tmp_path, fasta, folder, "slow_load", cpu_workers=1, deadlines={"load_deadline": LOAD})
    (loaded,) = [m for r in caplog.records if (m := LOADED.search(r.getMessage()))]
    label, seconds, quiet = loaded.group(1), float(loaded.group(2)), float(loaded.group(3))
    print(f"{label}: loaded in {seconds:.1f} s, at most {quiet:.1f} s without progress (load_deadline {LOAD} s)")
    assert seconds >= 3 * LOAD and quiet < LOAD
    assert "without progress for" not in caplog.text
    assert [{k: w.get(k) for k in ("worker", "hung", "chunks")} for w in summary["workers"]] == [{"worker": label, "hung": None, "chunks": 12}]
    check_result(out, referee)


def test_a_loading_worker_that_stops_making_progress_is_killed(case, tmp_path, caplog, monkeypatch):
    """The only worker reads its weights slowly for 1.5 x load_deadline (alive past the
    deadline: reading is progress), then stops: it is killed within load_deadline + 5 s
    of its last byte read, and its replacement loads and computes every chunk."""
    folder, fasta, referee = case
    hook = tmp_path / "stall"
    caplog.set_level(logging.INFO, logger="ampflow.extract.pool")
    workers_are(monkeypatch, slow_loading_worker, seconds=3 * LOAD, hook=str(hook), stall_after=1.5 * LOAD)
    summary, out = run(tmp_path, fasta, folder, "stalled_load", cpu_workers=1, deadlines={"load_deadline": LOAD})
    stalled = json.loads(hook.read_text())
    label = stalled["label"]
    (kill,) = [r for r in caplog.records if r.getMessage().startswith(f"{label} without progress for")]
    after = kill.created - stalled["stopped"]
    lived = float(re.search(r"\(([\d.]+) s since it started", kill.getMessage()).group(1))
    print(f"{label} stopped after {stalled['read']} bytes; killed {after:.1f} s later, {lived:.1f} s after it started: {kill.getMessage()}")
    assert LOAD - 1.5 <= after <= LOAD + 5
    assert lived >= 1.5 * LOAD + LOAD - 1.5 > LOAD  # not counted from its start
    assert f"past its {LOAD} s deadline" in kill.getMessage() and "while loading its model" in kill.getMessage()
    stats = {w["worker"]: w for w in summary["workers"]}
    assert stats[label] == {"worker": label, "hung": 1}
    assert [w.get("chunks") for w in stats.values() if w["worker"] != label] == [12]
    check_result(out, referee)


def test_progress_counts_work_not_time(tmp_path):
    """The worker's progress reporter sends counters only when the main thread got work
    done (a file read, a module imported, a batch), not while it sleeps: a main thread
    hung in a call leaves it silent although its own thread is alive."""
    from ampflow.extract.worker import ProgressReporter

    sent = []
    reporter = ProgressReporter(7, sent.append, interval=0.05).start()
    try:
        time.sleep(0.3)
        assert len(sent) == 1 and sent[0][:2] == ("progress", 7)  # the first look
        first = sent[0][2]
        assert first["read"] > 0 and first["modules"] > 0 and first["batches"] == 0
        time.sleep(0.5)  # a sleep: no work, no message
        assert len(sent) == 1
        (tmp_path / "f").write_bytes(b"x" * 100_000)
        (tmp_path / "f").read_bytes()
        time.sleep(0.3)
        assert len(sent) == 2 and sent[1][2]["read"] >= first["read"] + 100_000
        reporter.batch()
        time.sleep(0.3)
        assert len(sent) == 3 and sent[2][2]["batches"] == 1
        time.sleep(0.5)
        assert len(sent) == 3
    finally:
        reporter.stop()


def test_a_worker_waiting_for_its_turn_to_load_says_so(tmp_path):
    """GPU workers load one after another (a file lock): one that finds the lock taken
    says ``waiting`` before it blocks (no progress of its own: the pool counts the
    loading worker's) and ``turn`` once the lock is its own."""
    import fcntl
    import threading

    from ampflow.extract.worker import ProgressReporter, load_turn

    sent = []
    reporter = ProgressReporter(3, sent.append, interval=3600)  # no thread: only what load_turn says
    path = tmp_path / "model-load.lock"
    holder = open(path, "w")
    fcntl.flock(holder, fcntl.LOCK_EX)
    got = threading.Event()

    def load():
        with load_turn(path, reporter):
            got.set()

    t = threading.Thread(target=load)
    t.start()
    time.sleep(0.5)
    assert [m[0] for m in sent] == ["waiting"] and not got.is_set()
    holder.close()  # the lock is free (as when the loading worker dies or is done)
    t.join(10)
    assert got.is_set() and [m[0] for m in sent] == ["waiting", "turn"]
    with load_turn(path, reporter):  # free: no message
        pass
    assert len(sent) == 2
