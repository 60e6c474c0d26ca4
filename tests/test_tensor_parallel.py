"""Every composition of strategies against the single-process model: the same loss terms,
every parameter's gradient (each rank's slice of it), and the parameters after one Adam
step, in fp64 and fp32, on 2 and 4 gloo processes.

The reference is the plain model with neither S3 nor S4 (unchunked banded attention, the
naive decode); the sharded runs apply the plan's strategies to the same plain model.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dist_helpers import run_world
from parallel_equivalence import ALL, WORST, _check, _tp_worker

from ampflow.parallel.shards import feature_shards, head_channels, split_range


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_every_strategy_set_equals_one_process(tmp_path, world):
    cases = [c for c in ALL if not (world == 2 and c[0] == "dp2xtp2 all")]  # dp2 x tp2 needs 4
    results = run_world(_tp_worker, world, tmp_path, cases)
    _check(world, results, cases)
    print(f"world {world}: largest fp32 relative error {WORST[0]:.3g}")


# ----------------------------------------------------------------- shard layouts
def test_head_channels_cover_every_head_equally():
    for tp in (1, 2, 4):
        parts = [head_channels(16, 2, tp, r) for r in range(tp)]
        assert torch.equal(torch.cat(parts).sort().values, torch.arange(16))
        for p in parts:  # the same share of each head of width 8
            assert torch.equal((p // 8).bincount(minlength=2), torch.tensor([8 // tp] * 2))


def test_head_channels_refuse_a_head_width_not_divisible():
    with pytest.raises(ValueError, match="mesh.tp"):
        head_channels(12, 2, 4, 0)  # head width 6


def test_feature_shards_partition_every_stratum():
    bounds = [0, 9, 15, 16, 16]  # a stratum of one feature and an empty one
    for tp in (1, 2, 4):
        pieces = [feature_shards(bounds, tp, r) for r in range(tp)]
        assert torch.equal(torch.cat([p for p, _ in pieces]).sort().values, torch.arange(16))
        for index, local in pieces:
            for k in range(4):
                part = index[local[k] : local[k + 1]]
                assert bool(((part >= bounds[k]) & (part < bounds[k + 1])).all())
    assert [split_range(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]


# ----------------------------------------------------------------- collectives per step
def _collectives_per_step(rank, world, strata):
    """All-reduces of one forward and backward of the model under S2+S4+S5 (no chunk),
    counted where every collective of the package ends: ``torch.distributed.all_reduce``."""
    import torch.distributed as dist
    from parallel_equivalence import WEIGHTS, _plan, _problem

    from ampflow.parallel.mesh import Mesh
    from ampflow.parallel.parallelize import parallelize

    weights = dataclasses.replace(WEIGHTS, cross=0.0)  # one pass through the decoder
    counts, real = {}, dist.all_reduce
    calls = {"phase": "forward"}

    def counted(*args, **kwargs):
        calls[calls["phase"]] = calls.get(calls["phase"], 0) + 1
        return real(*args, **kwargs)

    for L in strata:
        model, rna, hic, cond = _problem(torch.float64, "wide", L=L)
        model = parallelize(model, _plan(["S2", "S4", "S5"], 1, world), Mesh.build(1, world)).train()
        calls.clear()
        calls["phase"] = "forward"
        dist.all_reduce = counted
        try:
            terms = model(rna, hic, weights, cond=cond)
            calls["phase"] = "backward"
            terms["total"].backward()
        finally:
            dist.all_reduce = real
        counts[L] = (calls["forward"], calls["backward"])
    return counts


@pytest.mark.dist
def test_a_stratum_costs_thirteen_collectives_under_s2_s4_s5(tmp_path):
    """Referee: the all-reduces the ranks really make (each a round trip that every rank
    waits on, for the slowest rank's compute too). A stratum's
    block and decode take six forward (its feed-forward LayerNorm's statistics, attention
    scores, the two halves of the feed-forward, the decode's partial products, the
    softmax's normaliser) and seven backward (the same, and its input's gradient); the
    tensors every stratum reads pass their collectives once for all strata. Counted as
    the difference between 6 and 4 strata (the encoders' collectives do not grow with
    them)."""
    for counts in run_world(_collectives_per_step, 2, tmp_path, (4, 6)):
        forward = (counts[6][0] - counts[4][0]) / 2
        backward = (counts[6][1] - counts[4][1]) / 2
        assert (forward, backward) == (6, 7), counts
