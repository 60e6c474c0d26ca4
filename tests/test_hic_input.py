"""The Hi-C encoder's input (model.encoders.HiCInput) against BandNorm's transform
computed here with numpy, and its weights taken from the training cells only."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import batched_paired_data

from ampflow.contract.config import ModelConfig
from ampflow.contract.layout import HELDOUT, SPLIT_COLUMN, TRAIN
from ampflow.model.encoders import HiCInput
from ampflow.train.trainer import build_model


def cells_with_decay(n_cells=12, seed=0):
    """(n_cells, F) counts whose strata fall off with distance by a per-cell decay, and
    the features' strata (stratum-major, unequal stratum sizes)."""
    rng = np.random.default_rng(seed)
    sizes = [7, 6, 5, 4]
    stratum = np.repeat(np.arange(len(sizes)), sizes)
    decay = rng.uniform(0.5, 2.0, n_cells)[:, None]
    lam = rng.uniform(0.2, 3.0, (n_cells, len(stratum))) * 30.0 / (1.0 + stratum[None, :]) ** decay
    return rng.poisson(lam).astype(np.float64), stratum


def bandnorm(x, stratum, fit, weight, transform="log1p"):
    """BandNorm's normalisation written out: each band divided by the cell's mean over
    it, times the fit cells' mean of those means (or its square root, or 1), log1p (or
    nothing: ``transform="linear"``)."""
    L = stratum.max() + 1
    cell_mean = np.stack([x[:, stratum == k].mean(1) for k in range(L)], axis=1)  # (n, L)
    population = cell_mean[fit].mean(0)
    w = {"mean": population, "sqrt": np.sqrt(population), "none": np.ones(L)}[weight]
    scaled = x / cell_mean[:, stratum] * w[stratum]
    return (np.log1p(scaled) if transform == "log1p" else scaled), population


@pytest.mark.parametrize("transform", ["log1p", "linear"])
@pytest.mark.parametrize("weight", ["mean", "sqrt", "none"])
@pytest.mark.parametrize("diagonal", [False, True])
def test_input_is_bandnorm_with_the_fit_cells_band_means(weight, diagonal, transform):
    x, stratum = cells_with_decay()
    fit = np.arange(len(x)) < 8
    want, population = bandnorm(x, stratum, fit, weight, transform)
    if not diagonal:
        want[:, stratum == 0] = 0.0
    t = HiCInput(torch.as_tensor(stratum), int(stratum.max()) + 1, weight, diagonal, transform).double()
    counts = torch.as_tensor(x)
    totals = torch.stack([counts[:, torch.as_tensor(stratum == k)].sum(1) for k in range(stratum.max() + 1)], dim=1)
    t.fit(totals[torch.as_tensor(fit)])
    np.testing.assert_allclose(t.band_mean.numpy(), population, rtol=1e-12)
    np.testing.assert_allclose(t(counts).numpy(), want, rtol=1e-12, atol=1e-12)
    # the near strata weigh most with "mean": what makes BandNorm's near bands dominate
    if weight == "mean":
        assert population[1] > population[2] > population[3]


def test_band_means_are_in_the_state_dict_and_come_back():
    x, stratum = cells_with_decay()
    a = HiCInput(torch.as_tensor(stratum), 4).double()
    a.fit(torch.as_tensor(np.stack([x[:, stratum == k].sum(1) for k in range(4)], axis=1)))
    b = HiCInput(torch.as_tensor(stratum), 4).double()
    assert not torch.equal(a(torch.as_tensor(x)), b(torch.as_tensor(x)))
    b.load_state_dict(a.state_dict())
    assert torch.equal(a(torch.as_tensor(x)), b(torch.as_tensor(x)))


def test_the_model_weighs_strata_by_its_training_cells_never_the_held_out_ones():
    data = batched_paired_data(n_cells=24)
    held = np.arange(data.n_cells) >= 16
    stratum = data.feature_stratum.numpy()
    dense = data.hic.toarray().astype(np.float64)
    expected = np.stack([dense[~held][:, stratum == k].mean(1) for k in range(data.n_strata)], axis=1).mean(0)
    # held-out cells a hundred times deeper would move any statistic that saw them
    data.hic = data.hic.multiply(np.where(held, 100.0, 1.0)[:, None]).tocsr()
    data.obs = data.obs.copy()
    data.obs[SPLIT_COLUMN] = pd.Categorical(np.where(held, HELDOUT, TRAIN), categories=[TRAIN, HELDOUT])
    model = build_model(ModelConfig(latent_dim=4, hidden_dim=8, heads=2, window=2), data)
    np.testing.assert_allclose(model.hic_input.band_mean.double().numpy(), expected, rtol=1e-6)
    assert "hic_input.band_mean" in model.state_dict()
