"""Extraction at scale: the vector cache across files and runs, one queue over several
inputs, windows over long records, several layers and per-token outputs, OOM back-off.

Referees: vectors computed one sequence (or one window) at a time by a freshly loaded
model; counts of sequences written independently of the code (sets of letters); the
pool's own per-worker statistics against the chunks it was given.
"""

from __future__ import annotations

import logging
import random
from functools import partial
from pathlib import Path

import anndata as ad
import h5py
import numpy as np
import pytest
from extract_doubles import InlinePool, oom_worker, pool_class
from extract_helpers import random_fasta, tiny_models_in

from ampflow.extract import pool as pool_module
from ampflow.extract.config import ExtractSettings, ModelSpec
from ampflow.extract.models import load_embedder
from ampflow.extract.run import extract_model


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    return tiny_models_in(tmp_path_factory)


def records(path: Path) -> list[tuple[str, str]]:
    """(id, letters) of a FASTA file written by random_fasta, read plainly."""
    out = []
    for block in path.read_text().split(">")[1:]:
        head, *lines = block.splitlines()
        out.append((head.split()[0], "".join(lines)))
    return out


def write(path: Path, recs) -> Path:
    path.write_text("".join(f">{i}\n{s}\n" for i, s in recs))
    return path


def alone(kind, folder, seqs, layer=2, pooling=None) -> np.ndarray:
    """The referee: each sequence through the model by itself."""
    spec = ModelSpec(kind=kind, tiny=True, pooling=pooling)
    emb = load_embedder(spec, folder, [layer])
    product = f"L{layer}.{spec.poolings[0]}"
    return np.stack([emb.embed_batch(emb.tokenize([s]))[product][0] for s in seqs])


def test_prepending_a_record_computes_one_sequence_and_shared_ones_are_reused(tiny_models, tmp_path, caplog):
    """2,000 records, then the same file with one record prepended: 1 sequence computed.
    A second input sharing half its sequences with the first: only the other half."""
    caplog.set_level(logging.INFO, logger="ampflow.extract.run")
    fasta = random_fasta(tmp_path / "a.fa", "esm2", 2000, seed=5, lengths=(5, 40))
    settings = ExtractSettings(sequences_per_file=500, cpu_workers=1, cache=str(tmp_path / "cache"))
    spec = ModelSpec(kind="esm2", tiny=True)

    def run(inputs, tag):
        caplog.clear()
        with pool_class(InlinePool):
            job = extract_model(inputs, spec, "esm", tmp_path / "work", tmp_path / tag, settings, model_folder=tiny_models["esm2"])
        line = [r.getMessage() for r in caplog.records if "to compute in" in r.getMessage()]
        return job["run"], line[0]

    first, _ = run({"a": {"fasta": fasta}}, "first")
    assert (first["computed"], first["cached"]) == (2000, 0)
    recs = records(fasta)
    write(fasta, [("new", "MKTAYIAKQRQISFVKSHFSRQ"), *recs])
    again, line = run({"a": {"fasta": fasta}}, "prepended")
    print(f"\nprepended 1 record to 2,000: {line}")
    assert (again["computed"], again["cached"]) == (1, 2000)
    assert "2000 found in the cache, 1 to compute" in line
    a = ad.read_h5ad(tmp_path / "prepended" / "a.esm.h5ad")
    b = ad.read_h5ad(tmp_path / "first" / "a.esm.h5ad")
    assert list(a.obs_names) == ["new", *b.obs_names] and np.array_equal(a.X[1:], b.X)
    np.testing.assert_allclose(a.X[0], alone("esm2", tiny_models["esm2"], ["MKTAYIAKQRQISFVKSHFSRQ"])[0], atol=1e-6)

    # a second sample: 500 records shared with the first, 500 of its own
    rng = random.Random(9)
    own = [(f"b{i}", "".join(rng.choice("ACDEFGHIKLMNPQRSTVWY") for _ in range(rng.randint(41, 80)))) for i in range(500)]
    shared = recs[::4]
    mixed = [x for pair in zip(shared, own) for x in pair]
    second = write(tmp_path / "b.fa", mixed)
    expect_new = len({s for _, s in own} - {s for _, s in recs})
    run_b, line = run({"a": {"fasta": fasta}, "b": {"fasta": second}}, "both")
    print(f"second input sharing {len(shared)} of {len(mixed)} sequences: {line}")
    assert run_b["computed"] == expect_new == 500
    vb = ad.read_h5ad(tmp_path / "both" / "b.esm.h5ad")
    assert list(vb.obs_names) == [i for i, _ in mixed]
    np.testing.assert_array_equal(vb.X[::2], b.X[::4])
    np.testing.assert_allclose(vb.X[1:40:2], alone("esm2", tiny_models["esm2"], [s for _, s in own[:20]]), atol=1e-5)


@pytest.mark.slow
def test_two_inputs_fill_four_workers(tiny_models, tmp_path, caplog):
    """Two inputs of 3,000 sequences, one job, 4 CPU workers: one queue over both, every
    worker computes chunks; the outputs per input are as if each ran alone."""
    from ampflow.extract.tiny import write_esm2

    caplog.set_level(logging.INFO)
    # wider than the tiny model: the chunks take longer than loading a model
    folder = write_esm2(tmp_path / "model", hidden=160, layers=4, heads=8, intermediate=640)
    a = random_fasta(tmp_path / "a.fa", "esm2", 3000, seed=1, lengths=(20, 80))
    b = random_fasta(tmp_path / "b.fa", "esm2", 3000, seed=2, lengths=(20, 80))
    settings = ExtractSettings(cpu_workers=4, cache=str(tmp_path / "cache"))  # sequences_per_file 10,000
    job = extract_model(
        {"a": {"fasta": a}, "b": {"fasta": b}}, ModelSpec(kind="esm2", tiny=True), "esm", tmp_path / "work", tmp_path / "out",
        settings, model_folder=folder,
    )  # fmt: skip
    workers = job["run"]["workers"]
    counts = {w["worker"]: (w.get("chunks", 0), w.get("sequences", 0)) for w in workers}
    print(f"\n{job['run']['chunks']} chunks over 4 workers (chunks, sequences): {counts}")
    assert len(counts) == 4 and all(c >= 1 for c, _ in counts.values())
    assert sum(s for _, s in counts.values()) == job["run"]["computed"] == len({s for _, s in records(a) + records(b)})
    assert sum(c for c, _ in counts.values()) == job["run"]["chunks"] >= 8
    loads = [r for r in caplog.records if "model loaded" in r.getMessage()]
    assert len(loads) <= 4  # each worker loads the model once for both inputs
    for name, path in (("a", a), ("b", b)):
        got = ad.read_h5ad(tmp_path / "out" / f"{name}.esm.h5ad")
        assert list(got.obs_names) == [i for i, _ in records(path)]
        idx = [0, 1234, 2999]
        np.testing.assert_allclose(got.X[idx], alone("esm2", folder, [records(path)[i][1] for i in idx], layer=4), atol=1e-5)


def test_a_100kb_record_in_windows(tiny_models, tmp_path):
    """A 100 kb contig under too_long: window (2,000 bp windows, 200 bp overlap): one row
    per window with its coordinates, equal to embedding each window alone; the record's
    row is their letter-weighted mean; short records stay whole."""
    rng = random.Random(4)
    contig = "".join(rng.choice("ACGT") for _ in range(100_000))
    short = "".join(rng.choice("ACGT") for _ in range(700))
    fasta = write(tmp_path / "contigs.fa", [("contig1", contig), ("short1", short)])
    spec = ModelSpec(kind="dnabert_s", tiny=True, max_length=2000)
    settings = ExtractSettings(cpu_workers=1, cache=str(tmp_path / "cache"))
    with pool_class(InlinePool):
        extract_model(
            {"v": {"fasta": fasta, "policy": {"too_long": "window", "overlap": 200}}}, spec, "dna", tmp_path / "work", tmp_path / "out",
            settings, model_folder=tiny_models["dnabert_s"],
        )  # fmt: skip
    w = ad.read_h5ad(tmp_path / "out" / "v.dna.windows.h5ad")
    starts = list(range(0, 100_000 - 2000, 1800)) + [98_000]
    assert list(w.obs["parent"]) == ["contig1"] * len(starts) + ["short1"]
    assert list(w.obs["start"]) == [*starts, 0] and list(w.obs["end"]) == [s + 2000 for s in starts] + [700]
    assert w.obs_names[0] == "contig1:0-2000" and w.obs_names[-1] == "short1:0-700"
    pieces = [contig[s : s + 2000] for s in starts] + [short]
    ref = alone("dnabert_s", tiny_models["dnabert_s"], pieces)
    diff = float(np.abs(w.X - ref).max())
    print(f"\n{len(starts)} windows of the 100 kb record + 1 short record: max abs difference to each window alone {diff:.2g}")
    assert diff < 1e-5
    r = ad.read_h5ad(tmp_path / "out" / "v.dna.h5ad")
    assert list(r.obs_names) == ["contig1", "short1"] and list(r.obs["windows"]) == [len(starts), 1]
    assert list(r.obs["original_length"]) == [100_000, 700] and not r.obs["truncated"].any()
    np.testing.assert_allclose(r.X[0], ref[:-1].mean(0), atol=1e-5)  # windows all 2,000 letters: weights equal
    np.testing.assert_allclose(r.X[1], ref[-1], atol=1e-6)
    report = (tmp_path / "out" / "v.dna.report.tsv").read_text()
    assert "too_long\twindowed" in report and f"{len(starts)} windows" in report


def test_layers_poolings_and_tokens_in_one_pass(tiny_models, tmp_path):
    """layer [1, -1], pooling [mean, bos], per_token: X is the first product, obsm holds
    each, tokens.h5 each own token's vector per layer; all equal to one sequence alone."""
    fasta = random_fasta(tmp_path / "p.fa", "esm2", 30, seed=7, lengths=(5, 90))
    spec = ModelSpec(kind="esm2", tiny=True, layer=[1, -1], pooling=["mean", "bos"], per_token=True)
    with pool_class(InlinePool):
        extract_model(
            {"p": {"fasta": fasta}}, spec, "esm", tmp_path / "work", tmp_path / "out", ExtractSettings(cpu_workers=1),
            model_folder=tiny_models["esm2"],
        )  # fmt: skip
    a = ad.read_h5ad(tmp_path / "out" / "p.esm.h5ad")
    seqs = [s for _, s in records(fasta)]
    assert sorted(a.obsm) == ["L1.bos", "L1.mean", "L2.bos", "L2.mean"]
    np.testing.assert_array_equal(a.X, a.obsm["L1.mean"])
    for layer in (1, 2):
        for pooling in ("mean", "bos"):
            np.testing.assert_allclose(a.obsm[f"L{layer}.{pooling}"], alone("esm2", tiny_models["esm2"], seqs, layer, pooling), atol=1e-5)
    emb = load_embedder(ModelSpec(kind="esm2", tiny=True), tiny_models["esm2"], [1, 2])
    with h5py.File(tmp_path / "out" / "p.esm.tokens.h5") as f:
        offsets = f["offsets"][:]
        assert [x.decode() for x in f["ids"][:]] == list(a.obs_names)
        assert list(np.diff(offsets)) == [len(s) for s in seqs]
        for i in (0, 17, 29):
            import torch

            ids = torch.tensor([emb.tokenize([seqs[i]])[0].ids])
            with torch.no_grad():
                hs = emb.model(input_ids=ids, output_hidden_states=True)
            np.testing.assert_allclose(f["L1"][offsets[i] : offsets[i + 1]], hs.hidden_states[1][0, 1:-1].numpy(), atol=1e-5)
            np.testing.assert_allclose(f["L2"][offsets[i] : offsets[i + 1]], hs.last_hidden_state[0, 1:-1].numpy(), atol=1e-5)


def test_injected_oom_splits_batches_and_changes_no_vector(tiny_models, tmp_path):
    """Batches of more than 100 padded tokens run out of memory (as a full GPU would):
    the job finishes, each such batch is split until it fits, the shards' markers and the
    progress say which, and every vector equals an unforced run's. (Short proteins: the
    CPU's plan batches only those.)"""
    fasta = random_fasta(tmp_path / "p.fa", "esm2", 120, seed=8, lengths=(20, 46))
    spec = ModelSpec(kind="esm2", tiny=True, tokens_per_batch=4096)

    def run(tag, oom_above=None):
        settings = ExtractSettings(cpu_workers=2, cache=str(tmp_path / tag / "cache"))
        with pytest.MonkeyPatch.context() as m:
            if oom_above is not None:  # the spawned workers: each patches its own Embedder
                m.setattr(pool_module, "worker_main", partial(oom_worker, tokens=oom_above))
            job = extract_model({"p": {"fasta": fasta}}, spec, "esm", tmp_path / tag / "work", tmp_path / tag, settings,
                                model_folder=tiny_models["esm2"])  # fmt: skip
        return job, ad.read_h5ad(tmp_path / tag / "p.esm.h5ad")

    _, plain = run("plain")
    job, forced = run("forced", oom_above=100)
    splits = [s for m in (tmp_path / "forced" / "cache").glob("*/shards/*.done") for s in __import__("json").loads(m.read_text())["splits"]]
    print(f"\n{len(splits)} batch(es) split after an injected OOM; e.g. {splits[:2]}; workers {job['run']['workers']}")
    assert splits and all(s["padded_tokens"] > 100 for s in splits)
    assert sum(w.get("splits", 0) for w in job["run"]["workers"]) == len(splits)
    progress = (tmp_path / "forced" / "p.esm.progress.jsonl").read_text()
    assert '"splits": 0' in progress and any(f'"splits": {n}' in progress for n in range(1, 100))
    np.testing.assert_allclose(forced.X, plain.X, atol=1e-6)


def _job_in_process(inputs, work, out, cache, folder, q):
    from extract_doubles import InlinePool, pool_class

    from ampflow.extract.config import ExtractSettings, ModelSpec
    from ampflow.extract.run import extract_model

    with pool_class(InlinePool):
        job = extract_model(inputs, ModelSpec(kind="esm2", tiny=True), "esm", work, out, ExtractSettings(cpu_workers=1, cache=cache),
                            model_folder=folder)  # fmt: skip
    q.put(job["run"]["computed"])


def test_two_jobs_share_one_cache_at_once(tiny_models, tmp_path):
    """Two jobs (two processes, two work folders) run at the same time on inputs sharing
    400 sequences, into one cache: both finish, each output equals one sequence alone,
    and a third run finds everything cached."""
    import multiprocessing as mp

    shared = random_fasta(tmp_path / "s.fa", "esm2", 400, seed=11, lengths=(5, 60))
    own_a = [(f"a{i}", s) for i, (_, s) in enumerate(records(random_fasta(tmp_path / "x.fa", "esm2", 100, seed=12, lengths=(61, 90))))]
    own_b = [(f"b{i}", s) for i, (_, s) in enumerate(records(random_fasta(tmp_path / "y.fa", "esm2", 100, seed=13, lengths=(91, 120))))]
    a = write(tmp_path / "a.fa", records(shared) + own_a)
    b = write(tmp_path / "b.fa", own_b + records(shared))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    cache = str(tmp_path / "cache")
    procs = [
        ctx.Process(target=_job_in_process, args=({n: {"fasta": str(f)}}, str(tmp_path / f"w{n}"), str(tmp_path / "out"), cache, str(tiny_models["esm2"]), q))
        for n, f in (("a", a), ("b", b))
    ]  # fmt: skip
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    computed = sorted(q.get(timeout=5) for _ in procs)
    print(f"\ntwo jobs at once, 400 shared sequences: computed {computed}")
    # each its own 100 at least, its 500 at most (racing on the shared ones is allowed)
    assert all(100 <= c <= 500 for c in computed)
    for name, path in (("a", a), ("b", b)):
        got = ad.read_h5ad(tmp_path / "out" / f"{name}.esm.h5ad")
        recs = records(path)
        assert list(got.obs_names) == [i for i, _ in recs]
        np.testing.assert_allclose(got.X, alone("esm2", tiny_models["esm2"], [s for _, s in recs]), atol=1e-5)
    q2 = ctx.Queue()
    _job_in_process({"a": {"fasta": str(a)}, "b": {"fasta": str(b)}}, str(tmp_path / "w3"), str(tmp_path / "out3"), cache, str(tiny_models["esm2"]), q2)
    assert q2.get() == 0


def test_the_model_fingerprint_is_hashed_once_per_change(tiny_models, tmp_path, monkeypatch):
    """The fingerprint is read from the work folder while the model's files keep their
    names, sizes and times; a file touched is hashed again."""
    import os
    import shutil

    from ampflow.extract import models

    folder = shutil.copytree(tiny_models["esm2"], tmp_path / "m")
    first = models.cached_fingerprint(folder, tmp_path / "w")
    assert first == models.fingerprint(folder)

    def no_hash(_):
        raise AssertionError("hashed again")

    monkeypatch.setattr(models, "fingerprint", no_hash)
    assert models.cached_fingerprint(folder, tmp_path / "w") == first
    weights = folder / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    with pytest.raises(AssertionError, match="hashed again"):
        models.cached_fingerprint(folder, tmp_path / "w")
