"""Early stopping: the validation cells, the stop rule, the best weights restored, resume.

Referees: the stop epoch is recounted here from the validation losses the run wrote to
``metrics.jsonl`` (patience applied by hand); the restored weights are checked by
recomputing the validation loss of the written ``model.pt`` in a freshly built model,
which must equal the best loss recorded; resume is compared with an uninterrupted run,
bit for bit (CPU).
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import torch
from synthetic_shapes import SYNTHETIC_META, synthetic_features, synthetic_graph
from trainer_doubles import StoppingTrainer

from ampflow.base.errors import InputError
from ampflow.contract.config import EarlyStoppingConfig, ModelConfig, TrainConfig
from ampflow.train.data import PairedData
from ampflow.train.early_stopping import EarlyStopping, validation_loss, validation_split
from ampflow.train.trainer import Trainer, build_model

MODEL = ModelConfig(latent_dim=4, hidden_dim=16, heads=2, window=2, dropout=0.0)
N_CELLS, N_ANCHORS, N_STRATA = 40, 12, 3


def _settings(patience=3, epochs=40, finetune=0, **extra) -> TrainConfig:
    return TrainConfig.from_dict({
        "seed": 0, "batch_size": 8, "checkpoint_every": 4, "threads": 1, "device": "cpu",
        "pretrain": {"epochs": epochs, "lr": 0.05}, "finetune": {"epochs": finetune, "lr": 0.01},
        "early_stopping": {"validation": 0.2, "patience": patience}, **extra,
    })  # fmt: skip


@pytest.fixture(scope="module")
def data() -> PairedData:
    g = torch.Generator().manual_seed(0)
    anchor, stratum = synthetic_features(N_ANCHORS, N_STRATA, 1.0, 0, g)
    rates = torch.rand(2, len(anchor), generator=g) * 4 + 0.5  # two kinds of cells
    kind = torch.arange(N_CELLS) % 2
    hic = torch.poisson(rates[kind], generator=g).numpy()
    obs = pd.DataFrame(index=[f"c{i}" for i in range(N_CELLS)])
    return PairedData(
        obs=obs, rna=sp.csr_matrix((N_CELLS, 0), dtype=np.float32), hic=sp.csr_matrix(hic, dtype=np.float32),
        feature_anchor=anchor, feature_stratum=stratum, n_strata=N_STRATA, graph=synthetic_graph(0, N_ANCHORS, g), meta=SYNTHETIC_META,
    )  # fmt: skip


def _validation_rows(out) -> list[dict]:
    return [r for r in (json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()) if "validation" in r]


def test_validation_cells_are_a_fixed_seeded_subset():
    rows = np.arange(3, 103)
    cfg = EarlyStoppingConfig(validation=0.1, patience=5)
    train, val = validation_split(rows, cfg, seed=4)
    again = validation_split(rows, cfg, seed=4)
    assert np.array_equal(train, again[0]) and np.array_equal(val, again[1])
    assert len(val) == 10 and len(train) == 90
    assert sorted(np.concatenate([train, val]).tolist()) == rows.tolist()
    assert not set(train) & set(val)
    other = validation_split(rows, cfg, seed=5)[1]
    assert not np.array_equal(val, other)
    off_train, off_val = validation_split(rows, EarlyStoppingConfig(patience=0), seed=4)
    assert np.array_equal(off_train, rows) and len(off_val) == 0
    with pytest.raises(InputError, match="train.early_stopping.validation"):
        validation_split(np.arange(3), cfg, seed=0)


def test_stop_rule_on_a_known_sequence():
    rule = EarlyStopping(EarlyStoppingConfig(patience=2, min_delta=0.01))
    losses = [5.0, 4.0, 3.99, 3.0, 3.0, 2.98, 3.5]
    # 3.99 is within 1% of 4.0 (no improvement), 3.0 improves, 3.0 and 2.98 do not
    stops = [rule.update(x, e, lambda e=e: {"w": torch.tensor(float(e))}) for e, x in enumerate(losses[:6])]
    assert stops == [False, False, False, False, False, True]
    assert (rule.best, rule.best_epoch, float(rule.best_state["w"])) == (3.0, 3, 3.0)


def test_a_stage_stops_and_keeps_its_best_epoch(data, tmp_path, caplog):
    cfg = _settings()
    out = tmp_path / "run"
    with caplog.at_level("INFO", logger="ampflow.train.trainer"):
        trainer = Trainer(data, MODEL, cfg, out)
        assert trainer.fit() is True
    seen = _validation_rows(out)
    losses = [r["validation"] for r in seen]
    # the referee: patience recounted from the written losses
    best, best_epoch, bad, stop_epoch = float("inf"), -1, 0, None
    for e, x in enumerate(losses):
        if x < best - cfg.early_stopping.min_delta * abs(best) or best == float("inf"):
            best, best_epoch, bad = x, e, 0
        else:
            bad += 1
            if bad >= cfg.early_stopping.patience:
                stop_epoch = e
                break
    assert stop_epoch is not None and stop_epoch < cfg.pretrain.epochs - 1, "the synthetic run should stop early"
    assert len(losses) == stop_epoch + 1, "no epoch runs after the stop"
    assert f"pretrain stopped after epoch {stop_epoch + 1} of {cfg.pretrain.epochs}" in caplog.text
    assert f"pretrain: weights of epoch {best_epoch + 1} restored" in caplog.text
    # the written model is the best epoch's: its validation loss, recomputed, is the best
    state = torch.load(out / "model.pt", map_location="cpu", weights_only=True)["state_dict"]
    model = build_model(MODEL, data)
    model.load_state_dict(state)
    again = validation_loss(model, data, trainer.val_rows, cfg.pretrain.weights, cfg.batch_size, "cpu", torch.float32)
    assert again == pytest.approx(best, rel=1e-6)
    # validation cells were in no batch
    ran = {int(i) for s, (_, st) in enumerate(cfg.stages) for e in range(st.epochs) for b in trainer.batches(s, e) for i in b}
    assert not ran & set(trainer.val_rows.tolist())


def test_resume_stops_where_an_uninterrupted_run_stops(data, tmp_path):
    cfg = _settings(finetune=6)
    ref, out = tmp_path / "ref", tmp_path / "run"
    assert Trainer(data, MODEL, cfg, ref).fit() is True
    n_steps = json.loads((ref / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    for stop in (7, n_steps // 2, n_steps - 3):
        assert StoppingTrainer(data, MODEL, cfg, out, stop_after=stop).fit() is False
    assert Trainer(data, MODEL, cfg, out).fit() is True
    a = torch.load(ref / "model.pt", weights_only=True)["state_dict"]
    b = torch.load(out / "model.pt", weights_only=True)["state_dict"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["validation"] for r in _validation_rows(ref)] == [r["validation"] for r in _validation_rows(out)]


def test_off_runs_every_epoch_on_every_cell(data, tmp_path):
    cfg = _settings(patience=0, epochs=3)
    trainer = Trainer(data, MODEL, cfg, tmp_path / "run")
    assert len(trainer.val_rows) == 0 and len(trainer.train_rows) == N_CELLS
    assert trainer.fit() is True
    assert _validation_rows(tmp_path / "run") == []


def test_bad_settings_name_the_key():
    with pytest.raises(InputError, match="train.early_stopping.patience"):
        TrainConfig.from_dict({"early_stopping": {"patience": -1}})
    with pytest.raises(InputError, match="train.early_stopping"):
        TrainConfig.from_dict({"early_stopping": {"patients": 3}})
