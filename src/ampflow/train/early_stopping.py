"""Early stopping on a fixed validation subset of the training cells.

A few hundred cells of one chromosome learn what they can in tens of epochs; a fixed
schedule sized for thousands of cells spends the rest overfitting (the latent comes to
separate training cells perfectly and held-out ones worse). So each stage ends when
the loss of the validation cells has not improved for ``patience`` epochs, and the
weights of its best epoch are restored.

The validation cells are a fixed draw from ``train.seed`` among the training cells
(never the held-out cells of ``evaluate.holdout``, which only the evaluation reads);
no batch contains them. Their loss is the stage's weighted total of the per-cell terms
(the graph terms do not depend on the cells), in eval mode: latent means, no dropout,
BatchNorm's running statistics, so the same weights always give the same number.

The state (best loss, its epoch, epochs without improvement, the best weights) goes into
every checkpoint, so a resumed run stops where an uninterrupted one does.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from ..base.errors import InputError
from ..contract.config import EarlyStoppingConfig
from ..model.paired import PairedModel

log = logging.getLogger(__name__)

#: Seed offset of the validation draw, apart from the batches' and the noise's.
VALIDATION_SEED = 7_919


def validation_split(train_rows: np.ndarray, cfg: EarlyStoppingConfig, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows still trained on, validation rows), both sorted; no validation rows when
    early stopping is off.

    Raises InputError when fewer than two training cells would remain, or no cell
    would validate.
    """
    if not cfg.on:
        return train_rows, train_rows[:0]
    n = len(train_rows)
    n_val = int(round(cfg.validation * n))
    if n_val < 1 or n - n_val < 2:
        raise InputError(
            f"{n} training cells leave {n_val} for validation and {n - n_val} to train on; early stopping needs at least 1 and 2"
            " (raise the share, or set patience: 0)",
            key="train.early_stopping.validation",
            value=cfg.validation,
        )
    g = torch.Generator().manual_seed(seed * 1_000_003 + VALIDATION_SEED)
    pick = np.sort(torch.randperm(n, generator=g)[:n_val].numpy())
    keep = np.ones(n, dtype=bool)
    keep[pick] = False
    return train_rows[keep], train_rows[pick]


class EarlyStopping:
    """The stop rule of one stage at a time; :meth:`update` after every epoch."""

    def __init__(self, cfg: EarlyStoppingConfig):
        self.cfg = cfg
        self.reset()

    def reset(self) -> None:
        """A new stage: nothing seen yet."""
        self.best = float("inf")
        self.best_epoch = -1
        self.bad = 0
        self.stopped = False
        self.best_state: dict | None = None

    def update(self, loss: float, epoch: int, state_of) -> bool:
        """Record the validation ``loss`` after ``epoch``; ``state_of()`` gives the model's
        full state (called only when the loss is the best so far). Returns True when the
        stage should stop."""
        improved = np.isfinite(loss) and (not np.isfinite(self.best) or loss < self.best - self.cfg.min_delta * abs(self.best))
        if improved:
            self.best, self.best_epoch, self.bad = float(loss), int(epoch), 0
            self.best_state = {k: v.detach().clone() for k, v in state_of().items()}
            return False
        self.bad += 1
        self.stopped = self.bad >= self.cfg.patience
        return self.stopped

    def state(self) -> dict:
        """What a checkpoint keeps."""
        return {"best": self.best, "best_epoch": self.best_epoch, "bad": self.bad, "stopped": self.stopped, "best_state": self.best_state}

    def load(self, state: dict | None) -> None:
        self.reset()
        if state:
            self.best, self.best_epoch, self.bad = float(state["best"]), int(state["best_epoch"]), int(state["bad"])
            self.stopped = bool(state["stopped"])
            self.best_state = state["best_state"]


@torch.no_grad()
def validation_loss(model, data, rows: np.ndarray, weights, batch_size: int, device, dtype) -> float:
    """The stage's weighted per-cell loss terms over the validation ``rows`` (eval mode,
    in batches of ``batch_size``, weighted by cells), the model left in training mode.
    The graph loss's edge sampling uses its own generator, so the training's random
    streams are untouched. The sum is kept on the device in float64 and read once (the
    same float64 operations as reading each batch's term: one host sync instead of one
    per batch)."""
    was_training = model.training
    model.eval()
    total, n = torch.zeros((), dtype=torch.float64, device=device), 0
    try:
        for i in range(0, len(rows), batch_size):
            idx = rows[i : i + batch_size]
            rna, hic = (t.to(device, dtype) for t in data.batch(idx))
            cond = data.conditions(idx, dtype)
            cond = None if cond is None else cond.to(device)
            terms = model(rna, hic, weights, generator=torch.Generator().manual_seed(0), cond=cond)
            total += PairedModel.weighted_total(terms, weights, 1.0, 0.0).double() * len(idx)
            n += len(idx)
    finally:
        model.train(was_training)
    return float(total) / max(n, 1)
