"""The problem every parallel-strategy test compares with one process, and the comparison.

A small paired model, its batch (and, for one config, the thinned copy its Hi-C
encoder reads: ``encoder_input``) and the single-process reference (``_problem``,
``_reference``, ``_truth`` computed in fp64), each strategy set's worker (``_tp_worker``)
and the check of a rank against the reference (``assert_rank_matches``, ``_check``) with
Adam's tolerance (``_adam_tolerance``). Used by tests/test_tensor_parallel.py,
test_data_parallel.py, test_hic_only.py and test_gpu_train.py.
"""

from __future__ import annotations

import torch
from synthetic_shapes import synthetic_features, synthetic_graph

from ampflow.contract.config import LossWeights, ModelConfig
from ampflow.contract.plan import Plan
from ampflow.contract.strategies import BUILT_IN
from ampflow.model.encoders import stratum_totals
from ampflow.model.paired import PairedModel
from ampflow.parallel.clip import clip_gradients
from ampflow.parallel.data_parallel import DataParallelStep, balanced_split, draw_noise
from ampflow.parallel.mesh import Mesh
from ampflow.parallel.parallelize import full_state, load_full_state, parallelize

F64 = torch.float64
B = 12
WEIGHTS = LossWeights(kl=1.0, graph=0.5, align=2.0, cross=0.5)  # every term with a visible share
LR = 1e-2
NOISE_SEED, GLOBAL_SEED = 5, 7
#: every step clips the gradient's norm (``train.clip_grad_norm``) to this, far below the
#: problem's norm, so that the clipping factor (the whole model's norm, over shards and
#: ranks) is part of every gradient compared
CLIP = 1e-3

# strategy sets of the acceptance list: (ids, dp, tp) for a world of W processes
SETS = {
    "S1": lambda W: (["S1"], W, 1),
    "S2+S4": lambda W: (["S2", "S4"], 1, W),
    "S3": lambda W: (["S3"], 1, W),
    "S3+S5": lambda W: (["S3", "S5"], 1, W),
    "S2+S3+S4+S5": lambda W: (["S2", "S3", "S4", "S5"], 1, W),
    "dp2xtp2 all": lambda W: (["S1", "S2", "S3", "S4", "S5"], 2, W // 2),
}
NAMES = {f"S{i}": name for i, name in enumerate(BUILT_IN, start=1)}
CONFIGS = {
    # D != latent (a u projection), heads of width 8; the likelihood scores the strata the
    # encoder reads, 1 and 2 of the problem's 4 (a range of features within every rank's
    # share; stratum 3's block decoded and not scored)
    "wide": dict(latent_dim=6, hidden_dim=16, decoder_dim=16, heads=2, window=2, hic_max_stratum=2),
    # D == latent: u itself is split over the channels; the likelihood scores every feature
    "narrow": dict(latent_dim=8, hidden_dim=16, heads=2, window=3, hic_likelihood="all"),
}
#: Batches the decoders are conditioned on, per config ("narrow": the loadings' batch
#: columns, sharded with the features under S2, and the RNA bias per batch)
BATCHES = {"wide": 0, "narrow": 3}
#: Whether the Hi-C encoder reads its own thinned copy of the batch, per config
#: (``train.hic_thinned: encoder``; "narrow": every strategy set runs with it)
ENCODER_COPY = {"wide": False, "narrow": True}


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _assert_close(a, b, dtype, what, bound=1e-5):
    """fp64: elementwise to 1e-9 relative (1e-11 absolute). fp32: the relative error of
    the tensor, ||a - b|| / ||b|| in the 2-norm, to ``bound`` (single elements near zero
    carry nothing but rounding)."""
    if dtype == F64:
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=lambda m: f"{what}: {m}")
    else:
        err = _rel(a, b)
        assert err <= bound, f"{what}: relative error {err:.3g} (bound {bound:.3g})"
        WORST[0] = max(WORST[0], err)


WORST = [0.0]


def _plan(ids, dp, tp, chunk=3):
    return Plan.from_dict({
        "mesh": {"dp": dp, "tp": tp},
        "strategies": [{"id": i, "name": NAMES[i]} for i in ids],
        "chunk_size": chunk if "S3" in ids else 0,
        "key_first": "S4" in ids,
    })  # fmt: skip


def fit_hic_input(model, hic: torch.Tensor, stratum: torch.Tensor) -> None:
    """The Hi-C input's projection (``model.hic_pcs``) fitted on a problem's cells, as
    training fits it on its training cells: unfitted axes give every cell the same zero
    input, whose gradients vanish in exact arithmetic and leave rounding to compare."""
    if model.hic_input.pcs:
        counts = hic.double()
        model.hic_input.fit(stratum_totals(counts, stratum, model.hic_input.n_strata), counts.numpy())


def encoder_input(config, hic: torch.Tensor) -> torch.Tensor | None:
    """What the Hi-C encoder of ``config`` reads apart from ``hic`` (None: ``hic``
    itself): each contact kept with probability 1/2, one fixed draw in fp64 on the
    host, so the fp32 and fp64 problems and every device read the same whole numbers."""
    if not ENCODER_COPY[config]:
        return None
    counts = hic.detach().to("cpu", F64)
    kept = torch.binomial(counts, torch.full_like(counts, 0.5), generator=torch.Generator().manual_seed(11))
    assert 0 < kept.sum() < counts.sum()  # a copy that differs from the counts
    return kept.to(hic.device, hic.dtype)


def _problem(dtype, config, n_anchors=9, L=4, G=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    anchor, stratum = synthetic_features(n_anchors, L, 0.7, 0, g)
    graph = synthetic_graph(G, n_anchors, g)
    cfg = ModelConfig(dropout=0.0, graph_batch=64, **CONFIGS[config])
    torch.manual_seed(seed)
    n_batches = BATCHES[config]
    model = PairedModel(cfg, G, anchor, stratum, L, graph, n_batches).to(F64)
    with torch.no_grad():  # move the zero-initialised decoder parameters off zero
        # the key term at full weight (not softplus(-5) as training starts), so that the
        # blocks' gradients are not scaled down 150-fold
        model.hic_decoder.scale_lin.zero_()
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=F64))
    rna = torch.poisson(torch.full((B, G), 0.8, dtype=F64), generator=g)  # sparse, as scRNA is
    depth = torch.linspace(2.0, 0.2, B, dtype=F64)
    hic = torch.poisson(depth.unsqueeze(1).expand(B, len(anchor)), generator=g)
    fit_hic_input(model, hic, stratum)
    cond = torch.nn.functional.one_hot(torch.arange(B) % n_batches, n_batches).to(dtype) if n_batches else None
    # one problem in both precisions: the fp32 one is the fp64 one rounded
    return model.to(dtype), rna.to(dtype), hic.to(dtype), cond


def _reference(dtype, config, dp):
    """One process, the full batch. With dp > 1 the noise comes from the shared
    generator (as the data-parallel step draws it); with dp = 1 from the global RNG."""
    model, rna, hic, cond = _problem(dtype, config)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(NOISE_SEED)
    torch.manual_seed(GLOBAL_SEED)
    noise = draw_noise(model, B, gen) if dp > 1 else None
    terms = model(rna, hic, WEIGHTS, generator=gen, noise=noise, cond=cond, hic_in=encoder_input(config, hic))
    terms["total"].backward()
    _clip(model)
    opt.step()
    return _snapshot(model, terms)


def _clip(model) -> None:
    """The clipping every step of these tests does (:data:`CLIP`), checked to bite."""
    norm = float(clip_gradients(model, CLIP))
    assert norm > 10 * CLIP, f"the problem's gradient norm {norm:.3g} is too small for clipping at {CLIP} to bite"


def _truth(config, dp):
    """The fp32 reference computed in fp64: the same problem and the same noise (drawn
    in fp32 as the fp32 run draws it, then widened: the generators draw other numbers
    in fp64), so what separates the two is the fp32 run's rounding alone."""
    model, rna, hic, cond = _problem(F64, config)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(NOISE_SEED)
    torch.manual_seed(GLOBAL_SEED)
    n_nodes, d = model.graph_encoder.embedding.shape
    device = model.graph_encoder.embedding.device
    # dp = 1: the model's own draws, from the global RNG of the device it is on
    src, where = (gen, gen.device) if dp > 1 else (None, device)

    def draw(n):
        return torch.randn(n, d, generator=src, dtype=torch.float32, device=where).to(device, F64)

    noise = (draw(B), draw(B), draw(n_nodes))
    terms = model(rna, hic, WEIGHTS, generator=gen, noise=noise, cond=cond, hic_in=encoder_input(config, hic))
    terms["total"].backward()
    _clip(model)
    opt.step()
    return _snapshot(model, terms)


def _tp_worker(rank, world, cases):
    out = {}
    for name, config, dtype in cases:
        ids, dp, tp = SETS[name](world)
        model, rna, hic, cond = _problem(dtype, config)
        mesh = Mesh.build(dp, tp)
        model = parallelize(model, _plan(ids, dp, tp), mesh)
        model.train()
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        gen = torch.Generator().manual_seed(NOISE_SEED)
        torch.manual_seed(GLOBAL_SEED)
        rows = balanced_split(hic.sum(1), dp)[mesh.dp_rank]
        cond = None if cond is None else cond[rows]
        hic_in = encoder_input(config, hic)
        hic_in = None if hic_in is None else hic_in[rows.to(hic_in.device)]
        terms = DataParallelStep(mesh, clip=CLIP).step(model, opt, rna[rows], hic[rows], WEIGHTS, rows, batch_size=B, generator=gen, cond=cond,
                                                       hic_in=hic_in)  # fmt: skip
        snap = _snapshot(model, terms)
        snap["shards"] = dict(model.shards)
        # the consolidated state is the single-process one, and loads back
        state, opt_state = full_state(model, opt)
        snap["full_params"] = {n: state[n] for n in snap["params"]}
        load_full_state(model, state, opt, opt_state)
        snap["reloaded"] = all(torch.equal(p, snap["params"][n]) for n, p in model.named_parameters())
        out[(name, config, dtype)] = snap
    return out


def assert_rank_matches(got: dict, ref: dict, dtype, tag: str, close=None, truth=None) -> None:
    """One rank's loss terms, gradients and parameters after one Adam step equal the
    single-process reference's (each parameter's slice where the rank holds a shard);
    terms and gradients compared by ``close`` (default this module's tolerances).

    With ``truth``, the fp32 reference computed in fp64 (:func:`_truth`), an fp32 rank's
    terms and gradients are compared with the truth instead, to six times the single
    process's worst relative rounding error over all of them (at least 1e-5). Sharded
    sums add in another order: on a tensor that cancels (a bias gradient summed over
    signed rows) a 4-rank S2+S3+S4+S5 run measured 1.03e-5 from fp64 where the one
    process was 2.9e-6 on that tensor and 5e-6 at worst; with the decoder's per-feature
    loadings, a 4-rank narrow S3+S5 run measured 2.32e-5 on ``blocks.1.w_out.bias``
    against the one process's worst 4.7e-6 (4.9 times), and with its likelihood over
    strata 1-2 alone 1.27e-5 against 2.05e-6 (6.2 times; the fp64 runs equal to 1e-9),
    so the scored reach is the wide problem's. fp32 promises the accuracy
    class of one process; exactness is the fp64 runs' proof (1e-9 elementwise)."""
    close = close or _assert_close
    shards = got["shards"]

    def local(n, full):
        return shards[n].take(full) if n in shards else full

    assert got["terms"].keys() == ref["terms"].keys()
    assert got["grads"].keys() == ref["grads"].keys()
    if truth is not None and dtype != F64:
        one = [_rel(ref[kind][n], truth[kind][n]) for kind in ("terms", "grads") for n in ref[kind]]
        assert max(one) <= 1e-4, f"{tag}: the fp32 reference is {max(one):.3g} from fp64, more than rounding"
        bound = max(1e-5, 6 * max(one))
        for k in ref["terms"]:
            close(got["terms"][k], truth["terms"][k], dtype, f"{tag} term {k} (vs fp64)", bound=bound)
        for n in ref["grads"]:
            close(got["grads"][n], local(n, truth["grads"][n]), dtype, f"{tag} grad {n} (vs fp64)", bound=bound)
    else:
        for k in ref["terms"]:
            close(got["terms"][k], ref["terms"][k], dtype, f"{tag} term {k}")
        for n in ref["grads"]:
            close(got["grads"][n], local(n, ref["grads"][n]), dtype, f"{tag} grad {n}")
    for n in ref["params"]:
        tol = _adam_tolerance(local(n, ref["grads"][n]), dtype)
        err = (got["params"][n] - local(n, ref["params"][n])).abs()
        assert bool((err <= tol).all()), f"{tag} param {n}: max error {float(err.max())}"


def _check(world, results, cases):
    for name, config, dtype in cases:
        _, dp, _ = SETS[name](world)
        ref = _reference(dtype, config, dp)
        truth = _truth(config, dp) if dtype != F64 else None
        for rank, res in enumerate(results):
            got = res[(name, config, dtype)]
            tag = f"{name} {config} world {world} rank {rank} {dtype}"
            assert_rank_matches(got, ref, dtype, tag, truth=truth)
            shards = got["shards"]
            for n in ref["params"]:
                full_tol = _adam_tolerance(ref["grads"][n], dtype)
                full_err = (got["full_params"][n] - ref["params"][n]).abs()
                assert bool((full_err <= full_tol).all()), f"{tag} consolidated {n}: max error {float(full_err.max())}"
            assert got["reloaded"], tag
            if world > 1 and name != "S1" and name != "S3":  # something is really sharded
                assert shards, tag


ALL = [(name, config, dtype) for name in SETS for config in CONFIGS for dtype in (F64, torch.float32)]


def _snapshot(model, terms):
    return {
        "terms": {k: v.detach().clone() for k, v in terms.items()},
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
    }


def _adam_tolerance(grad, dtype):
    """Per element: how far one Adam step may move a parameter given the gradient error.

    Adam's first step is lr * f(g) with f(g) = g / (|g| + eps), monotone in g, so a
    gradient known to within d changes the step by at most lr * max(f(g + d) - f(g),
    f(g) - f(g - d)). Near g = 0 (gradients that vanish in exact arithmetic, e.g. a
    bias whose unit is linear on every cell before BatchNorm) that is up to lr * d / eps:
    rounding noise there moves the parameter visibly, in fp32 by up to 2 lr. d is 1e-13
    in fp64 and 1e-5 of the tensor's largest gradient in fp32; plus the parameter's own
    rounding.
    """
    g = grad.double()
    d = 1e-13 if dtype == F64 else 1e-5 * float(g.abs().max())
    rounding = 1e-12 if dtype == F64 else 1e-6

    def f(x):
        return x / (x.abs() + 1e-8)

    return rounding + LR * torch.maximum(f(g + d) - f(g), f(g) - f(g - d)).to(grad.dtype)
