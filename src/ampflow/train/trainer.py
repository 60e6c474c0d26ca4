"""The training loop: stages, batches in a seeded order, metrics, checkpoints, resume.

The plain model is built alike on every rank and
:func:`~ampflow.parallel.parallelize.parallelize` applies the plan (S3, S4 in any world,
one process included; S2, S5 over the tp group and S1 over the dp groups when
``torchrun`` launched the plan's dp x tp processes). Every step has one path: the
batch's cells are split over the dp groups by Hi-C contacts
(:func:`~ampflow.parallel.data_parallel.balanced_split`) and a
:class:`~ampflow.parallel.data_parallel.DataParallelStep` runs it, which in a 1 x 1 mesh
is the plain single-process step, bit for bit. With dp > 1
the noise and graph sampling come from the trainer's generator (seeded from the train
seed, alike on every rank); with dp = 1 they are drawn as one process draws them, so a
tensor-parallel run follows the single-process run (to rounding). With dp > 1 and
``model.dropout = 0`` the run computes the single-process losses and gradients of a run
that draws its noise from that generator; with dropout > 0 each dp group draws its own
dropout masks, so the run is a correct data-parallel training but not equal to one
process.

Cells that ``obs["split"]`` holds out are in no batch (:meth:`Trainer.batches`): no
loss, gradient or BatchNorm statistic sees them; ``embeddings.h5ad`` still embeds every
cell. Without held-out cells the batches are those of every cell, as before.

Rank 0 alone writes the outputs and the checkpoints. A checkpoint holds the
consolidated single-process model and optimizer state (so it resumes on any tp degree)
and every rank's RNG states.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import yaml

from ..base.atomic import atomic_path
from ..base.errors import InputError
from ..base.progress import Progress
from ..contract.config import ModelConfig, TrainConfig
from ..contract.plan import Plan
from ..model.paired import PairedModel
from ..parallel.clip import ClipTally, ZScoreBound, make_bound
from ..parallel.data_parallel import DataParallelStep, balanced_split, work_ratio
from ..parallel.mesh import Mesh
from ..parallel.parallelize import full_state, load_full_state, parallelize
from . import checkpoint
from .data import PairedData
from .device import run_device, use_deterministic
from .device_cells import DeviceCells, PinnedCopy, padded_bytes, thinning_bytes
from .early_stopping import EarlyStopping, validation_loss, validation_split
from .embeddings import EMBED_ROWS, embeddings_anndata, latent_means
from .measured_memory import batch_tensors, measure_step, measured_dp_step
from .static_step import StaticStep, choose_mode
from .thinning import check_integer_counts

log = logging.getLogger(__name__)

#: The allocator's peak is measured on this many steps of each process: the first (no
#: optimizer state yet, unless resumed) and the steady state after it. On CPU through
#: the profiler (which slows a step up to about threefold); on CUDA also at every
#: checkpoint's step (reading the peaks waits for the GPU: a host sync, so not every step).
MEASURED_STEPS = 3

#: Device memory left free beside the resident counts and the step's predicted peak
#: (the CUDA context, cuBLAS workspaces and the allocator's slack lie outside the plan).
RESIDENT_MARGIN_BYTES = 2 * 2**30

#: On a GPU, the validation's batches hold this many training batches' cells.
VALIDATION_BATCH_FACTOR = 8


def build_model(cfg: ModelConfig, data: PairedData) -> PairedModel:
    """The plain model for ``data``, its Hi-C input weighed by the training cells' strata
    and projected on their principal axes (:meth:`~ampflow.model.encoders.HiCInput.fit`;
    never the held-out cells); a reach in base pairs read as the stratum it is at the
    data's resolution."""
    cfg = cfg.at_resolution(data.meta.get("hic", {}).get("resolution"))
    model = PairedModel(cfg, data.rna.shape[1], data.feature_anchor, data.feature_stratum, data.n_strata, data.graph, data.n_batches)
    rows = data.train_rows
    if not cfg.hic_pcs:
        model.hic_input.fit(data.stratum_totals(rows))
        return model
    # ARPACK reports no progress: say what it fits and, after, how long it took
    counts = data.hic[rows]
    log.info(
        "Hi-C input: fitting %d principal axes on %d training cells x %d features (%d contacts entries)", cfg.hic_pcs, len(rows), counts.shape[1], counts.nnz
    )
    t0 = time.perf_counter()
    model.hic_input.fit(data.stratum_totals(rows), counts)
    log.info("Hi-C input: %d principal axes fitted in %.1f s", cfg.hic_pcs, time.perf_counter() - t0)
    return model


def make_optimizer(params, lr: float, weight_decay: float, capturable: bool) -> torch.optim.Optimizer:
    """Adam, or with ``weight_decay`` > 0 AdamW: the decay is decoupled from the
    gradient (each step multiplies every parameter by ``1 - lr x weight_decay`` before
    Adam's normalised step), not an L2 term added to it, whose pull Adam's normalisation
    would scale per parameter. ``capturable``: the step counts live on the device, as a
    CUDA graph needs. With no decay it is the plain Adam every earlier run trained with.

    On CPU, torch's fused kernel (the same arithmetic, rounded in another order; a run
    resumed from a checkpoint of the loop keeps the loop, whose setting it restores): one pass that reads and writes each element once and
    allocates no temporary, where the default steps one parameter at a time through a
    handful of elementwise kernels (``scripts/bench_optimizer.py`` on 2 cores: 4.4x,
    5.4x and 8.2x faster at mm10 1 Mb/10, 500 kb/20 and 100 kb/30, the parameters
    within 2e-7 of the loop's, relative to the largest, after 8 steps). On CUDA the
    default (foreach kernels) stays, which the memory model was held to there."""
    params = list(params)
    cpu = all(p.device.type == "cpu" for p in params)
    kw = {"fused": True} if cpu and not capturable else {"capturable": capturable}
    if weight_decay:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **kw)
    return torch.optim.Adam(params, lr=lr, **kw)


def epoch_batches(n: int, batch_size: int, seed: int, stage: int, epoch: int) -> list[np.ndarray]:
    """Cell indices of every batch of one epoch: a permutation fixed by (seed, stage, epoch),
    so a resumed run needs only its position. A trailing batch of one cell joins the
    previous batch (batch normalisation needs two)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + stage * 10_007 + epoch)
    perm = torch.randperm(n, generator=g).numpy()
    batches = [perm[i : i + batch_size] for i in range(0, n, batch_size)]
    if len(batches) > 1 and len(batches[-1]) < 2:
        # pop first: ``batches[-2] = ...`` would name its target after the pop and write
        # over the batch before the one meant
        last = batches.pop()
        batches[-1] = np.concatenate([batches[-1], last])
    return batches


def plan_mesh(plan: Plan | None) -> Mesh:
    """This process's place in the plan's dp x tp mesh under torchrun; 1 x 1 in one
    process (where only the plan's S3 and S4 apply).

    Raises InputError when the plan's mesh does not multiply to the world size.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if plan is not None and plan.world > 1:
            log.info("one process: the plan's %d-process mesh is not used (launch with torchrun or `ampflow train --launch`)", plan.world)
        return Mesh(1, 1)
    world = dist.get_world_size()
    mesh = plan.mesh if plan is not None else None
    tp = mesh.tp if mesh is not None else 1
    dp = mesh.dp if mesh is not None else world
    if dp * tp != world:
        raise InputError(f"the plan's mesh dp x tp must equal the {world} launched processes", key="mesh", value={"dp": dp, "tp": tp})
    return Mesh.build(dp, tp)


def run_threads(cfg: TrainConfig, plan: Plan | None, device: torch.device) -> tuple[int, str]:
    """Torch threads of this process and why: an explicit ``train.threads``; for
    ``auto``, the plan's figure on CPU (:attr:`Plan.threads`), else 1."""
    if cfg.explicit_threads is not None:
        return cfg.explicit_threads, "train.threads"
    if device.type == "cpu" and plan is not None and plan.threads:
        return plan.threads, "the plan's, train.threads auto"
    return 1, "train.threads auto and no planned figure" + (" for a CPU run" if device.type == "cpu" else " on a GPU")


def seed_everything(seed: int) -> torch.Generator:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed + 1)


class Trainer:
    """Trains a :class:`PairedModel` on :class:`PairedData` into ``out_dir``.

    Writes ``model.pt``, ``embeddings.h5ad`` and ``config.yaml`` (each atomically, at
    the end) and keeps resumable state in ``checkpoints/``, closed by
    ``checkpoints/finished.json`` once the outputs are written (a later run of the same
    folder then trains from step 0; see :mod:`~ampflow.train.checkpoint`).
    ``metrics.jsonl`` grows by one row per step while it trains (rebuilt from the
    checkpointed rows on resume) and is replaced atomically by the complete rows at the end.
    ``plan`` (from ``ampflow diagnose``) is applied by
    :func:`~ampflow.parallel.parallelize.parallelize`: see the module docstring.
    """

    def __init__(self, data: PairedData, model_cfg: ModelConfig, train_cfg: TrainConfig, out_dir, name: str = "",
                 plan: Plan | None = None):  # fmt: skip
        if model_cfg.hic_max_distance is not None:  # a reach in base pairs, as a stratum of this data (model.pt keeps it)
            resolution = data.meta.get("hic", {}).get("resolution")
            model_cfg = model_cfg.at_resolution(resolution)
            log.info("Hi-C encoder reach: strata 0-%d (model.hic_max_distance over the data's %s bp bins)", model_cfg.hic_max_stratum, resolution)
        first, last = model_cfg.hic_scored_strata(data.n_strata)
        log.info("Hi-C likelihood: the features of strata %d-%d of the data's 0-%d (model.hic_likelihood %s); every stratum is decoded",
                 first, last, data.n_strata - 1, model_cfg.hic_likelihood)  # fmt: skip
        self.data, self.model_cfg, self.cfg = data, model_cfg, train_cfg
        self.plan = plan or Plan()
        self.mesh = plan_mesh(plan)
        self.rank = self.mesh.rank
        self.out = Path(out_dir)
        self.ckpt_dir = self.out / "checkpoints"
        self.name = name or self.out.name
        # the plan's device when it records one (a plan for cuda without a GPU is refused),
        # else train.device's
        device, source = run_device(train_cfg, plan)
        self.device = torch.device(device)
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        # said out loud: a GPU left unused is a choice of the config, never a silent fallback
        if plan is not None and plan.device:
            source = f"{source} {plan.device}; train.device {train_cfg.device}"
        log.info(
            "device: %s (%s; %d CUDA GPU(s) visible%s), %d process(es)",
            self.device.type, source, gpus, ", not used" if gpus and self.device.type == "cpu" else "", self.mesh.world,
        )  # fmt: skip
        log.info("determinism: %s", use_deterministic(train_cfg.deterministic, self.device.type == "cuda"))
        self.threads, why = run_threads(train_cfg, self.plan, self.device)
        torch.set_num_threads(self.threads)
        log.info("torch threads: %d per process (%s)", torch.get_num_threads(), why)
        self.generator = seed_everything(train_cfg.seed)
        self.dtype = getattr(torch, train_cfg.dtype)
        data.use_batches(model_cfg.batch_key)
        # the cells it fits on; held-out ones (obs["split"]) are in no batch, so in no
        # loss, gradient or BatchNorm statistic, and are only embedded at the end
        self.train_rows = data.train_rows
        if len(self.train_rows) < 2:
            raise InputError(f"{len(self.train_rows)} training cell(s) of {data.n_cells}; training needs at least two", key="obs.split")
        # the plan's S3/S4 settings replace the config's; without a plan the model runs as built
        self.model = parallelize(build_model(model_cfg, data).to(self.device, self.dtype), plan, self.mesh)
        # a number, a ZScoreBound (its state checkpointed, a new warm-up each stage) or None
        self.clip = make_bound(train_cfg.clip_grad_norm)
        self.dp_step = DataParallelStep(self.mesh, self.clip)
        self.clipping = ClipTally(train_cfg.clip_grad_norm)
        self.contacts = np.asarray(data.hic.sum(axis=1), dtype=np.float64).ravel()  # (n_cells,)
        if train_cfg.hic_keep_min < 1:
            check_integer_counts(data.hic, data.obs.index)
            log.info("Hi-C thinning: each training step's cells keep each contact with a probability drawn per cell from [%g, 1] "
                     "(train.hic_keep_min), read by %s; validation and the embeddings read every contact", train_cfg.hic_keep_min,
                     "the encoder alone, the likelihood scoring the counts whole (train.hic_thinned: encoder)"
                     if train_cfg.encoder_copy else "the encoder and the likelihood")  # fmt: skip
        # early stopping sets a fixed subset of them aside to validate on
        self.train_rows, self.val_rows = validation_split(self.train_rows, train_cfg.early_stopping, train_cfg.seed)
        self.early = EarlyStopping(train_cfg.early_stopping)
        if self.early.cfg.on:
            log.info(
                "early stopping: %d of %d training cells validate, patience %d epoch(s); the stages' epochs are a ceiling",
                len(self.val_rows), len(self.val_rows) + len(self.train_rows), self.early.cfg.patience,
            )  # fmt: skip
        self.mode = choose_mode(train_cfg.compile, train_cfg.cuda_graphs, self.device, self.mesh.world)
        log.info("training step: %s", self.mode.describe())
        # capturable: Adam's step counts live on the device (no host read per step; a graph needs it)
        capturable = self.mode.graphs
        self.optimizer = make_optimizer(self.model.parameters(), train_cfg.stages[0][1].lr, train_cfg.weight_decay, capturable)
        self.static = None
        if self.mode.static:
            # every draw of the step, made on the device (saved in checkpoints)
            self.step_generator = torch.Generator(self.device).manual_seed(train_cfg.seed + 2)
            self.static = StaticStep(self.model, self.optimizer, self.mode, self.step_generator, clip=self.clip)
            log.info("Hi-C decoder strata: %s", "all in one pass (stacked)" if self.static.stacked else "one at a time")
            self.resident = self._resident_cells()
            self.pinned = PinnedCopy()
        self.pending: list[dict] = []  # rows whose loss terms are still on the device
        # a read from a GPU waits for its queue (a host sync); from the CPU it costs nothing
        self.read_every = train_cfg.log_every if self.device.type == "cuda" else 1
        self.checkpoint_interval = train_cfg.checkpoint_interval(self.device.type)
        log.info("checkpoints: every %d steps%s (train.checkpoint_seconds %s)", train_cfg.checkpoint_every,
                 f", at least {self.checkpoint_interval:g} s apart" if self.checkpoint_interval else "", train_cfg.checkpoint_seconds)  # fmt: skip
        # an eval forward holds no activations for a backward: on a GPU, where a batch's
        # cost is its kernel launches, fewer and larger batches (per-cell terms are
        # weighted by cells, so only rounding differs); on CPU the training batch, as before
        self.validation_batch = train_cfg.batch_size * (VALIDATION_BATCH_FACTOR if self.device.type == "cuda" else 1)
        self.step = 0
        self.position = (0, 0, 0)  # stage, epoch, batch: the next batch to run
        self.work_ratios: list[float] = []  # per step, under data parallelism
        self.measured_steps = 0  # steps of this process whose memory was measured

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
        skip = ("checkpoint_every", "checkpoint_seconds", "keep_checkpoints", "gpus", "log_every", "compile", "cuda_graphs")
        train = {k: v for k, v in self.cfg.to_dict().items() if k not in skip}
        train["threads"] = self.threads  # as it runs: CPU reductions split by thread count
        h.update(json.dumps([self.model_cfg.to_dict(), _plain(train)], sort_keys=True).encode())
        if self.plan.chunk or self.plan.uses_key_first:  # they change the rounding
            h.update(json.dumps(self.applied_settings(), sort_keys=True).encode())
        if self.mode.static:  # draws from the device generator; compiled code rounds otherwise
            h.update(json.dumps({"compile": self.mode.compile, "graphs": self.mode.graphs}).encode())
        if self.mesh.dp > 1:  # other dp degrees draw other noise
            h.update(json.dumps({"dp": self.mesh.dp}).encode())
        if d.batch_names:  # the cells' batches are what the decoders are conditioned on
            h.update(json.dumps(d.batch_names).encode() + d.batch_codes.tobytes())
        if len(self.train_rows) < d.n_cells:  # another split trains on other cells
            h.update(json.dumps({"train_rows": self.train_rows.tolist()}).encode())
        return h.hexdigest()

    def applied_settings(self) -> dict:
        """The plan's single-process savers as the model runs them: S3's chunk (0: none)
        and S4's key-first decode."""
        dec = self.model.hic_decoder
        return {"chunk": int(dec.blocks[0].chunk or 0) if len(dec.blocks) else 0, "key_first": bool(dec.key_first)}

    def _payload(self) -> dict:
        """What a checkpoint holds; the model and optimizer consolidated to their
        single-process state (a collective over the tp group: every rank calls it)."""
        model, optimizer = full_state(self.model, self.optimizer)
        return {
            "run_key": self.run_key(),
            "step": self.step,
            "position": list(self.position),
            "model": model,
            "optimizer": optimizer,
            "rng": checkpoint.rng_state(self.generator, cuda=self.device.type == "cuda"),
            "early_stopping": self.early.state(),
            **({"step_generator": self.step_generator.get_state()} if self.static is not None else {}),
            **({"clip_bound": self.clip.state()} if isinstance(self.clip, ZScoreBound) else {}),
        }

    def _save_checkpoint(self) -> None:
        """Rank 0 writes the checkpoint, with every rank's RNG states and the mesh."""
        payload = self._payload()
        if self.mesh.world == 1:
            checkpoint.save(self.ckpt_dir, self.step, payload, self.cfg.keep_checkpoints)
            return
        states: list = [None] * self.mesh.world
        dist.all_gather_object(states, payload["rng"])
        if self.rank == 0:
            payload.update(rng_ranks=states, mesh={"dp": self.mesh.dp, "tp": self.mesh.tp})
            checkpoint.save(self.ckpt_dir, self.step, payload, self.cfg.keep_checkpoints)

    def _load_latest(self) -> tuple[dict | None, Path | None]:
        if self.mesh.world == 1:
            return checkpoint.load_latest(self.ckpt_dir, self.run_key())
        # rank 0 chooses (and cleans up); every rank then loads that file
        state, path = checkpoint.load_latest(self.ckpt_dir, self.run_key()) if self.rank == 0 else (None, None)
        chosen = [str(path) if path is not None else None]
        dist.broadcast_object_list(chosen, src=0)
        if chosen[0] is None:
            return None, None
        if state is None:
            state = torch.load(chosen[0], map_location="cpu", weights_only=True)
        state["rng"] = self._own_rng(state, chosen[0])
        return state, Path(chosen[0])

    def _own_rng(self, state: dict, path: str) -> dict:
        """This rank's RNG states from a checkpoint written on any mesh of the same dp
        degree (the run key guarantees that): the ranks of one tp group share theirs."""
        ranks, saved = state.get("rng_ranks"), state.get("mesh") or {"dp": 1, "tp": 1}
        if ranks is None:  # written by one process
            return state["rng"]
        if int(saved["dp"]) != self.mesh.dp or len(ranks) != int(saved["dp"]) * int(saved["tp"]):
            raise InputError(f"checkpoint has RNG states for a mesh {saved}, not dp {self.mesh.dp}", path=path)
        return ranks[self.mesh.dp_rank * int(saved["tp"])]

    def _resume(self) -> bool:
        state, path = self._load_latest()
        if state is None:
            if self.rank == 0:
                log.info("training from step 0 (no checkpoint of this run to resume from in %s)", self.ckpt_dir)
            return False
        load_full_state(self.model, state["model"], self.optimizer, state["optimizer"])
        checkpoint.set_rng_state(state["rng"], self.generator, cuda=self.device.type == "cuda")
        if self.static is not None:
            self.step_generator.set_state(state["step_generator"])
        self.early.load(state.get("early_stopping"))
        if isinstance(self.clip, ZScoreBound):
            self.clip.load(state.get("clip_bound", {}), self.dtype, self.device)
        self.step = int(state["step"])
        self.position = tuple(int(x) for x in state["position"])
        log.info("resumed from %s (step %d, stage %d, epoch %d, batch %d)", path, self.step, *self.position)
        return True

    def _metrics_file(self, resumed: bool) -> Path:
        """The working copy of the metrics, ``checkpoints/metrics.partial.jsonl``, cut back
        to the rows up to the resumed checkpoint (none for a fresh run).

        It is the copy a resumed run trusts: it lives beside the checkpoints, which
        Snakemake does not delete when a job fails, and its rows are fsynced before each
        checkpoint is written, so every row up to a checkpoint's step is in it.
        """
        partial = self.ckpt_dir / checkpoint.PARTIAL_METRICS
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        kept = []
        if resumed and partial.exists():
            lines = partial.read_text().splitlines()
            kept = [ln for ln in lines if (step := _row_step(ln)) is not None and step <= self.step]
        partial.write_text("".join(ln + "\n" for ln in kept))
        return partial

    def _live_metrics(self, partial: Path) -> Path:
        """``metrics.jsonl`` rebuilt from the working copy's kept rows, to grow row by row.

        A user watching a long run reads it while it trains. It is rebuilt (atomically)
        rather than appended to, because a crashed run's copy may hold rows past the
        last checkpoint, which the resumed run trains again, or may have been deleted
        by Snakemake with the failed job's outputs: so a resumed run shows each step
        once. Whether the run finished is told by ``model.pt`` and ``embeddings.h5ad``,
        which appear only at the end (and ``metrics.jsonl`` is then replaced atomically
        by the complete working copy).
        """
        live = self.out / "metrics.jsonl"
        with atomic_path(live) as tmp:
            tmp.write_bytes(partial.read_bytes())
        return live

    # ----------------------------------------------------------- loop
    def batches(self, stage: int, epoch: int) -> list[np.ndarray]:
        """Cell (row) indices of every batch of one epoch: :func:`epoch_batches` over the
        training cells, so with none held out the indices are those of every cell."""
        return [self.train_rows[b] for b in epoch_batches(len(self.train_rows), self.cfg.batch_size, self.cfg.seed, stage, epoch)]

    def _metrics_row(self, stage_name, epoch, n_cells, terms, seconds, memory, **extra) -> dict:
        """One line of metrics.jsonl; a step whose memory was measured (``memory``, a
        :class:`~ampflow.train.measured_memory.StepMemory`) adds ``peak_bytes`` (the allocator's
        peak of the step), ``peak_phase`` (``forward``, ``backward`` or
        ``optimizer_step``), ``peak_source`` (``allocator`` on CPU, ``cuda``) and
        ``stratum_bytes`` (bytes held after each Hi-C stratum of the forward pass).

        On CUDA ``peak_bytes`` is ``max_memory_allocated`` (512 B blocks, the persistent
        cuBLAS workspaces included), and the row adds ``peak_requested_bytes`` (the
        bytes asked for, no rounding), ``peak_reserved_bytes`` (the segments held, what
        an out-of-memory error follows), ``base_bytes`` (allocated when the step began)
        and ``held_bytes`` (the step's tensors among them), so that a reader can
        compare with the memory model net of the workspaces:
        ``peak_bytes - (base_bytes - held_bytes)``. A CPU row is as before."""
        row = {
            "stage": stage_name,
            "epoch": epoch,
            "step": self.step,
            "loss": terms,  # tensors until read (:meth:`_flush`)
            "seconds": seconds,
            "cells_per_s": n_cells / seconds,
            "threads": torch.get_num_threads(),
        }
        if memory is not None:
            row.update(
                peak_bytes=int(memory.peak),
                peak_phase=memory.peak_phase,
                peak_source=memory.source,
                stratum_bytes=[int(x) for x in memory.marks[: self.data.n_strata]],
            )
            if memory.source == "cuda":
                cuda = {"peak_requested_bytes": memory.requested, "peak_reserved_bytes": memory.reserved,
                        "base_bytes": memory.base, "held_bytes": memory.held}  # fmt: skip
                row.update({k: int(v) for k, v in cuda.items() if v is not None})
        return {**row, **extra}

    def _resident_cells(self) -> dict | None:
        """The counts on the device as padded rows (:class:`DeviceCells`) when they fit
        beside the step's predicted peak; None: densified on the host and copied from
        pinned memory (and always on CPU, where the host's matrices are the device's)."""
        if self.device.type != "cuda":
            return None
        mats = {"hic": self.data.hic, **({"rna": self.data.rna} if self.data.has_rna else {})}
        thinned = self.cfg.hic_keep_min < 1
        value_bytes = {k: 4 if thinned and k == "hic" else torch.finfo(self.dtype).bits // 8 for k in mats}
        need = sum(padded_bytes(m, value_bytes[k]) for k, m in mats.items())
        if thinned:  # the largest batch's transient draws beside the rows
            need += thinning_bytes(self.data.hic, self.cfg.batch_size)
        free, _ = torch.cuda.mem_get_info(self.device)
        room = free - int(self.plan.predicted_peak_bytes or 0) - RESIDENT_MARGIN_BYTES
        if need > room:
            log.info("training counts: %.2f GiB as padded rows do not fit beside the step (%.2f GiB free less the plan's peak and a "
                     "margin): densified on the host, copied from pinned memory", need / 2**30, max(room, 0) / 2**30)  # fmt: skip
            return None
        cells = {k: DeviceCells(m, self.device, self.dtype, thinned=thinned and k == "hic") for k, m in mats.items()}
        if self.data.batch_names:
            cells["codes"] = torch.as_tensor(self.data.batch_codes, dtype=torch.long, device=self.device)
        log.info("training counts on the device: %.2f GiB as padded rows (%.2f GiB room); batches densified%s there", need / 2**30, room / 2**30,
                 " and thinned" if thinned else "")  # fmt: skip
        return cells

    def _thinning(self) -> tuple[float, int, int] | None:
        """This step's Hi-C thinning for :meth:`PairedData.batch` (None: off): each cell's
        draws keyed by the seed, the step and the cell alone, so that every rank thins
        its rows as one process thins the whole batch, and a resumed run as the whole."""
        return None if self.cfg.hic_keep_min >= 1 else (self.cfg.hic_keep_min, self.cfg.seed, self.step)

    def _batch(self, cells: np.ndarray, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Dense (rna, hic, hic_in) of ``cells`` on the host: ``hic`` thinned where
        both the encoder and the likelihood read the thinned counts; with
        ``train.hic_thinned: encoder`` ``hic`` whole and ``hic_in`` its thinned copy
        (the same draws), else None."""
        if not self.cfg.encoder_copy:
            return (*self.data.batch(cells, dtype, self._thinning()), None)
        rna, hic = self.data.batch(cells, dtype)
        return rna, hic, self.data.hic_batch(cells, dtype, self._thinning())

    def _load_static(self, cells: np.ndarray, bufs) -> None:
        """The batch's counts and batch indicators into the static step's buffers."""
        if self.resident is not None:
            idx = torch.as_tensor(cells, dtype=torch.long).to(self.device, non_blocking=True)
            if bufs.hic_in is None:
                self.resident["hic"].densify(idx, bufs.hic, self._thinning(), cells)
            else:  # the counts whole for the likelihood, the thinned copy for the encoder
                self.resident["hic"].densify(idx, bufs.hic)
                self.resident["hic"].densify(idx, bufs.hic_in, self._thinning(), cells)
            if "rna" in self.resident:
                self.resident["rna"].densify(idx, bufs.rna)
            if bufs.cond is not None:  # one-hot by scatter: one_hot() checks its values on the host
                bufs.cond.zero_().scatter_(1, self.resident["codes"].index_select(0, idx).unsqueeze(1), 1.0)
            return
        rna, hic, hic_in = self._batch(cells, self.dtype)
        self.pinned.copy(rna, bufs.rna)
        self.pinned.copy(hic, bufs.hic)
        if hic_in is not None:
            self.pinned.copy(hic_in, bufs.hic_in)
        if bufs.cond is not None:
            self.pinned.copy(self.data.conditions(cells, self.dtype), bufs.cond)

    def _checkpoint_time(self) -> bool:
        """Whether ``train.checkpoint_seconds`` have passed since the last checkpoint (or
        the start), as rank 0 sees it: every rank takes part in a checkpoint."""
        if self.checkpoint_interval <= 0:
            return True
        due = [time.monotonic() - self._last_checkpoint >= self.checkpoint_interval]
        if self.mesh.world > 1:
            dist.broadcast_object_list(due, src=0)
        return bool(due[0])

    def _measure_now(self) -> bool:
        """Whether this step's memory is measured: the first :data:`MEASURED_STEPS` steps,
        and on CUDA each checkpoint's step too."""
        if self.measured_steps < MEASURED_STEPS:
            return True
        return self.device.type == "cuda" and (self.step + 1) % self.cfg.checkpoint_every == 0

    def _static_step(self, idx: np.ndarray, stage_name: str, stage_cfg, epoch: int) -> dict:
        """One step through :class:`StaticStep` (one process): no host round-trip; the
        memory measured on the first steps and at each checkpoint's step."""
        bufs = self.static.buffers(len(idx), self.data.rna.shape[1], self.data.hic.shape[1], self.data.n_batches, self.cfg.encoder_copy)
        self._load_static(idx, bufs)
        measure = self._measure_now()

        def run(on_stratum=None, on_phase=None):
            if on_phase is not None:
                on_phase("step")  # one phase: a compiled or replayed step has no hooks between them
            return self.static.step(bufs, stage_cfg.weights, self.cfg.batch_size)

        self.model.train()
        t0 = time.perf_counter()
        if measure:
            out, memory = measure_step(run, self.model, self.optimizer, *batch_tensors(bufs.rna, bufs.hic, bufs.hic_in))
        else:
            out, memory = run(), None
        self.measured_steps += memory is not None
        memory = self.static.step_memory(memory)
        row = self._metrics_row(stage_name, epoch, len(idx), dict(zip(self.static.term_names(), out.unbind())), time.perf_counter() - t0, memory)
        if self.device.type == "cuda":  # timed when read (:meth:`_flush`)
            row["_launch_seconds"] = row["seconds"]
        return row

    def _flush(self, files) -> None:
        """Read the pending rows' loss terms from the device (one host sync), write the
        rows to ``files``, and stop on a NaN loss naming its step. On a GPU a step's
        seconds are those of the rows read together, shared equally (the host only
        launched them when it timed them)."""
        if not self.pending:
            return
        # the loss terms, then the clipped rows' gradient norms and bounds, in one read
        norms = [r for r in self.pending if torch.is_tensor(r.get("grad_norm"))]
        bounds = [r for r in norms if torch.is_tensor(r.get("grad_bound"))]
        parts = [torch.stack(list(r["loss"].values())).double() for r in self.pending]
        parts += [torch.stack([r[k] for r in rows]).double() for k, rows in (("grad_norm", norms), ("grad_bound", bounds)) if rows]
        flat = torch.cat(parts).cpu().tolist()
        timed = [r for r in self.pending if "_launch_seconds" in r]
        if timed:
            elapsed = time.perf_counter() - self._window_start
            for r in timed:
                r["seconds"] = elapsed / len(self.pending)
                r["cells_per_s"] = r["cells_per_s"] * r.pop("_launch_seconds") / r["seconds"]
        i = 0
        for r in self.pending:
            names = list(r["loss"])
            r["loss"] = dict(zip(names, flat[i : i + len(names)]))
            i += len(names)
        for r in norms:
            r["grad_norm"] = flat[i]
            i += 1
        for r in bounds:
            r["grad_bound"] = flat[i] if math.isfinite(flat[i]) else None  # null: not scaled
            i += 1
        for r in norms:
            self.clipping.add(r["stage"], r["grad_norm"], r.get("grad_bound"))
        for r in self.pending:
            line = json.dumps(r, sort_keys=True) + "\n"
            for fh in files:
                fh.write(line)
                fh.flush()
        bad = next((r for r in self.pending if math.isnan(r["loss"]["total"])), None)
        self.pending = []
        self._window_start = time.perf_counter()
        if bad is not None:
            raise FloatingPointError(f"loss became NaN at step {bad['step']} ({bad['stage']}, epoch {bad['epoch']})")

    def _train_step(self, idx: np.ndarray, stage_name: str, stage_cfg, epoch: int) -> dict:
        """This dp group's share of the batch (split by Hi-C contacts), one step on the
        mesh (in one process: the whole batch); with more than one process the metrics
        row carries every rank's work share, peak and per-stratum bytes."""
        if self.static is not None:
            return self._static_step(idx, stage_name, stage_cfg, epoch)
        contacts = self.contacts[idx]
        split = balanced_split(contacts, self.mesh.dp)
        rows = split[self.mesh.dp_rank]
        cells = idx[rows.numpy()]
        rna, hic, hic_in = self._batch(cells)
        rna, hic = rna.to(self.device, self.dtype), hic.to(self.device, self.dtype)
        hic_in = None if hic_in is None else hic_in.to(self.device, self.dtype)
        cond = self.data.conditions(cells, self.dtype)
        cond = None if cond is None else cond.to(self.device)
        # the same decision on every rank: the step count is
        measure = self._measure_now()
        t0 = time.perf_counter()
        terms, memory = measured_dp_step(self.dp_step, self.model, self.optimizer, rna, hic, stage_cfg.weights, rows, len(idx),
                                         self.generator, measure=measure, cond=cond, hic_in=hic_in)  # fmt: skip
        seconds = time.perf_counter() - t0
        self.measured_steps += memory is not None
        if self.mesh.world == 1:
            row = self._metrics_row(stage_name, epoch, len(idx), terms, seconds, memory)
            if self.device.type == "cuda":  # timed when read (:meth:`_flush`)
                row["_launch_seconds"] = seconds
            return row
        ranks: list = [None] * self.mesh.world
        mine = None if memory is None else (int(memory.peak), [int(x) for x in memory.marks[: self.data.n_strata]])
        dist.all_gather_object(ranks, (seconds, mine))
        seconds = max(s for s, _ in ranks)
        self.work_ratios.append(work_ratio(contacts, split))
        totals = [float(contacts[r.numpy()].sum()) for r in split]
        mean = sum(totals) / len(totals)
        extra = {}
        if memory is not None:
            # peak over the ranks; stratum_bytes are rank 0's, rank_stratum_bytes every rank's
            extra = {"rank_peak_bytes": [m[0] for _, m in ranks], "rank_stratum_bytes": [m[1] for _, m in ranks]}
        row = self._metrics_row(
            stage_name, epoch, len(idx), terms, seconds, memory,
            work_ratio=self.work_ratios[-1],
            rank_work=[t / mean if mean > 0 else 1.0 for t in totals],
            rank_cells=[int(r.numel()) for r in split],
            **extra,
            mesh={"dp": self.mesh.dp, "tp": self.mesh.tp},
        )  # fmt: skip
        if memory is not None:
            row["peak_bytes"] = max(extra["rank_peak_bytes"])
        return row

    def fit(self) -> bool:
        """Train to the end (resuming if checkpoints exist); True when the outputs are written."""
        resumed = self._resume()
        main = self.rank == 0
        metrics_path = self._metrics_file(resumed) if main else Path(os.devnull)
        live_path = self._live_metrics(metrics_path) if main else Path(os.devnull)
        n = len(self.train_rows)
        total_steps = sum(cfg.epochs * len(epoch_batches(n, self.cfg.batch_size, 0, 0, 0)) for _, cfg in self.cfg.stages)
        # the rate counts this run's steps only (a resumed run's earlier ones took no time
        # here), from the end of its first step (which pays for warming up)
        progress = Progress(total_steps, "steps", log, verb="trained", done=self.step)
        warm = self.step + 1
        start_stage, start_epoch, start_batch = self.position
        # every row goes to both files as its step completes: the working copy (fsynced
        # at each checkpoint, for resume) and metrics.jsonl (flushed, for people watching)
        self._window_start = time.perf_counter()
        self._last_checkpoint = time.monotonic()  # a resumed run has just read one
        with open(metrics_path, "a") as mfh, open(live_path, "a") as lfh:
            for s, (stage_name, stage_cfg) in enumerate(self.cfg.stages):
                if s < start_stage:
                    continue
                for group in self.optimizer.param_groups:
                    group["lr"] = stage_cfg.lr
                for epoch in range(start_epoch if s == start_stage else 0, stage_cfg.epochs):
                    batches = self.batches(s, epoch)
                    first = start_batch if (s == start_stage and epoch == start_epoch) else 0
                    stop = False
                    for b in range(first, len(batches)):
                        row = self._train_step(batches[b], stage_name, stage_cfg, epoch)
                        norm = self.dp_step.norm if self.static is None else self.static.norm
                        if norm is not None:  # before clipping; read with the loss terms
                            row["grad_norm"] = norm.detach().clone()
                            if isinstance(self.clip, ZScoreBound):  # this step's bound (inf: none)
                                row["grad_bound"] = self.clip.last.clone()
                        self.step += 1
                        row["step"] = self.step
                        if b + 1 == len(batches) and self.early.cfg.on:
                            t_val = time.perf_counter()
                            # before this step's checkpoint, so that a resumed run has it
                            row["validation"] = validation_loss(self.model, self.data, self.val_rows, stage_cfg.weights,
                                                                self.validation_batch, self.device, self.dtype)  # fmt: skip
                            stop = self.early.update(row["validation"], epoch, lambda: full_state(self.model)[0])
                            self._window_start += time.perf_counter() - t_val  # not a step's time
                        self.pending.append(row)
                        checkpoint_due = self.step % self.cfg.checkpoint_every == 0 and self._checkpoint_time()
                        # the terms stay on the device until read: every log_every steps, and
                        # before a checkpoint (its rows fsynced first) or the epoch's end
                        if len(self.pending) >= self.read_every or checkpoint_due or b + 1 == len(batches) or stop:
                            self._flush((mfh, lfh))
                        progress.update()
                        if self.step == warm:
                            progress.restart_clock()
                        self.position = (s, epoch, b + 1) if b + 1 < len(batches) else (s, epoch + 1, 0)
                        if stop:  # the stage's remaining epochs are skipped, after a resume too
                            self.position = (s, stage_cfg.epochs, 0)
                            log.info(
                                "%s stopped after epoch %d of %d: the validation loss did not improve for %d epoch(s) (best %.6g at epoch %d)",
                                stage_name, epoch + 1, stage_cfg.epochs, self.early.bad, self.early.best, self.early.best_epoch + 1,
                            )  # fmt: skip
                        if checkpoint_due:
                            t_save = time.perf_counter()
                            if main:
                                os.fsync(mfh.fileno())
                            self._save_checkpoint()
                            self._last_checkpoint = time.monotonic()
                            self._window_start += time.perf_counter() - t_save  # not a step's time
                    if stop:
                        break
                self._end_stage(stage_name, stage_cfg.epochs)
                self.position = (s + 1, 0, 0)
        if self.mesh.dp > 1 and self.work_ratios:
            log.info(
                "per-rank work over %d data-parallel groups (max/mean Hi-C contacts per step): mean %.4f, worst %.4f",
                self.mesh.dp, sum(self.work_ratios) / len(self.work_ratios), max(self.work_ratios),
            )  # fmt: skip
        model_state, _ = full_state(self.model)  # every rank takes part; rank 0 writes
        if main:
            self._write_outputs(metrics_path, model_state)
        if self.mesh.world > 1:
            dist.barrier()
        return True

    def _end_stage(self, stage_name: str, epochs: int) -> None:
        """With early stopping: the best epoch's weights back in the model, and a fresh
        rule for the next stage (the optimizer keeps its moments)."""
        clipped = self.clipping.line(stage_name)
        if clipped:
            log.info("%s", clipped)
        if isinstance(self.clip, ZScoreBound):  # the next stage's norms have their own scale
            self.clip.reset()
        if self.early.best_state is not None and not self.early.stopped:
            log.info("%s ran all %d epochs without stopping", stage_name, epochs)
        if self.early.best_state is not None:
            load_full_state(self.model, self.early.best_state)
            log.info("%s: weights of epoch %d restored (validation loss %.6g)", stage_name, self.early.best_epoch + 1, self.early.best)
        self.early.reset()

    # ----------------------------------------------------------- outputs
    def _write_outputs(self, metrics_path: Path, model_state: dict) -> None:
        """Embeddings, model.pt, config and metrics from the consolidated model state
        (in a plain model: the same files whatever mesh trained it)."""
        model = build_model(self.model_cfg, self.data).to(self.device, self.dtype)
        model.load_state_dict(model_state)
        model.eval()  # every cell, held-out ones included
        n, size = self.data.n_cells, EMBED_ROWS
        batches = (self.data.batch(np.arange(i, min(i + size, n))) for i in range(0, n, size))
        moved = ((r.to(self.device, self.dtype), h.to(self.device, self.dtype)) for r, h in batches)
        x_rna, x_hic = latent_means(model.embed, moved, self.model_cfg.latent_dim)
        uns = {"config": self.name, "seed": self.cfg.seed, "steps": self.step}
        if len(self.train_rows) < self.data.n_cells:
            uns["trained_cells"] = len(self.train_rows)
        emb = embeddings_anndata(self.data.obs, x_rna, x_hic, self.model_cfg.shared_dim, uns)
        with atomic_path(self.out / "embeddings.h5ad") as tmp:
            emb.write_h5ad(tmp)
        with atomic_path(self.out / "model.pt") as tmp:
            checkpoint.save_torch(
                {
                    "state_dict": model_state,
                    "model_config": self.model_cfg.to_dict(),
                    "train_config": _plain(self.cfg.to_dict()),
                    "plan_settings": self.applied_settings(),
                    "threads": self.threads,
                    "steps": self.step,
                    # what ``ampflow embed`` maps other files' columns onto, in order
                    "genes": list(self.data.genes),
                    "features": list(self.data.features),
                    "n_strata": int(self.data.n_strata),
                    "feature_stratum": [int(k) for k in self.data.feature_stratum.tolist()],
                    # the decoders' batches (the encoders that ``embed`` runs need none)
                    "batches": list(self.data.batch_names),
                },
                tmp,
            )
        with atomic_path(self.out / "config.yaml") as tmp:
            tmp.write_text(yaml.safe_dump({"name": self.name, "model": self.model_cfg.to_dict(), "train": _plain(self.cfg.to_dict())}, sort_keys=True))
        with atomic_path(self.out / "metrics.jsonl") as tmp:
            tmp.write_bytes(metrics_path.read_bytes())
        # every output is in place: this attempt is over, and a new job for the same
        # folder (--forcerun, new code) trains from step 0 instead of resuming from it
        checkpoint.mark_finished(self.ckpt_dir, self.run_key(), self.step)
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
