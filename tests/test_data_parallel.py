"""S1 data parallelism against one process: the same loss, every gradient and the
parameters after an Adam step, on 2 and 4 gloo processes, for contiguous and
work-balanced splits; the group BatchNorm alone against nn.BatchNorm1d; the splits."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from dist_helpers import run_world
from parallel_equivalence import LR, WEIGHTS, _adam_tolerance, _snapshot, fit_hic_input
from synthetic_shapes import synthetic_features, synthetic_graph

from ampflow.contract.config import ModelConfig
from ampflow.model.paired import PairedModel
from ampflow.parallel.data_parallel import DataParallelStep, balanced_split, contiguous_split, draw_noise, parallelize_data_parallel, work_ratio
from ampflow.parallel.mesh import Mesh
from ampflow.parallel.sync_batchnorm import SyncBatchNorm1d, convert_sync_batchnorm

F64 = torch.float64
B = 12


def _skewed_contacts():
    """Contacts per cell: sorted and steep, so contiguous rows are badly unbalanced."""
    return torch.tensor([400.0, 350, 300, 120, 80, 60, 40, 30, 20, 10, 5, 0])


def _problem(dtype, dropout=0.0, n_anchors=9, L=3, G=7, seed=0):
    """A small PairedModel (random strata features and graph) and a batch of B cells
    whose Hi-C depth follows :func:`_skewed_contacts`."""
    g = torch.Generator().manual_seed(seed)
    anchor, stratum = synthetic_features(n_anchors, L, 0.7, 0, g)
    graph = synthetic_graph(G, n_anchors, g)
    cfg = ModelConfig(latent_dim=6, hidden_dim=16, heads=2, window=2, dropout=dropout, graph_batch=64)
    torch.manual_seed(seed)
    model = PairedModel(cfg, G, anchor, stratum, L, graph).to(dtype)
    with torch.no_grad():  # move the zero-initialised decoder parameters off zero
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=dtype))
    rna = torch.poisson(torch.full((B, G), 3.0, dtype=F64), generator=g).to(dtype)
    depth = (_skewed_contacts() + 1).to(F64) / len(anchor)
    hic = torch.poisson(depth.unsqueeze(1).expand(B, len(anchor)), generator=g).to(dtype)
    fit_hic_input(model, hic, stratum)
    return model, rna, hic


def _reference(dtype):
    """One process, the full batch, the same noise and graph samples as the ranks draw."""
    model, rna, hic = _problem(dtype)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(5)
    terms = model(rna, hic, WEIGHTS, generator=gen, noise=draw_noise(model, B, gen))
    terms["total"].backward()
    opt.step()
    return _snapshot(model, terms)


def _dp_worker(rank, world):
    out = {}
    for dtype in (F64, torch.float32):
        for split in ("contiguous", "balanced"):
            model, rna, hic = _problem(dtype)
            mesh = Mesh.build(world, 1)
            model = parallelize_data_parallel(model, mesh)
            model.train()
            opt = torch.optim.Adam(model.parameters(), lr=LR)
            step, gen = DataParallelStep(mesh), torch.Generator().manual_seed(5)
            if split == "contiguous":  # every rank given the whole batch
                rows = contiguous_split(B, world)[mesh.dp_rank]
                terms = step.step(model, opt, rna, hic, WEIGHTS, rows, generator=gen)
            else:  # every rank given its own rows only, as a trainer would load them
                rows = balanced_split(hic.sum(1), world)[mesh.dp_rank]
                terms = step.step(model, opt, rna[rows], hic[rows], WEIGHTS, rows, batch_size=B, generator=gen)
            out[(dtype, split)] = _snapshot(model, terms)
    return out


def _assert_close(a, b, dtype, what):
    if not b.is_floating_point():  # masks and counts: equal, in every precision
        assert torch.equal(a, b), f"{what}: {a} != {b}"
    elif dtype == F64:
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=lambda m: f"{what}: {m}")
    else:
        # relative to the tensor's size: single elements near zero carry only rounding
        err = float((a - b).abs().max())
        assert err <= 1e-5 * max(float(b.abs().max()), 1e-3), f"{what}: max error {err}"


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_step_equals_one_process(tmp_path, world):
    refs = {dtype: _reference(dtype) for dtype in (F64, torch.float32)}
    results = run_world(_dp_worker, world, tmp_path)
    for rank, res in enumerate(results):
        for (dtype, split), got in res.items():
            ref = refs[dtype]
            tag = f"world {world} rank {rank} {split} {dtype}"
            assert got["terms"].keys() == ref["terms"].keys()
            for k in ref["terms"]:
                _assert_close(got["terms"][k], ref["terms"][k], dtype, f"{tag} term {k}")
            for n in ref["grads"]:
                _assert_close(got["grads"][n], ref["grads"][n], dtype, f"{tag} grad {n}")
            for n in ref["params"]:
                tol = _adam_tolerance(ref["grads"][n], dtype)
                err = (got["params"][n] - ref["params"][n]).abs()
                assert bool((err <= tol).all()), f"{tag} param {n}: max error {float(err.max())}"
            for n in ref["buffers"]:  # BatchNorm running statistics included
                _assert_close(got["buffers"][n].to(ref["buffers"][n].dtype), ref["buffers"][n], dtype, f"{tag} buffer {n}")


def test_one_rank_step_is_the_plain_step_bit_for_bit():
    # dropout on: with one rank nothing about the sampling changes either
    def plain():
        model, rna, hic = _problem(torch.float32, dropout=0.2)
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        torch.manual_seed(11)
        opt.zero_grad(set_to_none=True)
        terms = model(rna, hic, WEIGHTS, generator=torch.Generator().manual_seed(5))
        terms["total"].backward()
        opt.step()
        return _snapshot(model, terms)

    def one_rank():
        model, rna, hic = _problem(torch.float32, dropout=0.2)
        mesh = Mesh.build(1, 1)
        model = parallelize_data_parallel(model, mesh)
        assert not any(isinstance(m, SyncBatchNorm1d) for m in model.modules())
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        torch.manual_seed(11)
        terms = DataParallelStep(mesh).step(model, opt, rna, hic, WEIGHTS, torch.arange(B), generator=torch.Generator().manual_seed(5))
        return _snapshot(model, terms)

    a, b = plain(), one_rank()
    for part in ("terms", "grads", "params", "buffers"):
        assert a[part].keys() == b[part].keys()
        for k in a[part]:
            assert torch.equal(a[part][k], b[part][k]), (part, k)


# ----------------------------------------------------------------- BatchNorm alone
def _bn_data(shape):
    g = torch.Generator().manual_seed(2)
    # an offset far from zero: the statistics must not cancel catastrophically
    x = torch.randn(*shape, generator=g, dtype=F64) * 0.5 + 3.0
    c = torch.randn(*shape, generator=g, dtype=F64)
    return x, c


BN_CASES = [((10, 5), 0.1), ((9, 4, 3), None)]  # (input shape, momentum)


def _bn_worker(rank, world):
    out = []
    for shape, momentum in BN_CASES:
        mesh = Mesh.build(world, 1)
        torch.manual_seed(0)
        bn = convert_sync_batchnorm(nn.BatchNorm1d(shape[1], momentum=momentum).double(), mesh.dp_group)
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
        # uneven shares: the first rank holds a single row
        bounds = [0, 1] + [1 + (shape[0] - 1) * (r + 1) // (world - 1) for r in range(world - 1)]
        rows = torch.arange(bounds[rank], bounds[rank + 1])
        x_full, c_full = _bn_data(shape)
        steps = []
        for step in range(2):  # two steps: the running averages and the batch counter
            x = (x_full[rows] * (1 + step)).requires_grad_()
            y = bn(x)
            (y * c_full[rows]).sum().backward()
            steps.append({"y": y.detach(), "gx": x.grad})
        grads = {"weight": bn.weight.grad.clone(), "bias": bn.bias.grad.clone()}
        torch.distributed.all_reduce(grads["weight"])
        torch.distributed.all_reduce(grads["bias"])
        stats = {n: b.clone() for n, b in bn.named_buffers()}
        bn.eval()
        out.append({"rows": rows, "steps": steps, "grads": grads, "stats": stats, "eval": bn(x_full[rows]).detach()})
    return out


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_group_batchnorm_equals_batchnorm_on_the_full_batch(tmp_path, world):
    results = run_world(_bn_worker, world, tmp_path)
    for case, (shape, momentum) in enumerate(BN_CASES):
        torch.manual_seed(0)
        bn = nn.BatchNorm1d(shape[1], momentum=momentum).double()
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
        x_full, c_full = _bn_data(shape)
        steps = []
        for step in range(2):
            x = (x_full * (1 + step)).requires_grad_()
            y = bn(x)
            (y * c_full).sum().backward()
            steps.append({"y": y.detach(), "gx": x.grad})
        bn.eval()
        expect_eval = bn(x_full).detach()
        for res in results:
            r = res[case]
            for got, ref in zip(r["steps"], steps):
                torch.testing.assert_close(got["y"], ref["y"][r["rows"]], rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(got["gx"], ref["gx"][r["rows"]], rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(r["grads"]["weight"], bn.weight.grad, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(r["grads"]["bias"], bn.bias.grad, rtol=1e-10, atol=1e-12)
            for n, b in bn.named_buffers():
                torch.testing.assert_close(r["stats"][n], b, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(r["eval"], expect_eval[r["rows"]], rtol=1e-12, atol=1e-12)


def test_conversion_keeps_parameters_and_buffers():
    model, _, _ = _problem(F64)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm1d):
                m.running_mean.uniform_()
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    opt = torch.optim.Adam(model.parameters())
    convert_sync_batchnorm(model, None)
    assert sum(isinstance(m, SyncBatchNorm1d) for m in model.modules()) == 4
    # the very Parameter objects the optimizer holds
    assert all(params[n] is p for n, p in model.named_parameters())
    assert {id(p) for p in opt.param_groups[0]["params"]} == {id(p) for p in model.parameters()}
    assert all(torch.equal(buffers[n], b) for n, b in model.named_buffers())
    # a group of one is exactly nn.BatchNorm1d
    x = torch.randn(6, 16, dtype=F64)
    ref = nn.BatchNorm1d(16).double()
    assert torch.equal(SyncBatchNorm1d(16, group=None).double()(x), ref(x))


# ----------------------------------------------------------------- splits
def test_balanced_split_is_deterministic_complete_and_better_balanced():
    contacts = _skewed_contacts()
    for dp in (2, 3, 4):
        split = balanced_split(contacts, dp)
        assert [t.tolist() for t in split] == [t.tolist() for t in balanced_split(contacts.clone(), dp)]
        assert sorted(torch.cat(split).tolist()) == list(range(B))
        assert all(len(rows) >= 1 for rows in split)
        assert work_ratio(contacts, split) < work_ratio(contacts, contiguous_split(B, dp))
    assert work_ratio(contacts, balanced_split(contacts, 2)) < 1.01
    # contact-free cells are spread by count, never piled onto one rank
    assert [len(r) for r in balanced_split(torch.zeros(8), 4)] == [2, 2, 2, 2]
    assert [len(r) for r in contiguous_split(10, 4)] == [3, 3, 2, 2]


STEPS = 20


def _single_process_losses():
    model, rna, hic = _problem(F64)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        terms = model(rna, hic, WEIGHTS, generator=gen, noise=draw_noise(model, B, gen))
        terms["total"].backward()
        opt.step()
        losses.append(terms["total"].detach())
    return torch.stack(losses)


def _dp_losses(rank, world):
    model, rna, hic = _problem(F64)
    mesh = Mesh.build(world, 1)
    model = parallelize_data_parallel(model, mesh)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    step, gen = DataParallelStep(mesh), torch.Generator().manual_seed(5)
    rows = balanced_split(hic.sum(1), world)[mesh.dp_rank]
    return torch.stack([step.step(model, opt, rna, hic, WEIGHTS, rows, generator=gen)["total"].detach() for _ in range(STEPS)])


@pytest.mark.dist
def test_twenty_steps_in_fp64_follow_one_process(tmp_path):
    """Over many optimizer steps the data-parallel run stays on the single-process
    trajectory in fp64 (in fp32, Adam magnifies rounding in exactly-zero gradients)."""
    ref = _single_process_losses()
    for losses in run_world(_dp_losses, 2, tmp_path):
        torch.testing.assert_close(losses, ref, rtol=1e-9, atol=0)
