"""Packed batches (several sequences per row, block-diagonal attention, rotary positions
from 0 per sequence) give each sequence the vector it has alone, for ESM-2 and ESM C."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from extract_doubles import InlinePool, pool_class
from extract_helpers import random_fasta

from ampflow.base.errors import InputError
from ampflow.extract.batching import pack_rows, packed_padded_tokens, plan_packed
from ampflow.extract.config import ExtractSettings, ModelSpec
from ampflow.extract.models import load_embedder
from ampflow.extract.run import extract_model
from ampflow.extract.tiny import write_tiny

PRODUCTS = dict(layer=[0, 1, 2], pooling=["mean", "mean_special", "bos"], per_token=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pack_models")
    return {kind: write_tiny(kind, root / kind, seed=3) for kind in ("esm2", "esmc")}


def proteins(n: int, seed: int, lo: int = 1, hi: int = 120) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice("ACDEFGHIKLMNPQRSTVWY") for _ in range(rng.randint(lo, hi))) for _ in range(n)]


def embedder(kind, folder, pack, **kw):
    spec = ModelSpec(kind=kind, tiny=True, pack=pack, **{**PRODUCTS, **kw})
    emb = load_embedder(spec, folder, spec.layers)
    emb.packed_attention = "mask"  # this file tests the masked rows (varlen: test_extract_varlen.py)
    return emb


def alone(emb, seqs) -> dict:
    """The referee: each sequence through the model by itself (no padding, no packing)."""
    got = [emb.embed_batch(emb.tokenize([s])) for s in seqs]
    return {k: ([g[k][0] for g in got] if k.endswith(".tokens") else np.concatenate([g[k] for g in got])) for k in got[0]}


def cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity of matching rows."""
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def assert_same(got: dict, ref: dict, atol: float) -> None:
    assert set(got) == set(ref)
    for k in ref:
        if k.endswith(".tokens"):
            for a, b in zip(got[k], ref[k], strict=True):
                np.testing.assert_allclose(a, b, atol=atol, rtol=atol, err_msg=k)
        else:
            np.testing.assert_allclose(got[k], ref[k], atol=atol, rtol=atol, err_msg=k)


def test_first_fit_decreasing():
    lengths = [30, 100, 70, 60, 40, 20, 120]
    rows = pack_rows(lengths, 130)
    # longest first, each into the first row with room: 120 | 100+30 | 70+60 | 40+20
    assert rows == [[6], [1, 0], [2, 3], [4, 5]]
    assert all(sum(lengths[i] for i in r) <= 130 for r in rows)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    # one longer than a row fills a row of its own; the rows are then that long
    assert pack_rows([500, 10, 20], 130) == [[0], [2, 1]]
    assert packed_padded_tokens(lengths, rows) == 4 * 130


def test_cpu_plan_packs_only_short_sequences():
    lengths = [10, 300, 12, 47, 49, 30, 3]
    batches, row = plan_packed(lengths, "cpu", 4096, kind="esm2")
    assert row == 256
    assert batches == [[1], [4], [3, 5, 2, 0, 6]]  # > 48 tokens alone, the rest in one row


@pytest.mark.parametrize("kind", ["esm2", "esmc"])
def test_packed_equals_one_at_a_time_fp32(folders, kind):
    seqs = proteins(40, seed=1)
    emb = embedder(kind, folders[kind], pack=True)
    ref = alone(emb, seqs)
    toks = emb.tokenize(seqs)
    # rows of 300 tokens: long and short sequences share rows (the GPU plan's kind of row)
    emb.row_tokens = 300
    rows = emb._rows(toks)
    assert max(len(r) for r in rows) >= 3 and len(rows) < len(seqs) / 2
    assert_same(emb.embed_packed(toks, rows), ref, atol=1e-5)
    # and through embed's own (CPU) plan
    got, stats = emb.embed(seqs)
    assert_same(got, ref, atol=1e-5)
    assert stats["batches"] < len(seqs)


@pytest.mark.parametrize("kind", ["esm2", "esmc"])
def test_packed_bf16_close_to_alone(folders, kind):
    seqs = proteins(24, seed=2)
    emb = embedder(kind, folders[kind], pack=True, layer=[2], pooling=["mean"], per_token=False)
    ref32 = alone(emb, seqs)["L2.mean"]
    emb.model.to(torch.bfloat16)
    ref16 = alone(emb, seqs)["L2.mean"]
    toks = emb.tokenize(seqs)
    emb.row_tokens = 400
    rows = emb._rows(toks)
    assert max(len(r) for r in rows) >= 3
    got = emb.embed_packed(toks, rows)["L2.mean"]
    assert cos(got, ref16).min() >= 0.999
    assert cos(got, ref32).min() >= 0.999


def test_masked_rows_need_rotary_positions(tmp_path):
    """DNABERT-S packs only without a mask (ALiBi per sequence, tests/test_extract_varlen.py):
    a masked row would need an ALiBi bias per row."""
    from ampflow.extract.models import Embedder

    spec = ModelSpec(kind="dnabert_s", tiny=True, pack=True)
    folder = write_tiny("dnabert_s", tmp_path / "dna", seed=0)
    emb = load_embedder(spec, folder, [1])
    with pytest.raises(InputError, match="extract.models.pack"):
        Embedder("dnabert_s", emb.model, emb.tokenizer, [1], pack=True, packed_attention="mask")
    with pytest.raises(InputError, match="extract.models.pack"):
        ModelSpec(kind="esm2", tiny=True, pack="yes")


def test_cache_with_packing_prepend_computes_one_reorder_none(folders, tmp_path, caplog):
    """The cache is keyed by sequence content: packing changes which rows a sequence
    shares, never which sequences are computed."""
    caplog.set_level(logging.INFO, logger="ampflow.extract.run")
    fasta = random_fasta(tmp_path / "a.fa", "esm2", 300, seed=5, lengths=(5, 40))
    settings = ExtractSettings(sequences_per_file=100, cpu_workers=1, cache=str(tmp_path / "cache"))
    spec = ModelSpec(kind="esm2", tiny=True, pack=True)

    def run(tag):
        with pool_class(InlinePool):
            job = extract_model({"a": {"fasta": fasta}}, spec, "esm", tmp_path / "work", tmp_path / tag, settings, model_folder=folders["esm2"])
        return job["run"]["computed"], job["run"]["cached"]

    assert run("first") == (300, 0)
    recs = fasta.read_text().split(">")[1:]
    fasta.write_text(">new\nMKTAYIAKQRQISFVKSHFSRQ\n" + "".join(">" + r for r in recs))
    assert run("prepended") == (1, 300)
    random.Random(1).shuffle(recs)
    fasta.write_text("".join(">" + r for r in recs))
    assert run("reordered") == (0, 300)


def test_positions_restart_per_sequence(folders):
    """Rotary scores depend only on position differences, so vectors alone cannot show
    whether positions restart (a row's offset changes them by rounding only): the model
    must be given each sequence's own positions 0..n-1, which long rows keep in the range
    the model was trained on (ESM-2: 1026)."""
    emb = embedder("esm2", folders["esm2"], pack=True, layer=[1], pooling=["mean"], per_token=False)
    seqs = proteins(12, seed=4)
    toks = emb.tokenize(seqs)
    emb.row_tokens = 200
    rows = emb._rows(toks)
    seen = {}
    real = emb._hidden

    def spy(ids, mask, positions=None):
        seen.update(ids=ids, mask=mask, positions=positions)
        return real(ids, mask, positions)

    emb._hidden = spy
    emb.embed_packed(toks, rows)
    for r, members in enumerate(rows):
        at = 0
        for k, j in enumerate(members, start=1):
            n = len(toks[j].ids)
            assert seen["positions"][r, at : at + n].tolist() == list(range(n))
            assert seen["mask"][r, at : at + n].tolist() == [k] * n
            assert seen["ids"][r, at : at + n].tolist() == toks[j].ids
            at += n
        assert (seen["mask"][r, at:] == 0).all()


def test_gpu_plan_batches_pack_within_budgets():
    rng = random.Random(0)
    lengths = [rng.choice([rng.randint(20, 120), rng.randint(120, 700), 1024, 1500]) for _ in range(3000)]
    budget = 8192
    batches, row = plan_packed(lengths, "cuda", budget)
    assert row == 1024
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    total = 0
    for b in batches:
        sub = [lengths[i] for i in b]
        rows = pack_rows(sub, row)
        s = max(sum(sub[j] for j in r) for r in rows)
        assert len(b) == 1 or (len(rows) * s <= budget and len(rows) * s * s <= budget * 1024)
        total += len(rows) * s
    # packing leaves little padding where sorted padded batches of these lengths leave more
    assert 1 - sum(lengths) / total < 0.05
    assert len(batches) < len(lengths) / 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["esm2", "esmc"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_equals_one_at_a_time_on_the_gpu(folders, kind, dtype):
    """The same referee on CUDA, in the run's dtype: packed rows (the GPU plan's long
    rows) against each sequence alone on the same device, fp32 to 1e-5 and bf16 to a
    cosine of 0.999."""
    seqs = proteins(40, seed=5)
    spec = ModelSpec(kind=kind, tiny=True, pack=True, dtype=dtype, layer=[2], pooling=["mean"], per_token=False)
    emb = load_embedder(spec, folders[kind], spec.layers, device="cuda")
    ref = alone(emb, seqs)["L2.mean"]
    toks = emb.tokenize(seqs)
    emb.row_tokens = 400
    rows = emb._rows(toks)
    assert max(len(r) for r in rows) >= 3
    got = emb.embed_packed(toks, rows)["L2.mean"]
    if dtype == "float32":
        np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)
    else:
        assert cos(got, ref).min() >= 0.999
