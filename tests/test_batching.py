"""Batch plans (GPU: token and attention budgets; CPU: short near-equal sequences only) and
the out-of-memory back-off that halves a batch instead of failing the job."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from extract_helpers import tiny_models_in

from ampflow.base.errors import InputError
from ampflow.extract.batching import (
    CPU_MIN_SHARE,
    CPU_SHORT_TOKENS,
    CPU_TOKENS_PER_BATCH,
    REFERENCE_TOKENS,
    embed_with_backoff,
    plan_batches,
    token_budget_batches,
)
from ampflow.extract.config import ModelSpec
from ampflow.extract.models import load_embedder

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def esm(tmp_path_factory):
    """A real tiny ESM-2 Embedder and 40 random proteins of 3-300 residues."""
    emb = load_embedder(ModelSpec(kind="esm2", tiny=True), tiny_models_in(tmp_path_factory)["esm2"], [2])
    rng = random.Random(1)
    seqs = ["".join(rng.choice("ACDEFGHIKLMNPQRSTVWY") for _ in range(rng.randint(3, 300))) for _ in range(40)]
    return emb, seqs


def check_plan(lengths, batches):
    """Every index exactly once, longest first, ties in input order."""
    flat = [i for b in batches for i in b]
    assert flat == sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


# ------------------------------------------------------------------ GPU plan
@pytest.mark.parametrize("seed", range(20))
def test_gpu_plan_holds_both_limits(seed):
    rng = random.Random(seed)
    lengths = [rng.choice([rng.randint(1, 60), rng.randint(1, 3000)]) for _ in range(rng.randint(0, 300))]
    tokens, attention = rng.choice([1, 64, 512, 4096, 20000]), rng.choice([None, 1, 10**4, 10**6, 4 * 10**6])
    batches = plan_batches(lengths, "cuda", tokens, attention)
    check_plan(lengths, batches)
    limit = tokens * REFERENCE_TOKENS if attention is None else attention
    for b in batches:
        s = lengths[b[0]]
        assert len(b) == 1 or (len(b) * s <= tokens and len(b) * s * s <= limit)
    assert batches == plan_batches(list(lengths), "cuda", tokens, attention)


def test_default_attention_leaves_esm2_batches_alone():
    """ESM-2 reads at most 1024 tokens: its batches are those of the token budget alone."""
    rng = random.Random(0)
    for budget in (1024, 4096, 16384):
        lengths = [rng.randint(3, 1024) for _ in range(500)]
        assert plan_batches(lengths, "cuda", budget) == token_budget_batches(lengths, budget)


def test_attention_limit_splits_long_dna():
    """DNABERT-S reads 10,000 letters (~2,000 tokens): two fit 4096 tokens, but their
    attention (2 x 2002^2) is twice the largest ESM-2 batch's (4 x 1024^2)."""
    lengths = [2002, 1990, 1500, 1450, 300, 290]
    assert token_budget_batches(lengths, 4096)[:2] == [[0, 1], [2, 3]]
    batches = plan_batches(lengths, "cuda", 4096)
    assert batches[:4] == [[0], [1], [2], [3]]
    assert batches[4:] == [[4, 5]]  # short ones still share a batch
    assert plan_batches(lengths, "cuda", 4096, attention_per_batch=10**8)[:2] == [[0, 1], [2, 3]]


# ------------------------------------------------------------------ CPU plan
@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("kind", ["esm2", "dnabert_s", None])
def test_cpu_plan_batches_only_short_near_equal_sequences(seed, kind):
    rng = random.Random(seed)
    lengths = [rng.randint(3, 1024) if rng.random() < 0.5 else rng.randint(3, 150) for _ in range(300)]
    batches = plan_batches(lengths, "cpu", 4096, kind=kind)
    check_plan(lengths, batches)
    short = CPU_SHORT_TOKENS["esm2" if kind is None else kind]
    for b in batches:
        s = lengths[b[0]]
        if len(b) > 1:
            assert s <= short and len(b) * s <= CPU_TOKENS_PER_BATCH
            assert all(lengths[i] >= CPU_MIN_SHARE * s for i in b)
    assert any(len(b) > 1 for b in batches)  # short near-equal ones do share
    # tokens_per_batch still caps it; 1 = one at a time; the GPU rule is a different one
    assert all(len(b) * lengths[b[0]] <= 30 or len(b) == 1 for b in plan_batches(lengths, "cpu", 30, kind=kind))
    assert all(len(b) == 1 for b in plan_batches(lengths, "cpu", 1, kind=kind))
    assert plan_batches(lengths, "cpu", 4096, kind=kind) != plan_batches(lengths, "cuda", 4096, kind=kind)
    assert plan_batches([], "cpu", 4096, kind=kind) == plan_batches([], "cuda", 4096, kind=kind) == []


def test_cpu_plan_of_dna_reads_batches_them():
    """Reads of one length (VirNucPro's 300 bp, ~80 tokens) share batches for DNABERT-S,
    where that measured 1.14-1.21x; ESM-2 proteins of that length run alone (0.87-0.94x)."""
    lengths = [82, 80, 86, 77, 84, 81]
    assert plan_batches(lengths, "cpu", 4096, kind="dnabert_s") == [[2, 4], [0, 5, 1], [3]]
    assert plan_batches(lengths, "cpu", 4096, kind="esm2") == [[i] for i in (2, 4, 0, 5, 1, 3)]
    assert plan_batches(lengths, "cpu", 4096) == plan_batches(lengths, "cpu", 4096, kind="esm2")


# ------------------------------------------------------------------ back-off
def forced(emb, toks, limit, calls=None):
    """``embed_batch`` over token lists that raises torch's OOM above ``limit`` padded
    tokens, as a GPU with less memory would."""

    def embed_batch(b):
        padded = len(b) * max(len(toks[i].ids) for i in b)
        if calls is not None:
            calls.append(list(b))
        if padded > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {padded} tokens")
        return emb.embed_batch([toks[i] for i in b])["L2.mean"]

    return embed_batch


def test_backoff_equals_the_unforced_run(esm):
    emb, seqs = esm
    toks = emb.tokenize(seqs)
    lengths = [len(t.ids) for t in toks]
    batches = plan_batches(lengths, "cuda", 4096)
    referee, none = embed_with_backoff(batches, forced(emb, toks, 10**9), lengths, emb.dim)
    assert none == []
    done, splits_seen, calls = [], [], []
    out, splits = embed_with_backoff(batches, forced(emb, toks, 700, calls), lengths, emb.dim, done.append, splits_seen.append)
    # batches that were not split are computed as in the unforced run: the same bits; the
    # halves' other padding changes only the rounding (attention never sees padding)
    split = {r["batch"] for r in splits}
    kept = [i for k, b in enumerate(batches) if k not in split for i in b]
    assert kept and np.array_equal(out[kept], referee[kept])
    np.testing.assert_allclose(out, referee, rtol=0, atol=1e-6)
    assert sorted(i for b in done for i in b) == list(range(len(seqs)))
    assert splits == splits_seen and splits
    # the records: every planned batch over the limit (depth 0), then its halves still over it
    too_large = [k for k, b in enumerate(batches) if len(b) * lengths[b[0]] > 700]
    assert [r for r in splits if r["depth"] == 0] == [
        {"batch": k, "sequences": len(batches[k]), "padded_tokens": len(batches[k]) * lengths[batches[k][0]], "depth": 0} for k in too_large
    ]
    assert all(r["padded_tokens"] > 700 and r["sequences"] > 1 and r["batch"] in too_large for r in splits)
    for b in calls:  # halves keep length order: every call is a run of the plan's order
        assert [lengths[i] for i in b] == sorted((lengths[i] for i in b), reverse=True)


def test_backoff_in_embedder_embed(esm):
    """Embedder.embed (plan, back-off, statistics) on an Embedder whose embed_batch runs
    out of memory above 100 padded tokens as older torch says it (short proteins, so
    that the CPU plan of this CPU-only test batches them): same vectors as one at a time."""
    emb, _ = esm
    rng = random.Random(2)
    seqs = ["".join(rng.choice("ACDEFGHIKLMNPQRSTVWY") for _ in range(rng.randint(24, 27))) for _ in range(30)]

    class SmallGpu(type(emb)):
        def embed_batch(self, batch):
            if len(batch) * max(len(t.ids) for t in batch) > 100:
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")  # older torch's wording
            return super().embed_batch(batch)

    small = SmallGpu.__new__(SmallGpu)
    small.__dict__.update(emb.__dict__)
    seen = []
    out, stats = small.embed(seqs, on_batch=lambda n, real, padded: seen.append(n))
    ref = np.concatenate([emb.embed_batch([t])["L2.mean"] for t in emb.tokenize(seqs)])
    np.testing.assert_allclose(out["L2.mean"], ref, rtol=0, atol=1e-5)
    assert stats["splits"] and stats["tokens"] == sum(len(s) + 2 for s in seqs) and sum(seen) == len(seqs)
    assert stats["batches"] == len(plan_batches([len(s) + 2 for s in seqs], "cpu", 4096, kind="esm2")) + len(stats["splits"])


def test_backoff_single_sequence_too_long(esm):
    emb, seqs = esm
    toks = emb.tokenize(seqs)
    lengths = [len(t.ids) for t in toks]
    longest = max(range(len(seqs)), key=lambda i: (lengths[i], -i))
    with pytest.raises(InputError) as e:
        embed_with_backoff(plan_batches(lengths, "cuda", 4096), forced(emb, toks, lengths[longest] - 1), lengths, emb.dim)
    msg = str(e.value)
    assert f"sequence {longest} ({lengths[longest]} tokens)" in msg
    assert "too_long: window" in msg and "max_length" in msg


@pytest.mark.parametrize("error", [ValueError("bad input"), RuntimeError("expected scalar type Float"), KeyError("x")])
def test_backoff_lets_other_errors_through(error):
    calls = []

    def embed_batch(b):
        calls.append(b)
        raise error

    with pytest.raises(type(error)) as e:
        embed_with_backoff([[0, 1, 2, 3]], embed_batch, [5, 5, 5, 5], 8)
    assert e.value is error and calls == [[0, 1, 2, 3]]  # not split, not retried


def test_backoff_records_depth():
    """A batch of 8 under a limit of 2 sequences: halved to 4 (depth 0), then to 2 (depth 1)."""
    lengths = [10] * 8 + [3]

    def embed_batch(b):
        if len(b) > 2:
            raise torch.OutOfMemoryError("out of memory")
        return np.array([[float(i)] for i in b], dtype=np.float32)

    out, splits = embed_with_backoff([list(range(8)), [8]], embed_batch, lengths, 1)
    assert out[:, 0].tolist() == list(range(9))
    assert splits == [
        {"batch": 0, "sequences": 8, "padded_tokens": 80, "depth": 0},
        {"batch": 0, "sequences": 4, "padded_tokens": 40, "depth": 1},
        {"batch": 0, "sequences": 4, "padded_tokens": 40, "depth": 1},
    ]
    out, splits = embed_with_backoff([], embed_batch, [], 1)
    assert out.shape == (0, 1) and splits == []


def test_bench_quick_runs():
    """The bench's parts run (tiny models, a few proteins); its figures need the full run."""
    if not (REPO.parent / "shared" / "data" / "fasta" / "vibrant_mixed_example_prodigal.faa").is_file():
        pytest.skip("the shared data folder is absent")
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_extract.py"), "--quick"], check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("default / one at a time:") == 2
