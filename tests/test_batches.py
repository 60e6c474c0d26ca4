"""Decoders conditioned on the cells' batches (``model.batch_key``).

Referees: a planted batch effect whose truth is known (half of the features of one
batch scaled up, cell kinds planted apart from it): without conditioning the latent
sorts the cells by batch, with it by kind; the encoders, which never see the batch,
give a cell the same latent whatever batch it is said to be in.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import N_ANCHORS, N_STRATA, batched_paired_data
from sklearn.cluster import KMeans
from sklearn.metrics import adjusted_rand_score
from synthetic_shapes import synthetic_features, synthetic_graph

from ampflow.base.errors import InputError
from ampflow.contract.config import LossWeights, ModelConfig, TrainConfig
from ampflow.io.h5ad import read_h5ad
from ampflow.model.paired import PairedModel
from ampflow.train.data import PairedData
from ampflow.train.trainer import Trainer


def test_batches_come_from_the_named_column():
    d = batched_paired_data()
    d.use_batches("batch")
    assert d.batch_names == ["b0", "b1"] and d.n_batches == 2
    assert d.batch_codes.tolist() == [int(b[1]) for b in d.obs["batch"]]
    onehot = d.conditions(np.array([0, 2, 3]))
    assert onehot.tolist() == [[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]]
    for key in (None, "no_such_column"):
        d.use_batches(key)
        assert d.n_batches == 0 and d.conditions(np.arange(3)) is None
    d.obs["one"] = "x"
    d.use_batches("one")
    assert d.n_batches == 0  # one batch: nothing to condition on
    d.obs.loc["c5", "batch"] = ""
    with pytest.raises(InputError, match="c5") as e:
        d.use_batches("batch")
    assert e.value.key == "batch"


def test_the_decoders_read_the_batch_and_the_encoders_do_not():
    g = torch.Generator().manual_seed(1)
    anchor, stratum = synthetic_features(N_ANCHORS, N_STRATA, 1.0, 0, g)
    G = 5
    model = PairedModel(ModelConfig(latent_dim=4, hidden_dim=8, heads=2, window=2, dropout=0.0), G, anchor, stratum, N_STRATA,
                        synthetic_graph(G, N_ANCHORS, g), n_batches=3)  # fmt: skip
    assert model.hic_decoder.loading.shape == (len(anchor), 4 + 3) and model.rna_decoder.batch_bias.shape == (G, 3)
    # the batch columns start at 0: a new model decodes every batch alike
    assert not model.hic_decoder.loading[:, 4:].any() and not model.rna_decoder.batch_bias.any()
    with torch.no_grad():
        model.hic_decoder.loading[:, 4:].normal_(generator=g)
        model.rna_decoder.batch_bias.normal_(generator=g)
    model.eval()
    rna = torch.poisson(torch.full((6, G), 2.0), generator=g)
    hic = torch.poisson(torch.full((6, len(anchor)), 1.0), generator=g)
    eye = torch.eye(3)
    a = model(rna, hic, LossWeights(), cond=eye[[0] * 6])
    b = model(rna, hic, LossWeights(), cond=eye[[2] * 6])
    assert a["hic_nll"] != b["hic_nll"] and a["rna_nll"] != b["rna_nll"]
    assert a["hic_kl"] == b["hic_kl"]  # the encoders' terms do not move
    r0, h0 = model.embed(rna, hic)
    assert torch.equal(h0, model.embed(rna, hic)[1]) and torch.equal(r0, model.embed(rna, hic)[0])
    with pytest.raises(ValueError, match="3 batches"):
        model(rna, hic, LossWeights())


def _train(data: PairedData, batch_key, out) -> np.ndarray:
    model = ModelConfig(latent_dim=4, hidden_dim=32, heads=2, window=2, dropout=0.0, batch_key=batch_key)
    # the plain ELBO (hic_kl 1): a latent that keeps every strong signal, so that one left
    # to carry the batch shows it (at the default 20 it kept the kinds, batch or not); no
    # clipping, for the same reason: with the default (zscore) the unconditioned latent kept
    # the kinds too (ARI 1.00 against kind, -0.02 against batch)
    weights = {"hic_kl": 1.0}
    train = TrainConfig.from_dict({
        "seed": 0, "batch_size": 16, "checkpoint_every": 1000, "threads": 1, "device": "cpu", "clip_grad_norm": None,
        "pretrain": {"epochs": 60, "lr": 0.02, "weights": weights}, "finetune": {"epochs": 0, "lr": 0.01, "weights": weights},
        "early_stopping": {"patience": 0},
    })  # fmt: skip
    Trainer(data, model, train, out).fit()
    return np.asarray(read_h5ad(out / "embeddings.h5ad").obsm["X_hic"])


def _aris(z: np.ndarray, data: PairedData) -> tuple[float, float]:
    c = KMeans(2, n_init=10, random_state=0).fit_predict(z)
    return adjusted_rand_score(data.obs["kind"], c), adjusted_rand_score(data.obs["batch"], c)


def test_a_planted_batch_effect_goes_to_the_decoders(tmp_path):
    """The batch effect is stronger than the kinds' difference: a latent left to carry it
    splits the cells by batch. Conditioned on the batch, the decoders take it and the
    latent splits them by kind. Far apart on purpose (1 against 0), so that no machine's
    rounding moves a cell across."""
    data = batched_paired_data()
    plain_kind, plain_batch = _aris(_train(data, None, tmp_path / "plain"), data)
    kind, batch = _aris(_train(batched_paired_data(), "batch", tmp_path / "conditioned"), data)
    print(f"\nARI vs kind / vs batch: unconditioned {plain_kind:.2f} / {plain_batch:.2f}, conditioned {kind:.2f} / {batch:.2f}")
    assert plain_batch > 0.8 and plain_kind < 0.2
    assert kind > 0.8 and batch < 0.2
    saved = torch.load(tmp_path / "conditioned" / "model.pt", weights_only=True)
    assert saved["batches"] == ["b0", "b1"] and torch.load(tmp_path / "plain" / "model.pt", weights_only=True)["batches"] == []
