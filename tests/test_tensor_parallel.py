"""Every composition of strategies against the single-process model: the same loss terms,
every parameter's gradient (each rank's slice of it), and the parameters after one Adam
step, in fp64 and fp32, on 2 and 4 gloo processes.

The reference is the plain model with neither S3 nor S4 (unchunked banded attention, the
naive decode); the sharded runs apply the plan's strategies to the same plain model.
"""

from __future__ import annotations

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
