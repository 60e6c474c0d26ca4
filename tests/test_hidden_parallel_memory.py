"""S5 divides the D-proportional activations of every stratum by tp: measured, not predicted.

Each rank's bytes saved for backward are counted after every stratum of the Hi-C
decoder (``SavedTensorBytes`` marks, as the trainer records them). What a stratum saves
is ``N + c * D``: terms independent of the width D (attention probabilities, the
``B x |F_k|`` decode) and terms proportional to it. Measuring at D and 2D separates
the two: ``c * D = S(2D) - S(D)``. Under S5 at tp ranks each rank's ``c * D`` must be
within 15% of 1/tp of the single-process one.
"""

from __future__ import annotations

import pytest
import torch
from dist_helpers import run_world
from synthetic_shapes import synthetic_features, synthetic_graph

from ampflow.contract.config import LossWeights, ModelConfig
from ampflow.contract.plan import Plan
from ampflow.contract.strategies import CHUNKED_ATTENTION, HIDDEN_PARALLEL
from ampflow.model.paired import PairedModel
from ampflow.parallel.mesh import Mesh
from ampflow.parallel.parallelize import parallelize
from ampflow.train.measured_memory import SavedTensorBytes

B, N_ANCHORS, L, G = 16, 48, 5, 20
PLAN = {"strategies": [{"name": CHUNKED_ATTENTION}, {"name": HIDDEN_PARALLEL}], "chunk_size": 16}


def _model(D: int) -> tuple[PairedModel, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    anchor, stratum = synthetic_features(N_ANCHORS, L, 0.8, 0, g)
    graph = synthetic_graph(G, N_ANCHORS, g)
    cfg = ModelConfig(latent_dim=8, hidden_dim=16, decoder_dim=D, heads=2, window=4, chunk=16, dropout=0.0)
    torch.manual_seed(0)
    model = PairedModel(cfg, G, anchor, stratum, L, graph)
    rna = torch.poisson(torch.full((B, G), 1.0), generator=g)
    hic = torch.poisson(torch.full((B, len(anchor)), 0.5), generator=g)
    return model, rna, hic


def _per_stratum(model, rna, hic) -> list[int]:
    """Bytes saved for backward by each stratum k >= 1 (increments between marks)."""
    model.train()
    with SavedTensorBytes(exclude=[rna, hic]) as meter:
        model(rna, hic, LossWeights(), generator=torch.Generator().manual_seed(1), on_stratum=meter.mark)
    marks = meter.marks
    return [marks[k] - marks[k - 1] for k in range(1, L)]


def _d_proportional(measure) -> list[int]:
    """Per stratum k >= 1: S(2D) - S(D), the bytes proportional to D at D = 32."""
    s1, s2 = measure(32), measure(64)
    return [b - a for a, b in zip(s1, s2)]


def _sharded(D, world):
    model, rna, hic = _model(D)
    model = parallelize(model, Plan.from_dict({**PLAN, "mesh": {"dp": 1, "tp": world}}), Mesh.build(1, world))
    return _per_stratum(model, rna, hic)


def _worker(rank, world):
    return _d_proportional(lambda D: _sharded(D, world))


@pytest.mark.dist
@pytest.mark.parametrize("tp", [2, 4])
def test_s5_divides_d_proportional_bytes_by_tp(tmp_path, tp):
    single = _d_proportional(lambda D: _per_stratum(*_model(D)))
    assert all(b > 0 for b in single)
    for rank, got in enumerate(run_world(_worker, tp, tmp_path)):
        for k, (mine, full) in enumerate(zip(got, single), 1):
            ratio = mine * tp / full
            print(f"tp {tp} rank {rank} stratum {k}: {mine} of {full} D-proportional bytes; x tp = {ratio:.3f}")
            assert abs(ratio - 1) <= 0.15, f"tp {tp} rank {rank} stratum {k}: {mine} bytes vs {full} / {tp}"
