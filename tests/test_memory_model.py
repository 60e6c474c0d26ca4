"""The analytic memory model against the allocator's peak of steady-state training
steps (small shapes, float32 and float64), its linearity in the number of strata, and
the strategies' effects on its terms."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from conftest import load_script
from synthetic_shapes import synthetic_features, synthetic_graph

from ampflow.amp.memory.predict import (
    ShapeSpec,
    banded_score_elements,
    estimate_for_profile,
    fit_linear,
    predict,
    profile_memory,
    spec_from_profile,
)
from ampflow.amp.memory.terms import attention_transients
from ampflow.contract.config import LossWeights, ModelConfig
from ampflow.contract.model_shapes import paired_model_params, stratum_block_params
from ampflow.contract.strategies import FEATURE_PARALLEL, HIDDEN_PARALLEL
from ampflow.model.attention import local_attention_banded
from ampflow.model.paired import PairedModel
from ampflow.train.measured_memory import AllocatorTrace, measured_step
from ampflow.train.trainer import make_optimizer

#: the chunked kernel the model ran before and its probabilities (scripts/attention_baselines.py)
_baselines = load_script("attention_baselines")
chunk_blocks, chunked_score_elements = _baselines.chunk_blocks, _baselines.chunked_score_elements

#: The largest relative distance allowed between the prediction and the allocator.
TOLERANCE = 0.10


def _model(n, L, B, cfg: ModelConfig, G=12, dtype=torch.float32, seed=0, n_batches=0):
    """A PairedModel on random shapes: all anchors at stratum 0, a random half of the
    valid pairs at each k >= 1, a random graph with both directions and self-loops."""
    g = torch.Generator().manual_seed(seed)
    anchor, stratum = synthetic_features(n, L, 0.5, 0, g)
    graph = synthetic_graph(G, n, g)
    if L == 1:  # the diagonal alone holds none of the default reach's strata: score it
        cfg = replace(cfg, hic_likelihood="all")
    torch.manual_seed(seed)
    model = PairedModel(cfg, G, anchor, stratum, L, graph, n_batches).to(dtype)
    rna = torch.poisson(torch.full((B, G), 2.0), generator=g).to(dtype)
    hic = torch.poisson(torch.full((B, len(anchor)), 0.5), generator=g).to(dtype)
    fps = torch.bincount(stratum, minlength=L).tolist()
    spec = ShapeSpec.from_model(cfg, B, G, fps, n, graph.n_nodes, graph.src.numel(), dtype_bytes=torch.finfo(dtype).bits // 8, n_batches=n_batches)
    # the trainer's Adam on CPU: the fused kernel, no temporaries
    return model, rna, hic, replace(spec, optimizer_foreach=False)


def _measure(model, rna, hic, weights=None, cond=None, hic_in=None):
    """Two steps as the trainer runs them on CPU; the allocator's peak of the second
    (steady state: Adam's moments exist) and its bytes after each stratum."""
    opt = make_optimizer(model.parameters(), 1e-3, 0.0, capturable=False)
    first = None
    for seed in (1, 2):
        _, memory = measured_step(model, opt, rna, hic, weights or LossWeights(), torch.Generator().manual_seed(seed), cond, hic_in)
        first = first or memory
    assert memory.source == "allocator" and first.peak < memory.peak  # no Adam state in the first step
    return memory.peak, memory.marks


def _assert_matches(est, measured, marks):
    """The prediction against the allocator: the steady-state peak and every per-stratum
    mark within :data:`TOLERANCE`."""
    assert abs(est.total - measured) <= TOLERANCE * measured, (est.total, measured, est.peak_part)
    assert len(est.marks) == len(marks)
    for p, m in zip(est.marks, marks):
        assert abs(p - m) <= TOLERANCE * m, (est.marks, marks)
    assert sum(est.components.values()) == est.total
    assert est.total == est.base + sum(est.strata)
    assert est.total == max(est.phases.values()) == est.phases[est.peak_phase]


def _profile(cfg: ModelConfig, spec: ShapeSpec, dtype="float32", cross=False) -> dict:
    """The profile sections the memory model reads, for a model of ``spec``'s shapes
    (what :func:`ampflow.amp.profile.profile_data` writes for such data)."""
    fps = list(spec.features_per_stratum)
    return {
        "modalities": {
            "rna": {"n_features": spec.n_genes},
            "hic": {"n_features": spec.n_features, "n_strata": len(fps), "n_anchors": spec.n_anchors, "features_per_stratum": fps},
        },
        "graph": {"n_nodes": spec.n_nodes, "n_edges": spec.n_edges},
        "model": cfg.to_dict(),
        "train": {"batch_size": spec.n_cells_batch, "dtype": dtype, "optimizer": "adam", "cross_reconstruction": cross},
    }


@pytest.mark.parametrize(
    "L, chunk, key_first, decoder_dim, dtype",
    [
        (2, 0, False, None, torch.float32),
        (5, 0, True, None, torch.float32),
        (2, 8, True, 32, torch.float32),
        (5, 8, False, None, torch.float32),
        (5, 6, True, None, torch.float64),
        (5, 0, False, 32, torch.bfloat16),
    ],
)
def test_prediction_matches_a_measured_training_step(L, chunk, key_first, decoder_dim, dtype):
    cfg = ModelConfig(latent_dim=16, hidden_dim=32, decoder_dim=decoder_dim, heads=4, window=3, chunk=chunk, key_first=key_first)
    model, rna, hic, spec = _model(60, L, 8, cfg, dtype=dtype)
    measured, marks = _measure(model, rna, hic)
    est = predict(spec, chunk=chunk, key_first=key_first)
    assert len(est.marks) == L
    _assert_matches(est, measured, marks)


def test_the_optimizer_phase_is_the_fused_steps_as_the_allocator_holds_it():
    """The optimizer phase on CPU: the state and every gradient, and no temporary, since
    the trainer's Adam there is torch's fused kernel. Referee: the allocator's peak inside
    ``step()`` above the bytes held before it (nothing, to the bytes of the step counters),
    beside the default loop's, whose temporaries the trace does see (about twice the
    largest parameter: the control that a temporary would show)."""
    cfg = ModelConfig(latent_dim=16, hidden_dim=32, heads=4, window=3)
    model, rna, hic, spec = _model(400, 3, 4, cfg)  # the Hi-C encoder's first weight: 32 x F
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    # the prediction carries no temporary: the foreach kernels' (the square root of every
    # second moment, as large as all parameters, each of which gets a gradient here) is
    # the whole of what the CUDA phase adds
    fused, foreach = predict(spec), predict(replace(spec, optimizer_foreach=True))
    assert foreach.phases["optimizer_step"] - fused.phases["optimizer_step"] == sum(p.numel() * p.element_size() for p in model.parameters())
    peaks = {}
    for name, opt in (("fused", make_optimizer(model.parameters(), 1e-3, 0.0, capturable=False)), ("loop", torch.optim.Adam(model.parameters(), lr=1e-3))):
        for seed in (1, 2):  # the second step: the moments exist before it
            model.zero_grad(set_to_none=True)
            model(rna, hic, LossWeights(), generator=torch.Generator().manual_seed(seed))["total"].backward()
            with AllocatorTrace() as trace:
                opt.step()
        peaks[name] = trace.peak
    assert peaks["fused"] <= 0.01 * largest, (peaks, largest)
    assert 1.5 * largest <= peaks["loop"] <= 2.5 * largest, (peaks, largest)


@pytest.mark.parametrize("name, n, L, B, key_first, cross, D, keep", [
    ("n2k L8 B8 D64", 2000, 8, 8, False, False, 64, 0.5),  # the stacked feed-forward's backward holds the peak
    ("n1k L10 B4 D64", 1000, 10, 4, False, False, 64, 0.5),
    ("n800 L8 B4 D64 kf cross", 800, 8, 4, True, True, 64, 0.5),
    # strata k >= 1 keep 5% of their pairs: the softmax over strata padded to the widest
    # (stratum 0) is 9x the features wide, and its backward holds the peak
    ("n600 L16 B512 D8 sparse strata", 600, 16, 512, False, False, 8, 0.05),
    ("n600 L16 B512 D8 sparse strata kf", 600, 16, 512, True, False, 8, 0.05),
])  # fmt: skip
def test_stacked_strata_match_a_measured_static_step(name, n, L, B, key_first, cross, D, keep):
    """The training step of one process (:class:`~ampflow.train.static_step.StaticStep`)
    runs every stratum in one pass: each backward then holds all strata's transients at
    once. The prediction with ``stacked=True`` against the allocator's peak of that step,
    and closer to it than the prediction of the loop over strata."""
    bench = load_script("bench_memory_model")
    cfg = bench.Config(name, n, L, B, decoder_dim=D, key_first=key_first, cross=cross, n_genes=200, keep=keep)
    result = bench.run(cfg, "fp32", step="static")
    measured = result.net
    looped = predict(result.spec, chunk=0, key_first=key_first)
    assert result.est.total != looped.total
    assert abs(result.est.total - measured) <= TOLERANCE * measured, (result.est.total, measured, result.est.peak_part)
    assert abs(result.est.total - measured) < abs(looped.total - measured), (result.est.total, looped.total, measured)


@pytest.mark.parametrize(
    "L, chunk, key_first, decoder_dim",
    [(1, 0, False, 32), (2, 0, False, None), (5, 8, True, 32), (4, 0, False, None)],
)
def test_cross_reconstruction_matches_a_measured_training_step(L, chunk, key_first, decoder_dim):
    """A cross weight > 0 decodes RNA from the Hi-C latent and Hi-C from the RNA latent:
    a second pass through both decoders, every stratum block included, held at the end
    of the forward pass. A profile of a run with a cross stage plans for it."""
    cfg = ModelConfig(latent_dim=16, hidden_dim=32, decoder_dim=decoder_dim, heads=4, window=3, chunk=chunk, key_first=key_first)
    model, rna, hic, spec = _model(60, L, 8, cfg)
    measured, marks = _measure(model, rna, hic, LossWeights(cross=1.0))
    planned = spec_from_profile(_profile(cfg, spec, cross=True))
    assert planned == replace(spec, cross=True, optimizer_foreach=True)
    est = predict(replace(planned, optimizer_foreach=False), chunk=chunk, key_first=key_first)
    _assert_matches(est, measured, marks)
    # the second pass comes after the per-stratum marks of the first, and is held at
    # the end of the forward pass
    plain = predict(spec, chunk=chunk, key_first=key_first)
    assert est.marks == plain.marks and est.total >= plain.total
    assert est.phases["end_of_forward"] > plain.phases["end_of_forward"]


@pytest.mark.parametrize("L, key_first, cross, n_batches", [(2, False, False, 3), (5, True, True, 4), (4, False, True, 2)])
def test_batch_conditioned_model_matches_a_measured_training_step(L, key_first, cross, n_batches):
    """Decoders conditioned on batches: wider loadings read with ``[u, c]``, a bias per
    gene and batch. The shape description is the model's and the prediction matches
    the allocator; with many batches it grows by their parameters and state."""
    cfg = ModelConfig(latent_dim=16, hidden_dim=32, heads=4, window=3, key_first=key_first)
    model, rna, hic, spec = _model(60, L, 8, cfg, n_batches=n_batches)
    described = paired_model_params(cfg, spec.n_genes, L, spec.n_features, spec.n_nodes, n_batches)
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == [(n, p.shape) for n, p in described.items()]
    cond = torch.nn.functional.one_hot(torch.arange(8) % n_batches, n_batches).float()
    measured, marks = _measure(model, rna, hic, LossWeights(cross=float(cross)), cond)
    spec = replace(spec, cross=cross)
    est = predict(spec, key_first=key_first)
    assert est.components["parameters"] == 4 * sum(p.numel() for p in model.parameters())
    _assert_matches(est, measured, marks)
    assert predict(replace(spec, n_batches=50), key_first=key_first).total > est.total


def test_the_encoders_copy_of_the_batch_is_counted_as_the_allocator_holds_it():
    """``train.hic_thinned: encoder``: the encoder reads a thinned copy of the Hi-C batch,
    held through the step beside the counts. The prediction with it matches the
    allocator's peak of that step, and what it adds to the prediction (``B x F``
    values) is what it adds to the allocator's peak (referee: the same step measured
    without it)."""
    cfg = ModelConfig(latent_dim=16, hidden_dim=32, heads=4, window=3)
    peaks = {}
    for name in ("plain", "copy"):
        model, rna, hic, spec = _model(200, 3, 64, cfg)
        copy = torch.binomial(hic, torch.full_like(hic, 0.5), generator=torch.Generator().manual_seed(3)) if name == "copy" else None
        peaks[name], marks = _measure(model, rna, hic, hic_in=copy)
    est, plain = predict(replace(spec, hic_input_copy=True)), predict(spec)
    _assert_matches(est, peaks["copy"], marks)
    added = est.total - plain.total
    assert added == hic.numel() * hic.element_size()
    assert abs((peaks["copy"] - peaks["plain"]) - added) <= 0.01 * added, (peaks, added)


def test_the_input_projection_is_counted_as_the_allocator_holds_it():
    """``model.hic_pcs``: the Hi-C input's axes and centre are buffers of ``(pcs + 1) x
    F`` elements. The prediction of a model with 40 axes matches the allocator, and what
    it adds to the prediction is what it adds to the allocator's peak (referee: the same
    step measured without them)."""
    cfg = ModelConfig(latent_dim=16, hidden_dim=32, heads=4, window=3)
    peaks = {}
    for pcs in (0, 40):
        model, rna, hic, spec = _model(300, 3, 8, replace(cfg, hic_pcs=pcs))
        assert spec.hic_pcs == pcs
        peaks[pcs], marks = _measure(model, rna, hic)
        est = predict(spec)
        _assert_matches(est, peaks[pcs], marks)
        peaks[pcs] = (peaks[pcs], est.components["buffers"])
    added = 41 * spec.n_features * 4
    assert peaks[40][1] - peaks[0][1] == added
    assert abs((peaks[40][0] - peaks[0][0]) - added) <= 0.1 * added, (peaks, added)


#: Components held entirely in the training dtype (no int64 indices, bool masks or
#: float32 Adam steps among them).
FLOAT_ONLY = {
    "parameters", "gradients", "data_batch", "rna_encoder", "hic_encoder", "cell_latents", "stratum0_decode",
    "graph_encoder", "rna_decoder", "hic_decoder_head",  # their indices are buffers
    "stratum_norms", "stratum_projections", "stratum_feed_forward", "stratum_decode",
    "stratum_attention_scores",  # the banded kernel keeps no mask, chunked or not
}  # fmt: skip


@pytest.mark.parametrize("L, chunk, key_first, decoder_dim, cross", [(5, 6, True, None, False), (4, 0, False, 32, True)])
def test_float64_run_doubles_the_float_terms_and_matches_a_measured_step(L, chunk, key_first, decoder_dim, cross):
    """A profile of a float64 run (``train.dtype``) is planned in float64: every term
    held in the training dtype doubles, indices, masks and Adam's step counters do not,
    and the prediction is that of a float64 training step."""
    cfg = ModelConfig(latent_dim=16, hidden_dim=32, decoder_dim=decoder_dim, heads=4, window=3, chunk=chunk, key_first=key_first)
    model, rna, hic, spec = _model(60, L, 8, cfg, dtype=torch.float64)
    cpu = dict(optimizer_foreach=False)
    f32 = predict(replace(spec_from_profile(_profile(cfg, spec, "float32", cross)), **cpu), chunk=chunk, key_first=key_first)
    f64 = predict(replace(spec_from_profile(_profile(cfg, spec, "float64", cross)), **cpu), chunk=chunk, key_first=key_first)
    assert f32.peak_part == f64.peak_part
    # at a peak early in the backward pass no gradient is held yet
    assert FLOAT_ONLY - {"gradients"} <= set(f32.components) and f32.components.keys() == f64.components.keys()
    for name, b32 in f32.components.items():
        if name in FLOAT_ONLY:
            assert f64.components[name] == 2 * b32, name
        elif name == "backward_transient":  # float temporaries, less a freed bool mask
            assert 1.9 < f64.components[name] / b32 < 2.1, name
        else:  # indices, masks and step counters do not double
            assert b32 < f64.components[name] < 2 * b32, name
    assert 1.9 < f64.total / f32.total <= 2.0
    measured, marks = _measure(model, rna, hic, LossWeights(cross=float(cross)))
    _assert_matches(f64, measured, marks)


@pytest.mark.parametrize(
    "L, attention, decoder_dim",
    [(1, True, None), (1, True, 32), (3, True, 32), (3, False, None), (4, False, 24), (4, True, None)],
)
def test_the_shape_description_is_the_models(L, attention, decoder_dim):
    """The modules are built from :mod:`ampflow.contract.model_shapes`, and the memory
    model counts the state from it: names, order and shapes of the real parameters
    are the description's, and the predicted parameter bytes are theirs."""
    cfg = ModelConfig(latent_dim=16, hidden_dim=32, decoder_dim=decoder_dim, heads=4, window=3, attention=attention)
    model, _, _, spec = _model(30, L, 4, cfg)
    described = paired_model_params(cfg, spec.n_genes, L, spec.n_features, spec.n_nodes)
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == [(n, p.shape) for n, p in described.items()]
    block = stratum_block_params(cfg.latent_dim, cfg.D, cfg.ffn_mult, attention)
    for b in model.hic_decoder.blocks:
        assert {n: tuple(p.shape) for n, p in b.named_parameters()} == {n: p.shape for n, p in block.items()}
    est = predict(spec)
    assert est.components["parameters"] == 4 * sum(p.numel() for p in model.parameters())
    parts = {HIDDEN_PARALLEL: 2, FEATURE_PARALLEL: 2}
    two = predict(spec, tp=2, strategies=set(parts))
    assert two.components["parameters"] == 4 * sum(p.local_numel(parts) for p in described.values())


@pytest.mark.parametrize("L, decoder_dim, attention", [(3, 32, True), (4, None, False), (1, 32, True)])
def test_shard_marks_are_the_sharded_modules(L, decoder_dim, attention):
    """What the description marks as split by S2 / S5 (strategy, dimension, size) is
    what the sharded modules split, and the predicted parameter bytes are those of the
    rank holding the most (rank 0: the first pieces are the longer ones)."""
    from ampflow.parallel.feature_parallel import FeatureParallelLinear
    from ampflow.parallel.sharded_decoder import ShardedStratifiedZINBDecoder

    cfg = ModelConfig(latent_dim=16, hidden_dim=32, decoder_dim=decoder_dim, heads=4, window=3, attention=attention)
    _, _, _, spec = _model(31, L, 4, cfg)
    described = paired_model_params(cfg, spec.n_genes, L, spec.n_features, spec.n_nodes)
    for active in ({FEATURE_PARALLEL}, {HIDDEN_PARALLEL}, {FEATURE_PARALLEL, HIDDEN_PARALLEL}):
        features, hidden = FEATURE_PARALLEL in active, HIDDEN_PARALLEL in active
        marked = {n: (p.dim, p.shape[p.dim]) for n, p in described.items() if p.shard in active}
        est = predict(spec, tp=2, strategies=active)
        for rank in (0, 1):
            model, _, _, _ = _model(31, L, 4, cfg)
            dec = ShardedStratifiedZINBDecoder(model.hic_decoder, None, 2, rank, features=features, hidden=hidden)
            model.hic_decoder = dec
            shards = {f"hic_decoder.{n}": s for n, s in dec.shards.items()}
            if features:
                model.hic_encoder.body[0] = FeatureParallelLinear(model.hic_encoder.body[0], dec.local_features, None)
                shards.update({f"hic_encoder.body.0.{n}": s for n, s in model.hic_encoder.body[0].shards.items()})
            assert {n: (s.dim, s.size) for n, s in shards.items()} == marked
            held = 4 * sum(p.numel() for p in model.parameters())
            assert held == est.components["parameters"] if rank == 0 else held <= est.components["parameters"]


def _spec(L, per_stratum=300, n=400, **kw):
    fps = [n] + [per_stratum] * (L - 1)
    args = dict(
        n_cells_batch=32, n_genes=200, n_features=sum(fps), features_per_stratum=fps, n_anchors=n,
        n_nodes=600, n_edges=3000, latent=16, hidden=64, D=32, heads=4, window=4,
    )  # fmt: skip
    args.update(kw)
    return ShapeSpec(**args)


@pytest.mark.parametrize("chunk, key_first, cross", [(0, False, False), (32, True, False), (0, False, True)])
def test_prediction_is_linear_in_the_number_of_strata(chunk, key_first, cross):
    totals = [predict(_spec(L, cross=cross), chunk=chunk, key_first=key_first).total for L in range(2, 9)]
    steps = {b - a for a, b in zip(totals, totals[1:])}
    assert len(steps) == 1
    est = predict(_spec(8, cross=cross), chunk=chunk, key_first=key_first)
    assert steps == {est.per_stratum}
    assert est.total == est.base + 7 * est.per_stratum
    # a line fitted to M(L) has the per-stratum cost as slope, M_base - M_stratum as intercept
    slope, intercept = fit_linear(range(2, 9), totals)
    assert slope == pytest.approx(est.per_stratum)
    assert intercept == pytest.approx(est.base - est.per_stratum)


def test_attention_scores_are_the_band_whatever_the_chunk():
    n, w, H, L, b = 400, 4, 4, 5, 4
    band = n * (2 * w + 1)
    assert banded_score_elements(n, w) == band
    unchunked = predict(_spec(L), chunk=0)
    # (H, n, 2w + 1) probabilities per attention stratum, no mask; not the n x n of the
    # full masked reference
    assert unchunked.components["stratum_attention_scores"] == (L - 1) * H * band * b
    assert unchunked.transient["attention_scores"] == attention_transients(n, w, None, H, 0, b)[0]
    for chunk in (1, 7, 32, 399, 400, 1000):
        est = predict(_spec(L), chunk=chunk, strategies={"chunked_attention"})
        # S3 no longer changes what is kept, only the transient block of scores
        assert est.components == unchunked.components and est.total == unchunked.total
        # only the transient block of scores shrinks with the chunk
        assert est.transient["attention_scores"] == attention_transients(n, w, chunk, H, 0, b)[0]
        assert est.transient["attention_scores"] <= unchunked.transient["attention_scores"]
        # the older chunked kernel's blocks (kept for comparison) hold at least every
        # in-range (query, key) pair, n (2w + 1) - w (w + 1), exactly that at chunk 1
        blocks = sum((e - s) * (ke - ks) for s, e, ks, ke in chunk_blocks(n, w, chunk))
        assert chunked_score_elements(n, w, chunk) == blocks >= band - w * (w + 1)
        assert (blocks == band - w * (w + 1)) == (chunk == 1)
    # a window beyond the sequence is clipped: every query sees all n keys
    assert banded_score_elements(5, 100) == 5 * 9 and banded_score_elements(1, 3) == 1
    with pytest.raises(ValueError):
        predict(_spec(L), chunk=0, strategies={"chunked_attention"})


@pytest.mark.parametrize("n,window,chunk,heads,head_dim", [(2700, 8, None, 4, 64), (5400, 8, 512, 4, 64), (3000, 8, 37, 2, 32),
                                                           (4000, 32, None, 4, 16), (27000, 8, 2048, 4, 64)])  # fmt: skip
def test_attention_transients_match_the_allocator(n, window, chunk, heads, head_dim):
    """The banded kernel's transient bytes in the ledger (forward: a group's block
    scores and band copies; backward: dq, dk, dv and a group's block scores and their
    gradient) against the CPU allocator's peak over the kernel alone, less what it
    holds: the saved scaled queries and probabilities and the output."""
    g = torch.Generator().manual_seed(n)
    q, k, v, grad_out = (torch.randn(heads, n, head_dim, generator=g) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    b = 4
    held = heads * n * (head_dim + banded_score_elements(n, window) // n) * b + heads * n * head_dim * b
    with AllocatorTrace(0) as trace:
        out = local_attention_banded(q, k, v, window, chunk)
        trace.mark("backward")
        torch.autograd.grad(out, (q, k, v), grad_out)
    forward, backward = attention_transients(n, window, chunk, heads, n * heads * head_dim, b)
    measured_fwd = trace.phase_peaks["start"] - held
    measured_bwd = trace.phase_peaks["backward"] - held
    assert measured_fwd == pytest.approx(forward, rel=0.1), (measured_fwd, forward)
    assert measured_bwd == pytest.approx(backward, rel=0.1), (measured_bwd, backward)


def test_key_first_trades_the_saved_keys_and_removes_the_batch_by_anchor_product():
    spec = _spec(5)
    naive, kf = predict(spec), predict(spec, key_first=True)
    n, D, b, L = 400, 32, 4, 5
    assert naive.transient["decode_scores"] == 32 * n * b and kf.transient["decode_scores"] == 0
    # naive keeps each stratum's n x D keys; key-first its |F_k| x D gathered keys
    assert naive.components["stratum_decode"] - kf.components["stratum_decode"] == (L - 1) * (n - 300) * D * b
    assert predict(spec, strategies={"key_first_decode"}) == kf


def test_hidden_parallel_halves_the_D_proportional_terms():
    spec = _spec(6)
    one, two = predict(spec), predict(spec, tp=2, strategies={"hidden_parallel"})
    for name in ("stratum_projections", "stratum_feed_forward"):
        assert two.components[name] * 2 == one.components[name]
    for name in ("stratum_attention_scores", "stratum_norms", "zinb_likelihood", "hic_encoder", "rna_decoder"):
        assert two.components[name] == one.components[name]
    # the decoder's D-proportional parameters (and their gradients and Adam moments) halve
    d, D, f = 16, 32, 2
    block = 2 * d * D + 2 * D + 2 * f * D * D + 2 * f * D + f * D * D + D
    dprop = 5 * block + d * D  # five blocks and u_proj
    assert one.components["parameters"] - two.components["parameters"] == dprop // 2 * 4
    assert one.components["optimizer_state"] - two.components["optimizer_state"] == 2 * (dprop // 2) * 4
    assert two.per_stratum < one.per_stratum
    # tp without a strategy that shards over it changes nothing
    assert predict(spec, tp=2) == one


def test_feature_parallel_halves_the_feature_terms():
    spec = _spec(4, per_stratum=300, n=400, n_cells_batch=32)
    one, two = predict(spec), predict(spec, tp=2, strategies={"feature_parallel"})
    assert two.components["zinb_likelihood"] * 2 == one.components["zinb_likelihood"]
    B, F, b = 32, 400 + 3 * 300, 4
    assert one.components["hic_encoder"] - two.components["hic_encoder"] == B * F * b // 2
    # decode: logits, softmax, scale halve; the n x D keys do not
    n, D = 400, 32
    rest = 3 * n * D * b
    assert (one.components["stratum_decode"] - rest) == 2 * (two.components["stratum_decode"] - rest)
    for name in ("stratum_projections", "stratum_feed_forward", "stratum_attention_scores", "rna_decoder"):
        assert two.components[name] == one.components[name]


def test_data_parallel_divides_the_batch():
    spec = _spec(3, n_cells_batch=33)
    assert predict(spec, dp=2) == predict(_spec(3, n_cells_batch=17))
    with pytest.raises(ValueError):
        predict(spec, strategies={"no_such_strategy"})


def test_fit_linear_recovers_a_known_line():
    Ls = [2, 4, 8, 16, 32]
    slope, intercept = fit_linear(Ls, [3.5 * x - 7.25 for x in Ls])
    assert slope == pytest.approx(3.5) and intercept == pytest.approx(-7.25)
    with pytest.raises(ValueError):
        fit_linear([4, 4], [1, 2])


def test_profile_adapters():
    profile = {
        "modalities": {
            "rna": {"n_features": 200},
            "hic": {"n_features": 1300, "n_strata": 4, "n_anchors": 400, "features_per_stratum": [400, 300, 300, 300]},
        },
        "graph": {"n_nodes": 600, "n_edges": 3000},
        "model": {"latent_dim": 16, "hidden_dim": 64, "decoder_dim": 32, "window": 4},
        "train": {"batch_size": 32, "dtype": "float32", "optimizer": "adam"},
    }
    est = estimate_for_profile(profile, ("chunked_attention", "key_first_decode"), 1, 1, 32)
    # the model config's defaults: private_dim a quarter of latent_dim 16, so 12 aligned
    # dims, and the Hi-C input's projection on hic_pcs axes
    spec = _spec(4, shared=12, hic_pcs=ModelConfig().hic_pcs)
    assert est == predict(spec, chunk=32, key_first=True)
    assert estimate_for_profile(profile, ("chunked_attention",), 1, 1, 0) == predict(spec)
    mem = profile_memory(profile)
    json.dumps(mem)
    assert mem["total_bytes"] == predict(spec).total
    assert mem["M_base_bytes"] + sum(mem["strata_bytes"]) == mem["total_bytes"]


def test_shape_spec_validation():
    with pytest.raises(ValueError):
        _spec(3, n_features=5)
    with pytest.raises(ValueError):
        _spec(3, D=30, heads=4)
    spec = ShapeSpec.from_model(ModelConfig(), 16, 10, [5, 4], 5, 15, 40)
    assert spec.n_features == 9 and spec.D == ModelConfig().latent_dim == 12 and spec.n_strata == 2
