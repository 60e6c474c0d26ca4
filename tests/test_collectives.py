"""Autograd-aware collectives and the mesh, on 2 and 4 gloo processes against one process."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import run_world

from ampflow.parallel.collectives import all_reduce_sum, copy_to_group, reduce_from_group
from ampflow.parallel.data_parallel import sum_gradients
from ampflow.parallel.mesh import Mesh

pytestmark = pytest.mark.dist
F64 = torch.float64


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(5, 8, generator=g, dtype=F64), torch.randn(8, 12, generator=g, dtype=F64)


def _sharded_linear(rank, world):
    mesh = Mesh.build(1, world)
    x, w = _data()
    rows = torch.tensor_split(torch.arange(8), world)[mesh.tp_rank]
    cols = torch.tensor_split(torch.arange(12), world)[mesh.tp_rank]
    # row-parallel: partial products summed by g, a replicated loss after it
    xr = x[:, rows].clone().requires_grad_()
    wr = w[rows].clone().requires_grad_()
    y = reduce_from_group(xr @ wr, mesh.tp_group)
    (y.square().sum()).backward()
    # column-parallel: replicated input through f, a loss that is a sum over ranks
    xc = x.clone().requires_grad_()
    wc = w[:, cols].clone().requires_grad_()
    part = (copy_to_group(xc, mesh.tp_group) @ wc).square().sum()
    total = all_reduce_sum(part.detach(), mesh.tp_group)
    part.backward()
    return {"y": y.detach(), "gx_row": xr.grad, "gw_row": wr.grad, "rows": rows, "gx_col": xc.grad, "gw_col": wc.grad, "cols": cols, "loss_col": total}


@pytest.mark.parametrize("world", [2, 4])
def test_f_and_g_have_the_right_adjoints(tmp_path, world):
    x, w = _data()
    xf, wf = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = xf @ wf
    y.square().sum().backward()
    for r in run_world(_sharded_linear, world, tmp_path):
        assert torch.allclose(r["y"], y.detach(), atol=1e-12)
        assert torch.allclose(r["gx_row"], xf.grad[:, r["rows"]], atol=1e-12)
        assert torch.allclose(r["gw_row"], wf.grad[r["rows"]], atol=1e-12)
        assert torch.allclose(r["gx_col"], xf.grad, atol=1e-12)
        assert torch.allclose(r["gw_col"], wf.grad[:, r["cols"]], atol=1e-12)
        assert torch.allclose(r["loss_col"], y.detach().square().sum(), atol=1e-10)


def _mesh_and_average(rank, world):
    mesh = Mesh.build(2, world // 2)
    p = torch.nn.Parameter(torch.zeros(3, dtype=F64))
    p.grad = torch.full((3,), float(rank), dtype=F64)
    sum_gradients([p], mesh.dp_group)
    return {"dp_rank": mesh.dp_rank, "tp_rank": mesh.tp_rank, "grad": p.grad}


def test_mesh_layout_and_gradient_sum(tmp_path):
    res = run_world(_mesh_and_average, 4, tmp_path)
    assert [(r["dp_rank"], r["tp_rank"]) for r in res] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # dp groups are {0, 2} and {1, 3}: sums 2 and 4
    assert [float(r["grad"][0]) for r in res] == [2.0, 4.0, 2.0, 4.0]


def test_one_process_mesh_is_a_no_op():
    mesh = Mesh.build(1, 1)
    assert (mesh.dp_group, mesh.tp_group, mesh.world) == (None, None, 1)
    x = torch.ones(2, requires_grad=True)
    assert copy_to_group(x, None) is x and reduce_from_group(x, None) is x
