"""Packing without mask (sequences one after another, attention over ``cu_seqlens``,
:mod:`ampflow.extract.varlen`) gives each sequence the vector it has alone.

Referees: each sequence through the model's own forward by itself (transformers'
``EsmModel`` for ESM-2, whose forward the packed path does not use; the ESM C and
DNABERT-S networks, checked against EvolutionaryScale's code and the DNABERT-S port in
their own test files), and on the GPU the same on CUDA and transformers in fp32 on the CPU.
"""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch

from ampflow.extract import varlen
from ampflow.extract.batching import (
    VARLEN_MAX_TOKENS,
    VARLEN_MEMORY_SHARE,
    VARLEN_MIN_TOKENS,
    pack_rows,
    packed_token_budget,
    plan_varlen,
)
from ampflow.extract.config import ModelSpec
from ampflow.extract.models import load_embedder
from ampflow.extract.tiny import write_tiny

PRODUCTS = dict(layer=[0, 1, 2], pooling=["mean", "mean_special", "bos"], per_token=True)
KINDS = ["esm2", "esmc", "dnabert_s"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("varlen_models")
    return {kind: write_tiny(kind, root / kind, seed=3) for kind in KINDS}


def sequences(kind: str, n: int, seed: int, lo: int = 1, hi: int = 120) -> list[str]:
    rng = random.Random(seed)
    letters = "ACGT" if kind == "dnabert_s" else "ACDEFGHIKLMNPQRSTVWY"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


def embedder(kind, folder, device="cpu", **kw):
    spec = ModelSpec(kind=kind, tiny=True, pack=True, **{**PRODUCTS, **kw})
    return load_embedder(spec, folder, spec.layers, device=device)


def alone(emb, seqs) -> dict:
    """Each sequence through the model's own forward by itself (no padding, no packing)."""
    got = [emb.embed_batch(emb.tokenize([s])) for s in seqs]
    return {k: ([g[k][0] for g in got] if k.endswith(".tokens") else np.concatenate([g[k] for g in got])) for k in got[0]}


def cos(a, b):
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def assert_same(got: dict, ref: dict, atol: float) -> None:
    assert set(got) == set(ref)
    for k in ref:
        pairs = zip(got[k], ref[k], strict=True) if k.endswith(".tokens") else [(got[k], ref[k])]
        for a, b in pairs:
            np.testing.assert_allclose(a, b, atol=atol, rtol=atol, err_msg=k)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", ["segments", "flex"])
def test_packed_equals_one_at_a_time_fp32(folders, kind, backend):
    """Every product (3 layers, 3 poolings, per-token vectors) of 14 sequences packed into
    one batch equals each sequence alone to 1e-5, through the per-sequence stand-in and
    through flex_attention's document mask (eager on the CPU)."""
    emb = embedder(kind, folders[kind])
    emb._backend = backend
    seqs = sequences(kind, 14, seed=1)
    assert_same(emb.embed_varlen(emb.tokenize(seqs)), alone(emb, seqs), atol=1e-5)


def test_esm2_token_dropout_is_per_sequence(folders):
    """ESM-2 rescales the embeddings by the share of <mask> in the sequence: packed
    sequences holding <mask> (the masked rows give them a row of their own) keep their
    own share."""
    emb = embedder("esm2", folders["esm2"], layer=[2], pooling=["mean"], per_token=False)
    seqs = sequences("esm2", 10, seed=2, lo=10)
    toks = emb.tokenize(seqs)
    mask_id = emb.tokenizer.mask_token_id
    for j, t in enumerate(toks[:5]):
        for p in range(1, 1 + j + 1):
            t.ids[p] = mask_id
    got = emb.embed_varlen(toks)["L2.mean"]
    ref = np.concatenate([emb.embed_batch([t])["L2.mean"] for t in toks])
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)


def test_esm2_packed_equals_transformers_forward(folders):
    """The packed path walks EsmModel's modules itself: against transformers' own forward
    of each sequence alone (the last layer, after its final LayerNorm)."""
    from transformers import EsmModel

    emb = embedder("esm2", folders["esm2"], layer=[2], pooling=["mean"], per_token=True)
    ref_model = EsmModel.from_pretrained(str(folders["esm2"]), add_pooling_layer=False).eval()
    seqs = sequences("esm2", 8, seed=3)
    got = emb.embed_varlen(emb.tokenize(seqs))
    for i, s in enumerate(seqs):
        ids = torch.tensor([emb.tokenize([s])[0].ids])
        with torch.no_grad():
            h = ref_model(input_ids=ids).last_hidden_state[0, 1:-1].numpy()
        np.testing.assert_allclose(got["L2.tokens"][i], h, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(got["L2.mean"][i], h.mean(0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_embed_packs_by_default_only_on_cuda(folders, kind):
    """pack: null packs on CUDA, not on the CPU; pack: true on the CPU gives the same
    vectors through the whole embed (planner, back-off, pooling) with no padding."""
    spec = ModelSpec(kind=kind, tiny=True, layer=[2], pooling=["mean"])
    assert spec.pack is None
    assert not load_embedder(spec, folders[kind], [2]).pack
    emb = embedder(kind, folders[kind], layer=[2], pooling=["mean"], per_token=False)
    seqs = sequences(kind, 30, seed=4, hi=60)
    got, stats = emb.embed(seqs)
    assert stats["attention"] == "segments"
    assert stats["padded_tokens"] == stats["tokens"]
    np.testing.assert_allclose(got["L2.mean"], alone(emb, seqs)["L2.mean"], atol=1e-5, rtol=1e-5)


def test_backend_choice_falls_back_and_is_logged(monkeypatch, caplog):
    """A backend forced that cannot run here (FlashAttention's varlen kernel on the CPU)
    falls back to per-sequence attention, and the log says which and why."""
    caplog.set_level(logging.INFO, logger="ampflow.extract.varlen")
    assert varlen.choose("cpu") == "segments"
    monkeypatch.setenv(varlen.ENV, "varlen")
    assert varlen.choose("cpu", torch.float32) == "segments"
    assert any("varlen:" in r.getMessage() and "segments" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv(varlen.ENV, "bogus")
    with pytest.raises(ValueError, match=varlen.ENV):
        varlen.choose("cpu")


def test_attention_matches_dense_masked_attention():
    """Against the dense block-diagonal mask (the path it replaces), with and without ALiBi:
    three sequences in one packed tensor."""
    g = torch.Generator().manual_seed(0)
    lengths = [5, 17, 9]
    t, h, d = sum(lengths), 4, 16
    q, k, v = (torch.randn(t, h, d, generator=g) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    seq = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    pos = torch.cat([torch.arange(n) for n in lengths])
    same = seq[:, None] == seq[None, :]
    for alibi in (None, slopes):
        bias = torch.zeros(h, t, t).masked_fill(~same, float("-inf"))
        if alibi is not None:
            bias = bias - alibi[:, None, None] * (pos[:, None] - pos[None, :]).abs()
        dense = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=bias).transpose(0, 1)
        for backend in ("segments", "flex"):
            got = varlen.attention(q, k, v, varlen.pack(lengths, "cpu", backend), alibi)
            torch.testing.assert_close(got, dense, atol=1e-5, rtol=1e-5)


def test_gpu_plan_is_first_fit_decreasing_under_the_budget():
    rng = random.Random(0)
    lengths = [rng.choice([rng.randint(20, 120), rng.randint(120, 700), 1024, 5000]) for _ in range(2000)]
    budget = 8192
    batches = plan_varlen(lengths, "cuda", budget)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or sum(lengths[i] for i in b) <= budget
    # first-fit decreasing uses at most 11/9 OPT + 6/9 batches (Dosa 2007); OPT is at
    # least the tokens over the budget and at least the sequences longer than half of it
    opt_low = max(-(-sum(lengths) // budget), sum(n > budget / 2 for n in lengths))
    assert len(batches) <= 11 / 9 * opt_low + 6 / 9
    # the CPU keeps its rule: long sequences alone
    assert all(len(b) == 1 for b in plan_varlen(lengths, "cpu", budget) if max(lengths[i] for i in b) > 48)
    assert pack_rows(lengths, budget) == batches


def test_token_budget_follows_free_memory():
    """The budget grows with free memory until its cap, and its activations (per token,
    as the docstring counts them) fit the share of free memory it may take."""
    hidden, inner = 2560, 10240
    per_token = 2 * (6 * hidden + 2 * inner) + 4 * 4 * hidden + 4 * hidden
    budgets = [packed_token_budget(gib * 2**30, hidden, inner, 2) for gib in (0, 1, 2, 4, 80)]
    assert budgets == sorted(budgets)
    assert budgets[0] == VARLEN_MIN_TOKENS and budgets[-1] == VARLEN_MAX_TOKENS
    for gib, b in zip((1, 2, 4), budgets[1:4]):
        assert VARLEN_MIN_TOKENS < b < VARLEN_MAX_TOKENS
        assert b * per_token <= VARLEN_MEMORY_SHARE * gib * 2**30 < (b + 1) * per_token


def test_a_backend_failing_on_a_shape_falls_back_to_per_sequence(monkeypatch, caplog):
    """A kernel that fails on a shape its probe did not cover (flex_attention below a head
    width of 16) gives the per-sequence result, says so once, and is not tried again for
    that shape; running out of memory is raised for the batch split instead."""
    caplog.set_level(logging.WARNING, logger="ampflow.extract.varlen")
    calls = []

    def broken(q, k, v, packed, slopes):
        calls.append(1)
        raise RuntimeError("head width below 16")

    monkeypatch.setitem(varlen._IMPL, "flex", broken)
    monkeypatch.setattr(varlen, "_UNSUPPORTED", set())
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(30, 2, 8, generator=g) for _ in range(3))
    want = varlen.attention(q, k, v, varlen.pack([12, 18], "cpu", "segments"))
    for _ in range(2):
        torch.testing.assert_close(varlen.attention(q, k, v, varlen.pack([12, 18], "cpu", "flex")), want)
    assert len(calls) == 1 and sum("per-sequence attention instead" in r.getMessage() for r in caplog.records) == 1

    def oom(q, k, v, packed, slopes):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setitem(varlen._IMPL, "flex", oom)
    with pytest.raises(torch.OutOfMemoryError):
        varlen.attention(q[:, :, :4], k[:, :, :4], v[:, :, :4], varlen.pack([12, 18], "cpu", "flex"))


class _OnCuda:
    """Stands in for a CUDA tensor where only ``.device.type`` is read."""

    device = torch.device("cuda", 0)


def test_fused_kernel_out_of_memory_is_raised_not_taken_for_a_missing_compiler(monkeypatch, caplog):
    """The compiled rotary / GELU kernels: a compiler that fails sends this and later calls
    to the eager function (the same values), said once; running out of memory is the
    batch's size, raised for the batch split, and compilation stays on."""
    caplog.set_level(logging.WARNING, logger="ampflow.extract.varlen")

    def eager(x):
        return "eager"

    def raising(error):
        def compiled(*args):
            raise error

        return compiled

    fused = varlen.Fused(eager)
    fused.compiled = raising(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    with pytest.raises(torch.OutOfMemoryError):
        fused(_OnCuda())
    assert not fused.failed and not caplog.records
    fused.compiled = raising(RuntimeError("Cannot find a working triton installation"))
    assert fused(_OnCuda()) == "eager" and fused.failed
    assert fused(_OnCuda()) == "eager"
    assert sum("running it eagerly" in r.getMessage() for r in caplog.records) == 1


def test_a_backend_passed_over_on_a_gpu_is_a_warning(monkeypatch, caplog):
    """A packed-attention kernel whose probe fails on a GPU is passed over for the whole
    run: the log says so at WARNING, with why; on the CPU the choice is an INFO line."""
    caplog.set_level(logging.INFO, logger="ampflow.extract.varlen")
    monkeypatch.setattr(varlen, "_CHOSEN", {})
    tried = []

    def probe(backend, device, dtype, alibi):
        tried.append(backend)
        if backend == "varlen":
            raise RuntimeError("varlen_attn: no kernel for this device")

    monkeypatch.setattr(varlen, "_probe", probe)
    assert varlen.choose("cuda:0", torch.bfloat16) == "flex" and tried == ["varlen", "flex"]
    rec = [r for r in caplog.records if "packed attention on cuda:0" in r.getMessage()]
    assert len(rec) == 1 and rec[0].levelno == logging.WARNING and "varlen: RuntimeError: varlen_attn: no kernel" in rec[0].getMessage()
    caplog.clear()
    assert varlen.choose("cpu") == "segments"
    assert [r.levelno for r in caplog.records if "packed attention on cpu" in r.getMessage()] == [logging.INFO]


def test_token_budget_counts_the_allocators_cached_blocks_as_free(folders, monkeypatch):
    """After a batch, the caching allocator keeps its blocks reserved: the driver reports
    them used, yet the next batch can have them. The budget with 2 GiB free and 6 GiB
    cached is the budget with 8 GiB free and nothing cached."""
    emb = load_embedder(ModelSpec(kind="esm2", tiny=True, layer=[2], pooling=["mean"]), folders["esm2"], [2])
    monkeypatch.setattr(emb, "device", "cuda:0")
    gib = 2**30

    def budget(driver_free, reserved, allocated):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (driver_free, 80 * gib))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)
        return emb.packed_budget()

    fresh = budget(8 * gib // 1000, 0, 0)
    assert budget(2 * gib // 1000, 7 * gib // 1000, gib // 1000) == fresh
    assert budget(2 * gib // 1000, 0, 0) < fresh


# ---------------------------------------------------------------- on a GPU
@pytest.fixture(scope="module")
def gpu_folders(tmp_path_factory):
    """Tiny models with heads 16 wide (FlashAttention takes multiples of 8, flex_attention
    at least 16; the real ones are 64 wide)."""
    from ampflow.extract.tiny import write_dnabert_s, write_esm2, write_esmc

    root = tmp_path_factory.mktemp("varlen_gpu_models")
    return {
        "esm2": write_esm2(root / "esm2", seed=3, hidden=64, heads=4, intermediate=128),
        "esmc": write_esmc(root / "esmc", seed=3, hidden=64, heads=4),
        "dnabert_s": write_dnabert_s(root / "dnabert_s", seed=3, hidden=64, heads=4, intermediate=128),
    }


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_packed_equals_one_at_a_time_on_the_gpu(gpu_folders, kind, dtype):
    """On CUDA in the run's dtype, through the backend chosen there (logged): packed
    against each sequence alone on the same device (fp32 to 1e-5 where the per-sequence
    fallback runs, else cosine; bf16 cosine >= 0.999) and against the CPU's fp32."""
    seqs = sequences(kind, 40, seed=5, hi=300)
    emb = embedder(kind, gpu_folders[kind], device="cuda", dtype=dtype, layer=[2], pooling=["mean"], per_token=False)
    backend = emb.attention_backend
    if dtype == "bfloat16":
        assert backend == ("flex" if kind == "dnabert_s" else "varlen"), backend
    ref = alone(emb, seqs)["L2.mean"]
    got, stats = emb.embed(seqs)
    assert stats["attention"] == backend and stats["padded_tokens"] == stats["tokens"]
    got = got["L2.mean"]
    cpu = alone(embedder(kind, gpu_folders[kind], layer=[2], pooling=["mean"], per_token=False), seqs)["L2.mean"]
    if dtype == "float32" and backend == "segments":
        np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)
    assert cos(got, ref).min() >= 0.999
    assert cos(got, cpu).min() >= 0.999


def test_document_block_mask_keeps_exactly_the_blocks_with_a_same_sequence_pair():
    """The block mask built from the boundaries keeps block (i, j) exactly when some
    query of block i and key of block j are of the same sequence (brute force over all
    token pairs), padding included as a sequence of its own; then flex over many blocks
    against per-sequence attention."""
    lengths = [300, 5, 700, 1, 128, 127, 129, 40]
    p = varlen.pack(lengths, "cpu", "flex")
    tp = 1536
    bm = varlen.document_block_mask(p, tp, torch.device("cpu"))
    doc = torch.cat([p.seq_index, torch.full((tp - p.total,), len(lengths))])
    nb = tp // varlen.FLEX_BLOCK
    same = (doc[:, None] == doc[None, :]).reshape(nb, varlen.FLEX_BLOCK, nb, varlen.FLEX_BLOCK).any(3).any(1)
    assert torch.equal(bm.to_dense()[0, 0].bool(), same)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(p.total, 2, 16, generator=g) for _ in range(3))
    slopes = torch.tensor([0.5, 0.125])
    for alibi in (None, slopes):
        torch.testing.assert_close(
            varlen.attention(q, k, v, p, alibi), varlen.attention(q, k, v, varlen.pack(lengths, "cpu", "segments"), alibi), atol=1e-5, rtol=1e-5
        )


def test_compiled_flex_compiles_for_varying_lengths_in_its_probe_not_per_batch(monkeypatch):
    """On CUDA, flex_attention is compiled and each batch is padded to a multiple of
    1,024 tokens: a run meets many padded lengths, and dynamo stops compiling after 8
    graphs of one function (then eager flex materialises every score). The probe runs
    two lengths, so that torch compiles its graph for lengths that vary (automatic
    dynamic shapes) there, where a failure passes flex over. The model's own heads then
    compile once more, at the first batch, and the other batches, of other padded
    lengths, nothing. CPU stand-in: the same compiled call (dynamo, AOT autograd's graph
    run eagerly) with the CUDA padding. Referees: dynamo's own count of the graphs it
    compiled, and per-sequence attention for every batch."""
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(varlen, "_FLEX", {"cpu": torch.compile(flex_attention, backend="aot_eager")})
    monkeypatch.setattr(varlen, "flex_pad", lambda device_type: varlen.FLEX_PAD)
    monkeypatch.setattr(varlen, "_CHOSEN", {})
    monkeypatch.setattr(varlen, "_UNSUPPORTED", set())
    monkeypatch.setenv(varlen.ENV, "flex")
    try:
        assert varlen.choose("cpu", torch.float32, alibi=True) == "flex"
        compiled = counters["stats"]["unique_graphs"]
        assert compiled == 2  # the first length, then lengths that vary
        rng = random.Random(0)
        slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
        padded, graphs = set(), []
        for _ in range(8):
            lengths = [rng.randint(20, 400) for _ in range(rng.randint(2, 25))]
            packed = varlen.pack(lengths, "cpu", "flex")
            q, k, v = (torch.randn(packed.total, 4, 16) for _ in range(3))  # not the probe's 2 heads of 64
            got = varlen.attention(q, k, v, packed, slopes)
            torch.testing.assert_close(got, varlen._segments(q, k, v, packed, slopes), rtol=1e-5, atol=1e-5)
            padded.add(-(-packed.total // varlen.FLEX_PAD))
            graphs.append(counters["stats"]["unique_graphs"])
        assert len(padded) >= 4 and not varlen._UNSUPPORTED
        assert graphs == [compiled + 1] * len(graphs)
    finally:
        torch._dynamo.reset()
