"""The training loop: stages, batches in a seeded order, metrics, checkpoints, resume."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import time
from pathlib import Path

import anndata as ad
import numpy as np
import torch
import yaml

from ..io.atomic import atomic_path
from ..model.config import ModelConfig
from ..model.paired import PairedModel
from ..progress import Progress
from . import checkpoint
from .config import TrainConfig
from .data import PairedData
from .memory import measured_step

log = logging.getLogger(__name__)


def build_model(cfg: ModelConfig, data: PairedData) -> PairedModel:
    return PairedModel(
        cfg, data.rna.shape[1], data.feature_anchor, data.feature_stratum, data.n_strata, data.graph
    )


def epoch_batches(n: int, batch_size: int, seed: int, stage: int, epoch: int) -> list[np.ndarray]:
    """Cell indices of every batch of one epoch: a permutation fixed by (seed, stage, epoch),
    so a resumed run needs only its position. A trailing batch of one cell joins the
    previous batch (batch normalisation needs two)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + stage * 10_007 + epoch)
    perm = torch.randperm(n, generator=g).numpy()
    batches = [perm[i : i + batch_size] for i in range(0, n, batch_size)]
    if len(batches) > 1 and len(batches[-1]) < 2:
        batches[-2] = np.concatenate([batches[-2], batches.pop()])
    return batches


def seed_everything(seed: int) -> torch.Generator:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed + 1)


class Trainer:
    """Trains a :class:`PairedModel` on :class:`PairedData` into ``out_dir``.

    Writes ``model.pt``, ``embeddings.h5ad``, ``metrics.jsonl`` and ``config.yaml``
    (each atomically, at the end) and keeps resumable state in ``checkpoints/``.
    """

    def __init__(self, data: PairedData, model_cfg: ModelConfig, train_cfg: TrainConfig, out_dir, name: str = "", stop_after: int | None = None):
        self.data, self.model_cfg, self.cfg = data, model_cfg, train_cfg
        self.out = Path(out_dir)
        self.ckpt_dir = self.out / "checkpoints"
        self.name = name or self.out.name
        self.stop_after = stop_after  # testing aid: stop (as if killed) after this many steps
        if train_cfg.device == "cuda" or (train_cfg.device == "auto" and torch.cuda.is_available()):
            self.device = torch.device("cuda")
        else:
            self.device = torch.device("cpu")
        torch.set_num_threads(train_cfg.threads)
        self.generator = seed_everything(train_cfg.seed)
        self.model = build_model(model_cfg, data).to(self.device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=train_cfg.stages[0][1].lr)
        self.step = 0
        self.position = (0, 0, 0)  # stage, epoch, batch: the next batch to run

    # ----------------------------------------------------------- state
    def run_key(self) -> str:
        """Fingerprint of everything that decides this run's results: the data (cells,
        shapes, counts), the model settings and the training settings (less those that
        only decide how often checkpoints are kept or where the run is scheduled)."""
        h = hashlib.sha256()
        d = self.data
        h.update("\n".join(map(str, d.obs.index)).encode())
        for m in (d.rna, d.hic):
            h.update(np.asarray(m.shape, dtype=np.int64).tobytes())
            h.update(np.asarray([m.nnz, float(m.data.sum(dtype=np.float64))]).tobytes())
        train = {k: v for k, v in self.cfg.to_dict().items() if k not in ("checkpoint_every", "keep_checkpoints", "gpus")}
        h.update(json.dumps([self.model_cfg.to_dict(), _plain(train)], sort_keys=True).encode())
        return h.hexdigest()

    def _payload(self) -> dict:
        return {
            "run_key": self.run_key(),
            "step": self.step,
            "position": list(self.position),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": checkpoint.rng_state(self.generator),
        }

    def _resume(self) -> bool:
        state, path = checkpoint.load_latest(self.ckpt_dir, self.run_key())
        if state is None:
            return False
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        checkpoint.set_rng_state(state["rng"], self.generator)
        self.step = int(state["step"])
        self.position = tuple(int(x) for x in state["position"])
        log.info("resumed from %s (step %d, stage %d, epoch %d, batch %d)", path, self.step, *self.position)
        return True

    def _metrics_file(self, resumed: bool):
        partial = self.ckpt_dir / "metrics.partial.jsonl"
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        kept = []
        if resumed and partial.exists():
            lines = partial.read_text().splitlines()
            kept = [ln for ln in lines if (step := _row_step(ln)) is not None and step <= self.step]
        partial.write_text("".join(ln + "\n" for ln in kept))
        return partial

    # ----------------------------------------------------------- loop
    def _train_step(self, idx: np.ndarray, stage_name: str, stage_cfg, epoch: int) -> dict:
        rna, hic = self.data.batch(idx)
        rna, hic = rna.to(self.device), hic.to(self.device)
        t0 = time.perf_counter()
        terms, peak, per_stratum = measured_step(self.model, self.optimizer, rna, hic, stage_cfg.weights, self.generator)
        seconds = time.perf_counter() - t0
        return {
            "stage": stage_name,
            "epoch": epoch,
            "step": self.step,
            "loss": {k: float(v.detach()) for k, v in terms.items()},
            "seconds": seconds,
            "cells_per_s": len(idx) / seconds,
            "peak_bytes": int(peak),
            "stratum_bytes": [int(x) for x in per_stratum[: self.data.n_strata]],
        }

    def fit(self) -> bool:
        """Train to the end (resuming if checkpoints exist). Returns False if stopped early."""
        resumed = self._resume()
        metrics_path = self._metrics_file(resumed)
        n = self.data.n_cells
        total_steps = sum(cfg.epochs * len(epoch_batches(n, self.cfg.batch_size, 0, 0, 0)) for _, cfg in self.cfg.stages)
        progress = Progress(total_steps, "steps", log, verb="trained")
        progress.done = self.step
        start_stage, start_epoch, start_batch = self.position
        with open(metrics_path, "a") as mfh:
            for s, (stage_name, stage_cfg) in enumerate(self.cfg.stages):
                if s < start_stage:
                    continue
                for group in self.optimizer.param_groups:
                    group["lr"] = stage_cfg.lr
                for epoch in range(start_epoch if s == start_stage else 0, stage_cfg.epochs):
                    batches = epoch_batches(n, self.cfg.batch_size, self.cfg.seed, s, epoch)
                    first = start_batch if (s == start_stage and epoch == start_epoch) else 0
                    for b in range(first, len(batches)):
                        row = self._train_step(batches[b], stage_name, stage_cfg, epoch)
                        self.step += 1
                        row["step"] = self.step
                        mfh.write(json.dumps(row, sort_keys=True) + "\n")
                        mfh.flush()
                        progress.update()
                        self.position = (s, epoch, b + 1) if b + 1 < len(batches) else (s, epoch + 1, 0)
                        if self.step % self.cfg.checkpoint_every == 0:
                            os.fsync(mfh.fileno())
                            checkpoint.save(self.ckpt_dir, self.step, self._payload(), self.cfg.keep_checkpoints)
                        if self.stop_after is not None and self.step >= self.stop_after:
                            return False
                    if math.isnan(row["loss"]["total"]):
                        raise FloatingPointError(f"loss became NaN at step {self.step} ({stage_name}, epoch {epoch})")
                self.position = (s + 1, 0, 0)
        self._write_outputs(metrics_path)
        return True

    # ----------------------------------------------------------- outputs
    @torch.no_grad()
    def embeddings(self, batch_size: int = 1024) -> tuple[np.ndarray, np.ndarray]:
        self.model.eval()
        xr, xh = [], []
        for i in range(0, self.data.n_cells, batch_size):
            rna, hic = self.data.batch(np.arange(i, min(i + batch_size, self.data.n_cells)))
            r, h = self.model.embed(rna.to(self.device), hic.to(self.device))
            xr.append(r.cpu().numpy())
            xh.append(h.cpu().numpy())
        return np.concatenate(xr), np.concatenate(xh)

    def _write_outputs(self, metrics_path: Path) -> None:
        x_rna, x_hic = self.embeddings()
        emb = ad.AnnData(obs=self.data.obs.copy())
        emb.obsm["X_rna"] = x_rna.astype(np.float32)
        emb.obsm["X_hic"] = x_hic.astype(np.float32)
        emb.obsm["X_joint"] = ((x_rna + x_hic) / 2).astype(np.float32)
        emb.uns["ampflow"] = {"config": self.name, "seed": self.cfg.seed, "steps": self.step}
        with atomic_path(self.out / "embeddings.h5ad") as tmp:
            emb.write_h5ad(tmp)
        with atomic_path(self.out / "model.pt") as tmp:
            torch.save(
                {
                    "state_dict": self.model.state_dict(),
                    "model_config": self.model_cfg.to_dict(),
                    "train_config": _plain(self.cfg.to_dict()),
                    "steps": self.step,
                },
                tmp,
            )
        with atomic_path(self.out / "config.yaml") as tmp:
            tmp.write_text(yaml.safe_dump({"name": self.name, "model": self.model_cfg.to_dict(), "train": _plain(self.cfg.to_dict())}, sort_keys=True))
        with atomic_path(self.out / "metrics.jsonl") as tmp:
            tmp.write_bytes(metrics_path.read_bytes())
        log.info("training done: %d steps; outputs in %s", self.step, self.out)


def _row_step(line: str) -> int | None:
    """The step of one metrics line; None for a line a crash cut short (it lies past the
    last checkpoint: lines are fsynced before each checkpoint is written)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def _plain(d):
    """Dataclass dicts with nested dataclasses already converted: only builtins."""
    return json.loads(json.dumps(d))
