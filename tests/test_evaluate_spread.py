"""How many dimensions a representation spreads cells over (``effective_dims`` in scores.json)."""

from __future__ import annotations

import anndata as ad
import numpy as np
import pandas as pd
import pytest

from ampflow.evaluate.scores import score_group
from ampflow.evaluate.spread import effective_dims


def cube_corners(dims: int = 12) -> np.ndarray:
    """Cells at the 8 corners of a cube in the first 3 of ``dims`` dimensions: a
    covariance with exactly three equal eigenvalues, the rest zero."""
    corners = np.array([[a, b, c] for a in (-1, 1) for b in (-1, 1) for c in (-1, 1)], dtype=float)
    return np.hstack([corners, np.zeros((8, dims - 3))])


def test_effective_dims_counts_equally_wide_directions_in_any_rotation():
    """Referee: the cube's corners, whose covariance has three equal eigenvalues, turned
    by a random rotation (which moves the variance off the axes, where a count of wide
    axes would see 12); one direction holding all but a trace of the variance."""
    rotation, _ = np.linalg.qr(np.random.default_rng(0).normal(size=(12, 12)))
    assert effective_dims(cube_corners()) == pytest.approx(3.0, abs=1e-9)
    assert effective_dims(cube_corners() @ rotation) == pytest.approx(3.0, abs=1e-9)
    line = np.outer(np.linspace(-1, 1, 20), np.ones(12)) + np.random.default_rng(1).normal(0, 1e-3, (20, 12))
    assert 1.0 <= effective_dims(line) < 1.01
    # no variance, or one cell: nothing to count, not a division by zero
    assert np.isnan(effective_dims(np.ones((5, 4)))) and np.isnan(effective_dims(np.zeros((1, 4))))


def embeddings(hic: np.ndarray, labels: np.ndarray) -> ad.AnnData:
    a = ad.AnnData(obs=pd.DataFrame({"cell_type": [f"type_{i}" for i in labels]}, index=[f"cell{i}" for i in range(len(labels))]))
    for key in ("X_rna", "X_joint"):
        a.obsm[key] = hic.astype(np.float32)
    a.obsm["X_hic"] = hic.astype(np.float32)
    return a


def test_score_group_records_each_representations_spread():
    """Referee: four types at the corners of a tetrahedron (three equal directions) make
    the baselines; the Hi-C latent puts the same types along one line. score_group
    records about 1 for the latent and about 3 for the baseline, over the group's cells."""
    rng = np.random.default_rng(0)
    n = 200
    labels = rng.integers(0, 4, n)
    tetra = np.array([[1, 1, 1], [1, -1, -1], [-1, 1, -1], [-1, -1, 1]], dtype=float)
    wide = np.hstack([tetra[labels] * 5, np.zeros((n, 5))]) + rng.normal(scale=0.3, size=(n, 8))
    line = np.outer(labels * 5.0, np.ones(8) / np.sqrt(8)) + rng.normal(scale=0.3, size=(n, 8))
    baselines = {"rna_baseline": wide, "hic_baseline": wide, "bandnorm_baseline": wide}
    a = embeddings(wide, labels)
    a.obsm["X_hic"] = line.astype(np.float32)
    methods = score_group(a, np.arange(n), baselines, alignment=False, name="heldout")["methods"]
    assert methods["hic_latent"]["effective_dims"] < 1.2
    assert 2.8 < methods["hic_baseline"]["effective_dims"] < 3.4 and 2.8 < methods["rna_latent"]["effective_dims"] < 3.4
    half = score_group(a, np.arange(n // 2), baselines, alignment=False)["methods"]  # the group's own cells
    assert half["hic_baseline"]["effective_dims"] == pytest.approx(effective_dims(wide[: n // 2]))
