"""Model pieces: likelihoods against torch.distributions, and the single-process memory
savers (chunked attention S3, key-first decode S4) equal to the naive forms."""

from __future__ import annotations

import itertools

import pytest
import torch

from ampflow.model.decoders import StratifiedZINBDecoder
from ampflow.model.graph import GraphConv
from ampflow.model.prob import NB, ZINB

F64 = torch.float64


def test_nb_matches_torch_distributions():
    g = torch.Generator().manual_seed(0)
    mu = torch.rand(5, 7, generator=g, dtype=F64) * 20 + 0.1
    theta = torch.rand(7, generator=g, dtype=F64) * 5 + 0.2
    x = torch.randint(0, 30, (5, 7), generator=g).to(F64)
    ref = torch.distributions.NegativeBinomial(total_count=theta, logits=torch.log(mu) - torch.log(theta)).log_prob(x)
    assert torch.allclose(NB(mu, theta).log_prob(x), ref, atol=1e-6)


def test_zinb_is_a_mixture_with_a_point_mass_at_zero():
    g = torch.Generator().manual_seed(1)
    mu = torch.rand(4, 6, generator=g, dtype=F64) * 10 + 0.1
    theta = torch.rand(6, generator=g, dtype=F64) + 0.5
    zi = torch.randn(4, 6, generator=g, dtype=F64)
    x = torch.randint(0, 4, (4, 6), generator=g).to(F64)
    pi = torch.sigmoid(zi)
    nb = NB(mu, theta).log_prob(x).exp()
    expected = torch.where(x == 0, pi + (1 - pi) * nb, (1 - pi) * nb).log()
    assert torch.allclose(ZINB(mu, theta, zi).log_prob(x), expected, atol=1e-10)


def test_graph_conv_is_symmetric_normalised_propagation():
    src = torch.tensor([0, 1, 1, 2, 0, 1, 2])
    dst = torch.tensor([1, 0, 2, 1, 0, 1, 2])
    w = torch.tensor([0.5, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0], dtype=F64)
    sign = torch.tensor([1, 1, -1, -1, 1, 1, 1], dtype=F64)
    conv = GraphConv(src, dst, w, sign, 3)
    x = torch.randn(3, 2, dtype=F64)
    A = torch.zeros(3, 3, dtype=F64)
    A[dst, src] = sign * w
    deg = torch.zeros(3, dtype=F64).index_add_(0, dst, w)
    expected = (A / torch.sqrt(deg[:, None] * deg[None, :])) @ x
    assert torch.allclose(conv(x), expected, atol=1e-12)


def _decoder(chunk, key_first, n_anchors, n_strata, window, D, latent, seed, n_batches=0, scored=None):
    g = torch.Generator().manual_seed(seed)
    # every (anchor, stratum) pair that stays inside the anchors, some dropped at random
    feats = [(a, k) for k in range(n_strata) for a in range(n_anchors - k)]
    keep = torch.rand(len(feats), generator=g) < 0.8
    feats = [f for f, kp in zip(feats, keep) if kp or f[1] == 0]
    anchor = torch.tensor([a for a, _ in feats])
    stratum = torch.tensor([k for _, k in feats])
    torch.manual_seed(seed)
    dec = StratifiedZINBDecoder(latent, D, 2, window, 2, True, chunk, anchor, stratum, n_strata, key_first=key_first, n_batches=n_batches,
                                scored=scored)  # fmt: skip
    with torch.no_grad():  # non-trivial values for the zero-initialised parameters
        for p in dec.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return dec.double()


@pytest.mark.parametrize("n_anchors, n_strata, window, chunk, D", [(37, 4, 3, 5, 8), (20, 3, 7, 4, 6), (11, 5, 0, 16, 4)])
def test_chunked_attention_and_key_first_decode_equal_the_naive_model(n_anchors, n_strata, window, chunk, D):
    latent, B = 6, 5
    g = torch.Generator().manual_seed(7)
    u = torch.randn(B, latent, generator=g, dtype=F64)
    v = torch.randn(n_anchors, latent, generator=g, dtype=F64)
    totals = torch.rand(B, n_strata, generator=g, dtype=F64) * 100 + 10
    n_features = _decoder(0, False, n_anchors, n_strata, window, D, latent, seed=3).scale_lin.numel()
    x = torch.poisson(torch.full((B, n_features), 0.7, dtype=F64), generator=g)
    results = {}
    for c, kf in itertools.product((0, chunk), (False, True)):
        dec = _decoder(c, kf, n_anchors, n_strata, window, D, latent, seed=3)
        uu, vv = u.clone().requires_grad_(), v.clone().requires_grad_()
        loss = -dec(uu, vv, totals).log_prob(x).sum()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in dec.named_parameters()}
        grads["u"], grads["v"] = uu.grad, vv.grad
        results[(c, kf)] = (loss.detach(), grads)
    ref_loss, ref_grads = results[(0, False)]
    for key, (loss, grads) in results.items():
        assert torch.allclose(loss, ref_loss, rtol=0, atol=1e-10), key
        for name, gr in grads.items():
            assert torch.allclose(gr, ref_grads[name], rtol=0, atol=1e-10), (key, name)


@pytest.mark.parametrize("n_anchors, n_strata, window, chunk, D, key_first, n_batches", [
    (37, 4, 3, 0, 8, False, 0), (20, 3, 7, 0, 6, True, 0), (11, 5, 0, 4, 4, False, 2), (25, 6, 2, 0, 6, True, 3),
])  # fmt: skip
def test_stacked_strata_equal_the_loop_over_strata(n_anchors, n_strata, window, chunk, D, key_first, n_batches):
    """Every stratum in one pass (``stack_strata``, the training step's) against the
    loop over strata, one block at a time (what the parallel strategies are proven
    against): means, loss and every gradient (parameters, cell and anchor latents,
    batch indicators) in float64; the per-stratum hook keeps the loop."""
    latent, B = 6, 5
    g = torch.Generator().manual_seed(11)
    u = torch.randn(B, latent, generator=g, dtype=F64)
    v = torch.randn(n_anchors, latent, generator=g, dtype=F64)
    cond = torch.nn.functional.one_hot(torch.arange(B) % n_batches, n_batches).to(F64) if n_batches else None
    totals = torch.rand(B, n_strata, generator=g, dtype=F64) * 100 + 10
    results, hooked = {}, []
    for stacked in (False, True):
        dec = _decoder(chunk, key_first, n_anchors, n_strata, window, D, latent, seed=5, n_batches=n_batches)
        dec.stack_strata = stacked
        if stacked:  # a per-stratum hook asks for the loop
            dec(u, v, totals, on_stratum=hooked.append, cond=cond)
        x = torch.poisson(torch.full((B, dec.scale_lin.numel()), 0.7, dtype=F64), generator=torch.Generator().manual_seed(2))
        uu, vv = u.clone().requires_grad_(), v.clone().requires_grad_()
        cc = None if cond is None else cond.clone().requires_grad_()
        z = dec(uu, vv, totals, cond=cc)
        loss = -z.log_prob(x).sum()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in dec.named_parameters()}
        grads["u"], grads["v"] = uu.grad, vv.grad
        if cc is not None:
            grads["cond"] = cc.grad
        results[stacked] = (z.mu.detach(), loss.detach(), grads)
    assert hooked == list(range(n_strata))
    (mu0, loss0, g0), (mu1, loss1, g1) = results[False], results[True]
    scale = max(float(x.abs().max()) for x in g0.values())
    torch.testing.assert_close(mu1, mu0, rtol=1e-12, atol=0)
    torch.testing.assert_close(loss1, loss0, rtol=1e-12, atol=0)
    assert g0.keys() == g1.keys()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=0, atol=1e-12 * scale, msg=name)


@pytest.mark.parametrize("scored", [(1, 3), (0, 0), (2, 4), (1, 4)])
def test_the_likelihood_scores_the_strata_asked_for(scored):
    """``scored`` strata (``model.hic_likelihood: reach``): the loss is the mean of the
    scored strata's log-likelihoods, picked by each feature's own stratum (a mask, not
    the decoder's range), and no gradient reaches what only other strata decode; every
    stratum is still decoded. (1, 4) on 5 strata leaves out only the diagonal."""
    n_anchors, n_strata, latent, B = 17, 5, 6, 4
    g = torch.Generator().manual_seed(3)
    u = torch.randn(B, latent, generator=g, dtype=F64)
    v = torch.randn(n_anchors, latent, generator=g, dtype=F64)
    totals = torch.rand(B, n_strata, generator=g, dtype=F64) * 100 + 10
    dec = _decoder(0, False, n_anchors, n_strata, 3, 6, latent, seed=4, scored=scored)
    x = torch.poisson(torch.full((B, dec.scale_lin.numel()), 0.7, dtype=F64), generator=g)
    mask = (dec.feature_stratum >= scored[0]) & (dec.feature_stratum <= scored[1])
    expected = -dec(u, v, totals).log_prob(x)[:, mask].sum() / (B * int(mask.sum()))
    loss = dec.mean_nll(u, v, totals, x)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
    loss.backward()
    assert bool(dec.bias.grad[mask].abs().min() > 0) and bool((dec.bias.grad[~mask] == 0).all())
    for k, block in enumerate(dec.blocks, start=1):  # stratum k's attention block
        grads = torch.cat([p.grad.flatten() for p in block.parameters() if p.grad is not None] or [torch.zeros(1, dtype=F64)])
        assert bool((grads.abs().max() > 0) == (scored[0] <= k <= scored[1])), k
    # every feature scored: the whole mean, as without ``scored``
    full = _decoder(0, False, n_anchors, n_strata, 3, 6, latent, seed=4, scored=(0, n_strata - 1))
    assert full.scored_features is None
    torch.testing.assert_close(full.mean_nll(u, v, totals, x), -full(u, v, totals).log_prob(x).mean(), rtol=0, atol=0)


def test_a_reach_without_features_is_an_error_naming_the_key():
    """The default reach leaves out the diagonal: on data of the diagonal alone the
    likelihood would score nothing (and the encoder read nothing)."""
    from synthetic_shapes import synthetic_features, synthetic_graph

    from ampflow.base.errors import InputError
    from ampflow.contract.config import ModelConfig
    from ampflow.model.paired import PairedModel

    g = torch.Generator().manual_seed(0)
    anchor, stratum = synthetic_features(6, 1, 0.5, 0, g)
    graph = synthetic_graph(0, 6, g)
    with pytest.raises(InputError, match=r"model\.hic_likelihood.*strata 1-0 of the data's 1.*no feature"):
        PairedModel(ModelConfig(), 0, anchor, stratum, 1, graph)
    PairedModel(ModelConfig(hic_likelihood="all"), 0, anchor, stratum, 1, graph)  # every feature: the diagonal's


def test_alignment_pulls_only_the_shared_dimensions():
    """The align term reads the first latent_dim - private_dim dimensions of the Hi-C
    latent: its gradient on the private rows of the Hi-C encoder's head is exactly zero,
    on the shared rows it is not, and moving the private rows leaves the term unchanged."""
    from synthetic_shapes import synthetic_features, synthetic_graph

    from ampflow.contract.config import LossWeights, ModelConfig
    from ampflow.model.paired import PairedModel

    g = torch.Generator().manual_seed(0)
    cfg = ModelConfig(latent_dim=8, private_dim=3, hidden_dim=16, heads=2, window=2, attention=False, dropout=0.0)
    anchor, stratum = synthetic_features(12, 3, 0.8, 0, g)
    model = PairedModel(cfg, 10, anchor, stratum, 3, synthetic_graph(10, 12, g)).double().eval()
    rna = torch.poisson(torch.full((6, 10), 3.0, dtype=F64), generator=g)
    hic = torch.poisson(torch.full((6, len(anchor)), 1.0, dtype=F64), generator=g)
    weights = LossWeights(kl=0.0, hic_kl=0.0, graph=0.0, align=1.0, cross=0.0)
    align = model(rna, hic, weights)["align"]
    align.backward()
    head = model.hic_encoder.loc.weight.grad  # (latent_dim, hidden)
    s = cfg.shared_dim
    assert s == 5
    assert torch.count_nonzero(head[s:]) == 0
    assert torch.count_nonzero(head[:s]) > 0
    with torch.no_grad():
        model.hic_encoder.loc.weight[s:] += 1.0
        assert model(rna, hic, weights)["align"] == align.detach()
        model.hic_encoder.loc.weight[:s] += 1.0
        assert model(rna, hic, weights)["align"] != align.detach()


def test_the_encoder_reads_its_copy_and_the_likelihood_the_counts():
    """``hic_in`` (``train.hic_thinned: encoder``): the encoder's terms (its KL, the
    alignment) are those of a forward on the copy, and with an encoder blind to its input
    (first layer's weights zero) the Hi-C likelihood is that of a forward on the counts,
    not on the copy: the likelihood and its per-stratum totals read ``hic``. A copy equal
    to the counts is the forward without one, bit for bit."""
    from synthetic_shapes import synthetic_features, synthetic_graph

    from ampflow.contract.config import LossWeights, ModelConfig
    from ampflow.model.paired import PairedModel

    g = torch.Generator().manual_seed(0)
    cfg = ModelConfig(latent_dim=8, hidden_dim=16, heads=2, window=2, attention=False, dropout=0.0, hic_likelihood="all", hic_pcs=0)
    anchor, stratum = synthetic_features(12, 3, 0.8, 0, g)
    model = PairedModel(cfg, 10, anchor, stratum, 3, synthetic_graph(10, 12, g)).double().eval()
    rna = torch.poisson(torch.full((6, 10), 3.0, dtype=F64), generator=g)
    hic = torch.poisson(torch.full((6, len(anchor)), 2.0, dtype=F64), generator=g)
    copy = torch.binomial(hic, torch.full_like(hic, 0.4), generator=g)
    assert copy.sum() < hic.sum()
    weights = LossWeights()
    on_copy, on_counts, both = model(rna, copy, weights), model(rna, hic, weights), model(rna, hic, weights, hic_in=copy)
    for term in ("hic_kl", "align"):
        assert both[term] == on_copy[term] and both[term] != on_counts[term], term
    assert both["hic_nll"] != on_copy["hic_nll"]
    torch.manual_seed(1)  # the graph loss's edge sampling
    same = model(rna, hic, weights, hic_in=hic.clone())
    torch.manual_seed(1)
    plain = model(rna, hic, weights)
    assert same.keys() == plain.keys() and all(torch.equal(same[k], plain[k]) for k in plain)
    with torch.no_grad():
        model.hic_encoder.body[0].weight.zero_()
    blind_copy, blind_counts, blind_both = model(rna, copy, weights), model(rna, hic, weights), model(rna, hic, weights, hic_in=copy)
    assert blind_both["hic_nll"] == blind_counts["hic_nll"] != blind_copy["hic_nll"]
