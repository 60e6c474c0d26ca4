"""Hung extraction workers: alive but silent, killed at their deadline and replaced.

A hang is simulated with the worker's test hook (``Job.hang_once``): the first worker to
create the hook's file sleeps forever, before its chunk's first batch or before its
model is ready. The pool runs 2 (or 1) spawned CPU workers with a tiny ESM-2; every
result is compared with an undisturbed run of :class:`~ampflow.extract.pool.InlinePool`.
"""

from __future__ import annotations

import json
import logging
import time

import anndata as ad
import numpy as np
import pytest

from ampflow.extract.config import ExtractSettings, ModelSpec
from ampflow.extract.pool import InlinePool
from ampflow.extract.run import extract_fasta
from extract_helpers import random_fasta, tiny_models_in

N = 300  # sequences; 25 per chunk: 12 chunks


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """The tiny ESM-2, a random FASTA, and the referee's vectors (InlinePool, no hang)."""
    folder = tiny_models_in(tmp_path_factory)["esm2"]
    root = tmp_path_factory.mktemp("faults")
    fasta = random_fasta(root / "in.fa", "esm2", N, seed=3, lengths=(5, 120))
    _, out = run(root, fasta, folder, "referee", pool=InlinePool)
    return folder, fasta, ad.read_h5ad(out / "x.h5ad").X


def run(tmp_path, fasta, folder, tag, cpu_workers=2, deadlines=None, **kw):
    out = tmp_path / tag
    settings = ExtractSettings.from_dict({"sequences_per_file": 25, "cpu_workers": cpu_workers, **(deadlines or {})})
    summary = extract_fasta(
        fasta, ModelSpec(kind="esm2", tiny=True), "esm2_tiny", out / "work", out / "x.h5ad", out / "report.tsv",
        out / "telemetry.jsonl", settings=settings, model_folder=folder, **kw,
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


def test_a_worker_hung_in_a_chunk_is_killed_and_replaced(case, tmp_path, caplog):
    """One of 2 workers hangs before its chunk's first batch: after the deadline it is
    killed, its chunk goes back to the queue, a new worker on its slot computes it."""
    folder, fasta, referee = case
    hook = tmp_path / "hang"
    caplog.set_level(logging.INFO, logger="ampflow.extract.pool")
    t0 = time.monotonic()
    summary, out = run(tmp_path, fasta, folder, "hung", hang={"hang_once": str(hook)}, deadlines={"deadline": 4})
    seconds = time.monotonic() - t0
    label, chunk = hook.read_text().rsplit(" ", 1)  # written by the worker that hung
    text = caplog.text
    print(f"hung: {label} on {chunk}; {seconds:.1f} s; workers {summary['workers']}")
    assert f"{label} silent for" in text and f"while computing {chunk}, past its 4 s deadline" in text
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
    assert seconds < 60


def test_a_worker_hung_loading_its_model_is_replaced(case, tmp_path, caplog):
    """The only worker never says ready: after load_deadline it is killed and replaced."""
    folder, fasta, referee = case
    hook = tmp_path / "hang"
    caplog.set_level(logging.INFO, logger="ampflow.extract.pool")
    t0 = time.monotonic()
    summary, out = run(
        tmp_path, fasta, folder, "hung_load", cpu_workers=1,
        hang={"hang_once": str(hook), "hang_in": "load"}, deadlines={"load_deadline": 12},
    )  # fmt: skip
    seconds = time.monotonic() - t0
    label = hook.read_text().removesuffix(" load")
    text = caplog.text
    print(f"hung loading: {label}; {seconds:.1f} s; workers {summary['workers']}")
    assert f"{label} silent for" in text and "while loading its model, past its 12 s deadline" in text
    assert f"{label} died (killed after" in text and "starting a new worker in its place" in text
    stats = {w["worker"]: w for w in summary["workers"]}
    assert stats[label] == {"worker": label, "hung": 1}
    assert [w.get("chunks") for w in stats.values() if w["worker"] != label] == [12]
    print(f"max abs difference to the referee {check_result(out, referee):.3g}")
    assert seconds < 60


def test_a_chunk_that_hangs_every_worker_ends_the_job(case, tmp_path):
    """Every worker hangs on its first chunk: after max_attempts (2) workers killed on it
    the job stops with a message naming the chunk and the deadline, not forever."""
    folder, fasta, _ = case
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        run(tmp_path, fasta, folder, "always", cpu_workers=1, hang={"hang_once": str(tmp_path / "hang"), "hang_times": 9}, deadlines={"deadline": 3})
    seconds = time.monotonic() - t0
    print(f"{seconds:.1f} s: {e.value}")
    assert str(e.value).startswith("chunk-00000: 2 worker(s) died or hung computing it")
    assert "past the 3 s deadline" in str(e.value) and "extract.max_attempts = 2" in str(e.value)
    assert sorted(p.name for p in tmp_path.glob("hang*")) == ["hang", "hang.1"]  # two workers, no third
    assert not (tmp_path / "always" / "x.h5ad").exists()
    assert seconds < 60
