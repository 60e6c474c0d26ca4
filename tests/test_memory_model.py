"""The analytic memory model against measured training steps (small shapes), its
linearity in the number of strata, and the strategies' effects on its terms."""

from __future__ import annotations

import json

import pytest
import torch

from ampflow.amp.memory_model import (
    ShapeSpec,
    chunked_score_elements,
    estimate_for_profile,
    fit_linear,
    predict,
    profile_memory,
)
from ampflow.model.attention import chunk_blocks
from ampflow.spec.config import ModelConfig
from ampflow.model.paired import PairedModel
from ampflow.spec.config import LossWeights
from ampflow.model.synthetic import synthetic_features, synthetic_graph
from ampflow.train.memory import measured_step


def _model(n, L, B, cfg: ModelConfig, G=12, dtype=torch.float32, seed=0):
    """A PairedModel on random shapes: all anchors at stratum 0, a random half of the
    valid pairs at each k >= 1, a random graph with both directions and self-loops."""
    g = torch.Generator().manual_seed(seed)
    anchor, stratum = synthetic_features(n, L, 0.5, 0, g)
    graph = synthetic_graph(G, n, g)
    torch.manual_seed(seed)
    model = PairedModel(cfg, G, anchor, stratum, L, graph).to(dtype)
    rna = torch.poisson(torch.full((B, G), 2.0), generator=g).to(dtype)
    hic = torch.poisson(torch.full((B, len(anchor)), 0.5), generator=g).to(dtype)
    fps = torch.bincount(stratum, minlength=L).tolist()
    spec = ShapeSpec.from_model(cfg, B, G, fps, n, graph.n_nodes, graph.src.numel(), dtype_bytes=torch.finfo(dtype).bits // 8)
    return model, rna, hic, spec


def _measure(model, rna, hic):
    """One step as the trainer runs it on CPU: (peak bytes, per-stratum marks)."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    _, peak, marks = measured_step(model, opt, rna, hic, LossWeights(), torch.Generator().manual_seed(1))
    return peak, marks


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
    assert abs(est.total - measured) <= 0.05 * measured
    assert len(est.marks) == L
    for p, m in zip(est.marks, marks):
        assert abs(p - m) <= 0.05 * m
    assert sum(est.components.values()) == est.total
    assert est.total == est.base + sum(est.strata)


def _spec(L, per_stratum=300, n=400, **kw):
    fps = [n] + [per_stratum] * (L - 1)
    args = dict(
        n_cells_batch=32, n_genes=200, n_features=sum(fps), features_per_stratum=fps, n_anchors=n,
        n_nodes=600, n_edges=3000, latent=16, hidden=64, D=32, heads=4, window=4,
    )  # fmt: skip
    args.update(kw)
    return ShapeSpec(**args)


@pytest.mark.parametrize("chunk, key_first", [(0, False), (32, True)])
def test_prediction_is_linear_in_the_number_of_strata(chunk, key_first):
    totals = [predict(_spec(L), chunk=chunk, key_first=key_first).total for L in range(2, 9)]
    steps = {b - a for a, b in zip(totals, totals[1:])}
    assert len(steps) == 1
    est = predict(_spec(8), chunk=chunk, key_first=key_first)
    assert steps == {est.per_stratum}
    assert est.total == est.base + 7 * est.per_stratum
    # a line fitted to M(L) has the per-stratum cost as slope, M_base - M_stratum as intercept
    slope, intercept = fit_linear(range(2, 9), totals)
    assert slope == pytest.approx(est.per_stratum)
    assert intercept == pytest.approx(est.base - est.per_stratum)


def test_chunked_attention_scores_follow_the_chunk_blocks():
    n, w, H, L, b = 400, 4, 4, 5, 4
    full = predict(_spec(L), chunk=0).components["stratum_attention_scores"]
    assert full == (L - 1) * (H * n * n * b + n * n)  # probabilities + bool mask
    for chunk in (1, 7, 32, 399, 400, 1000):
        blocks = sum((e - s) * (ke - ks) for s, e, ks, ke in chunk_blocks(n, w, chunk))
        assert chunked_score_elements(n, w, chunk) == blocks
        est = predict(_spec(L), chunk=chunk, strategies={"chunked_attention"})
        assert est.components["stratum_attention_scores"] == (L - 1) * H * blocks * b
        assert est.components["stratum_attention_scores"] < full
    with pytest.raises(ValueError):
        predict(_spec(L), chunk=0, strategies={"chunked_attention"})


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
    # decode: logits, softmax, scale halve; the n x D keys and the library do not
    n, D = 400, 32
    rest = 3 * (n * D * b + B * b)
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
    assert est == predict(_spec(4), chunk=32, key_first=True)
    assert estimate_for_profile(profile, ("chunked_attention",), 1, 1, 0) == predict(_spec(4))
    mem = profile_memory(profile)
    json.dumps(mem)
    assert mem["total_bytes"] == predict(_spec(4)).total
    assert mem["M_base_bytes"] + sum(mem["strata_bytes"]) == mem["total_bytes"]


def test_shape_spec_validation():
    with pytest.raises(ValueError):
        _spec(3, n_features=5)
    with pytest.raises(ValueError):
        _spec(3, D=30, heads=4)
    spec = ShapeSpec.from_model(ModelConfig(), 16, 10, [5, 4], 5, 15, 40)
    assert spec.n_features == 9 and spec.D == 32 and spec.n_strata == 2
