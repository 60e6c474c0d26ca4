"""Training: seeded determinism, resume after a kill, corrupt checkpoints, the outputs.

The data folder (rna.h5ad, hic.h5ad, graph/) is built once per module from a small
demo with the same library calls as the workflow's prepare rules, without Snakemake.
Everything trains on the CPU, where resumed runs are bit-identical.

Longer than 400 lines on purpose: every case shares the module's one prepared data folder
and reference run, which a split would prepare and train again per file.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import torch
import yaml
from helpers import MODEL, SETTINGS, assert_same_model, load_model, metrics, prepare
from trainer_doubles import StoppingTrainer

from ampflow.base.errors import InputError
from ampflow.cli import main
from ampflow.contract.config import ModelConfig, TrainConfig
from ampflow.contract.plan import Plan
from ampflow.contract.plan_sections import CpuSection
from ampflow.demo import write_demo
from ampflow.io.genome import read_chromsizes
from ampflow.io.split import read_split, write_split
from ampflow.train import checkpoint
from ampflow.train.data import PairedData, load_paired
from ampflow.train.trainer import MEASURED_STEPS, Trainer, epoch_batches

TRAIN = TrainConfig.from_dict(SETTINGS)
# 23 cells pass QC; batches of 8 -> 3 per epoch; 3 + 2 epochs
STEPS_PER_EPOCH = 3
N_STEPS = 5 * STEPS_PER_EPOCH
LOSS_TERMS = {"rna_nll", "hic_nll", "rna_kl", "hic_kl", "graph_nll", "graph_kl", "align", "total"}


@pytest.fixture(scope="module")
def demo_work(tmp_path_factory) -> tuple[dict, Path]:
    root = tmp_path_factory.mktemp("train-data")
    return write_demo(root / "demo", n_cells=24, seed=0, n_genes=300), root / "work"


@pytest.fixture(scope="module")
def data_dir(demo_work) -> Path:
    return prepare(*demo_work)


@pytest.fixture(scope="module")
def paired(data_dir):
    return load_paired(data_dir)


def fit(paired, out: Path, stop_after: int | None = None) -> bool:
    return StoppingTrainer(paired, MODEL, TRAIN, out, stop_after=stop_after).fit()


@pytest.fixture(scope="module")
def reference(paired, tmp_path_factory) -> Path:
    """An uninterrupted run with the settings above."""
    out = tmp_path_factory.mktemp("reference") / "run"
    assert fit(paired, out) is True
    return out


def assert_same_embeddings(a: Path, b: Path) -> None:
    ea, eb = ad.read_h5ad(a / "embeddings.h5ad"), ad.read_h5ad(b / "embeddings.h5ad")
    assert list(ea.obs_names) == list(eb.obs_names)
    for key in ("X_rna", "X_hic", "X_joint"):
        np.testing.assert_array_equal(ea.obsm[key], eb.obsm[key], err_msg=key)


def assert_same_metrics(a: Path, b: Path) -> None:
    """Each step exactly once, in order, with bit-identical losses (timings aside)."""
    ra, rb = metrics(a), metrics(b)
    assert [r["step"] for r in ra] == list(range(1, len(rb) + 1)) == [r["step"] for r in rb]
    for x, y in zip(ra, rb):
        assert (x["stage"], x["epoch"], x["loss"]) == (y["stage"], y["epoch"], y["loss"]), x["step"]


def no_temporaries(out: Path) -> list[Path]:
    return sorted(out.rglob(".tmp-*"))


# ------------------------------------------------------------------ batches
@pytest.mark.parametrize("batch_size", [2, 4, 8])
def test_epoch_batches_cover_every_cell_once(batch_size):
    """Every cell once per epoch, batches of at least two, for every remainder: a trailing
    cell alone (n = k x batch_size + 1) joins the batch before it. Referee: range(n)."""
    for n in range(2, 4 * batch_size + 3):
        batches = epoch_batches(n, batch_size, 0, 0, 1)
        assert sorted(np.concatenate(batches).tolist()) == list(range(n)), n
        assert all(len(b) >= 2 for b in batches) and all(len(b) <= batch_size + 1 for b in batches), n
        assert len(batches) == max(1, n // batch_size if n % batch_size < 2 else n // batch_size + 1), n


# ------------------------------------------------------------------ determinism
def test_same_seed_same_model(paired, reference, tmp_path):
    out = tmp_path / "again"
    assert fit(paired, out) is True
    assert_same_model(reference, out)
    assert_same_embeddings(reference, out)
    assert_same_metrics(reference, out)


def test_other_seed_other_model(paired, reference, tmp_path):
    cfg = TrainConfig.from_dict({**SETTINGS, "seed": 1})
    Trainer(paired, MODEL, cfg, tmp_path / "seed1").fit()
    a, b = load_model(reference)["state_dict"], load_model(tmp_path / "seed1")["state_dict"]
    assert any(not torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------ outputs
def test_outputs(paired, reference):
    out = reference
    m = load_model(out)
    assert {"state_dict", "model_config", "train_config"} <= set(m)
    # a reach in base pairs is kept as the stratum it is at the data's resolution
    model_kept = MODEL.at_resolution(paired.meta["hic"]["resolution"]).to_dict()
    assert m["model_config"] == model_kept
    assert TrainConfig.from_dict(m["train_config"]) == TRAIN
    assert m["steps"] == N_STEPS

    emb = ad.read_h5ad(out / "embeddings.h5ad")
    assert list(emb.obs_names) == list(paired.obs.index)
    assert emb.n_obs == paired.n_cells == 23
    assert "cell_type" in emb.obs.columns and emb.obs["cell_type"].notna().all()
    for key in ("X_rna", "X_hic"):
        x = emb.obsm[key]
        assert x.shape == (paired.n_cells, MODEL.latent_dim) and x.dtype == np.float32
        assert np.isfinite(x).all()
    # the joint: the whole RNA latent, then the Hi-C latent's private dimensions
    s = emb.uns["ampflow"]["shared_dim"]
    assert s == MODEL.latent_dim - MODEL.private > 0
    joint = emb.obsm["X_joint"]
    assert joint.shape == (paired.n_cells, MODEL.latent_dim + MODEL.private) and joint.dtype == np.float32
    np.testing.assert_array_equal(joint[:, : MODEL.latent_dim], emb.obsm["X_rna"])
    np.testing.assert_array_equal(joint[:, MODEL.latent_dim :], emb.obsm["X_hic"][:, s:])
    assert emb.uns["ampflow"]["steps"] == N_STEPS

    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, N_STEPS + 1))
    assert [r["stage"] for r in rows] == ["pretrain"] * 9 + ["finetune"] * 6
    assert [r["epoch"] for r in rows] == [e for e in (0, 1, 2, 0, 1) for _ in range(STEPS_PER_EPOCH)]
    for r in rows:
        assert set(r["loss"]) == LOSS_TERMS and all(np.isfinite(v) for v in r["loss"].values())
        assert r["seconds"] > 0 and r["cells_per_s"] > 0
        # the allocator's peak is measured on the first steps only (the profiler slows a step)
        measured = r["step"] <= MEASURED_STEPS
        assert ("peak_bytes" in r) == ("stratum_bytes" in r) == measured, r
        if not measured:
            continue
        assert r["peak_bytes"] > 0 and r["peak_source"] == "allocator"
        assert r["peak_phase"] in ("forward", "backward", "optimizer_step")
        sb = r["stratum_bytes"]
        assert len(sb) == paired.n_strata == 4
        assert all(0 < a <= b for a, b in zip(sb, sb[1:])), sb  # running totals on the CPU
        assert sb[-1] <= r["peak_bytes"]
    # the first step has no Adam state yet; the steady state holds more
    assert rows[0]["peak_bytes"] < rows[1]["peak_bytes"]
    # the partial copy in checkpoints/ is what was published
    assert (out / "checkpoints" / "metrics.partial.jsonl").read_bytes() == (out / "metrics.jsonl").read_bytes()

    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["name"] == "run" and cfg["model"] == model_kept
    assert TrainConfig.from_dict(cfg["train"]) == TRAIN

    kept = checkpoint.list_checkpoints(out / "checkpoints")
    assert [p.name for p in kept] == ["step-00000015.pt", "step-00000012.pt", "step-00000009.pt"]
    assert no_temporaries(out) == []


# ------------------------------------------------------------------ metrics while training
def watched_fit(paired, out: Path, stop_after: int | None = None) -> tuple[bool, list[list[int]]]:
    """Train, reading ``metrics.jsonl`` before every step: the steps it held each time."""
    trainer = StoppingTrainer(paired, MODEL, TRAIN, out, stop_after=stop_after)
    seen, step = [], trainer._train_step

    def watch(*args, **kwargs):
        seen.append([r["step"] for r in metrics(out)])
        return step(*args, **kwargs)

    trainer._train_step = watch
    return trainer.fit(), seen


def test_metrics_grow_while_training(paired, reference, tmp_path):
    out = tmp_path / "run"
    assert watched_fit(paired, out)[1] == [list(range(1, k + 1)) for k in range(N_STEPS)]
    assert_same_metrics(reference, out)
    assert no_temporaries(out) == []


@pytest.mark.parametrize("deleted", [False, True], ids=["left", "deleted"])
def test_resumed_run_shows_each_step_once(paired, reference, tmp_path, deleted):
    """A stopped run leaves rows past its last checkpoint (step 6) in metrics.jsonl; the
    resumed run starts it again from the checkpointed rows, whether the file was left or
    deleted (as Snakemake deletes a failed job's outputs)."""
    out = tmp_path / "run"
    assert fit(paired, out, stop_after=8) is False
    assert [r["step"] for r in metrics(out)] == list(range(1, 9))
    if deleted:
        (out / "metrics.jsonl").unlink()
    done, seen = watched_fit(paired, out)
    assert done is True
    assert seen == [list(range(1, k + 1)) for k in range(6, N_STEPS)]
    assert_same_metrics(reference, out)
    assert (out / "checkpoints" / "metrics.partial.jsonl").read_bytes() == (out / "metrics.jsonl").read_bytes()


# ------------------------------------------------------------------ threads
@pytest.mark.parametrize("configured, planned, expected", [("auto", 3, 3), (1, 3, 1), ("auto", None, 1)], ids=["plan", "explicit", "none"])
def test_runs_with_the_plans_threads(paired, tmp_path, configured, planned, expected):
    """train.threads auto runs with the plan's threads per process, an explicit integer
    wins, and with neither it is 1: as torch reports them inside each step (metrics rows)."""
    cpu = CpuSection(cores=3 * planned, processes=1, threads=planned, threads_source="plan") if planned else None
    cfg = dataclasses.replace(TRAIN, threads=configured)
    before = torch.get_num_threads()
    try:
        assert StoppingTrainer(paired, MODEL, cfg, tmp_path / "run", stop_after=2, plan=Plan(cpu=cpu)).fit() is False
    finally:
        torch.set_num_threads(before)  # the other tests' numbers assume theirs
    assert [r["threads"] for r in metrics(tmp_path / "run")] == [expected, expected]


# ------------------------------------------------------------------ held-out cells
HOLDOUT = 0.25


@pytest.fixture(scope="module")
def split_dir(demo_work, data_dir) -> Path:
    """The same demo prepared with a quarter of the cells held out (binning reused)."""
    return prepare(*demo_work, holdout=HOLDOUT, folder="data_split")


@pytest.fixture(scope="module")
def split_file(split_dir) -> Path:
    return split_dir.parent / "qc" / "split.tsv"


@pytest.fixture(scope="module")
def paired_split(split_dir, split_file):
    return load_paired(split_dir, split=split_file)


@pytest.fixture(scope="module")
def split_reference(paired_split, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("split-reference") / "run"
    assert fit(paired_split, out) is True
    return out


def with_counts(data: PairedData, rows: np.ndarray, change) -> PairedData:
    """A copy of ``data`` whose counts in ``rows`` (both modalities) are ``change(x)``."""
    out = {}
    for name in ("rna", "hic"):
        x = getattr(data, name).toarray()
        x[rows] = change(x[rows])
        out[name] = sp.csr_matrix(x.astype(np.float32))
    return dataclasses.replace(data, **out)


def test_heldout_cells_are_in_no_batch(paired_split, split_file, split_reference, tmp_path):
    """The cell indices of every step the trainer runs, against the split file: training
    cells only, each once per epoch, and :meth:`Trainer.batches` is what ran."""
    split = read_split(split_file)
    heldout = set(split.index[split == "heldout"])
    assert len(heldout) >= 4 and len(split) == paired_split.n_cells == 23
    trainer = Trainer(paired_split, MODEL, TRAIN, tmp_path / "run")
    ran = []
    step = trainer._train_step

    def record(idx, *args):
        ran.append(np.array(idx))
        return step(idx, *args)

    trainer._train_step = record
    assert trainer.fit() is True
    names = paired_split.obs.index
    assert not {names[i] for b in ran for i in b} & heldout
    planned = [b for s, (_, cfg) in enumerate(TRAIN.stages) for e in range(cfg.epochs) for b in trainer.batches(s, e)]
    assert len(ran) == len(planned) == metrics(tmp_path / "run")[-1]["step"]
    assert all(np.array_equal(a, b) for a, b in zip(ran, planned))
    training = sorted(names.get_loc(c) for c in split.index[split == "train"])
    for s, (_, cfg) in enumerate(TRAIN.stages):
        for e in range(cfg.epochs):
            assert sorted(np.concatenate(trainer.batches(s, e)).tolist()) == training, "each training cell once per epoch"
    assert_same_model(split_reference, tmp_path / "run")

    emb = ad.read_h5ad(tmp_path / "run" / "embeddings.h5ad")
    assert list(emb.obs_names) == list(split.index), "every cell is embedded, held-out ones included"
    assert list(emb.obs["split"].astype(str)) == list(split)
    assert emb.uns["ampflow"]["trained_cells"] == len(split) - len(heldout)


def test_heldout_counts_do_not_change_the_model(paired_split, split_reference, tmp_path):
    """Other counts for the held-out cells only: the same trained model, bit for bit; their
    own embeddings move. Other counts for one training cell: another model."""
    train = paired_split.train_rows
    heldout = np.setdiff1d(np.arange(paired_split.n_cells), train)
    changed = with_counts(paired_split, heldout, lambda x: x[::-1] * 3 + 1)
    assert (changed.rna != paired_split.rna).nnz > 0 and (changed.hic != paired_split.hic).nnz > 0
    out = tmp_path / "changed"
    assert fit(changed, out) is True
    assert_same_model(split_reference, out)
    assert_same_metrics(split_reference, out)
    a, b = ad.read_h5ad(split_reference / "embeddings.h5ad"), ad.read_h5ad(out / "embeddings.h5ad")
    for key in ("X_rna", "X_hic"):
        np.testing.assert_array_equal(a.obsm[key][train], b.obsm[key][train])
        assert not np.array_equal(a.obsm[key][heldout], b.obsm[key][heldout])

    one = with_counts(paired_split, train[:1], lambda x: x * 2 + 1)
    Trainer(one, MODEL, TRAIN, tmp_path / "one").fit()
    sa, sb = load_model(split_reference)["state_dict"], load_model(tmp_path / "one")["state_dict"]
    assert any(not torch.equal(sa[k], sb[k]) for k in sa)


def test_resume_with_heldout_cells(paired_split, split_reference, tmp_path):
    out = tmp_path / "run"
    assert fit(paired_split, out, stop_after=4) is False
    assert fit(paired_split, out) is True
    assert_same_model(split_reference, out)
    assert_same_metrics(split_reference, out)


def test_no_heldout_cells_train_as_without_a_split(paired, reference, tmp_path):
    """A split that holds out none (evaluate.holdout = 0): the run of old data folders."""
    alltrain = dataclasses.replace(paired, obs=paired.obs.assign(split="train"))
    assert Trainer(alltrain, MODEL, TRAIN, tmp_path / "x").run_key() == Trainer(paired, MODEL, TRAIN, tmp_path / "y").run_key()
    assert fit(alltrain, tmp_path / "run") is True
    assert_same_model(reference, tmp_path / "run")
    assert_same_metrics(reference, tmp_path / "run")


def test_split_must_match_the_data_files(split_dir, split_file, data_dir, tmp_path, caplog):
    split = read_split(split_file)
    flipped = split.copy()
    flipped.iloc[0] = "heldout" if split.iloc[0] == "train" else "train"
    write_split(tmp_path / "other.tsv", flipped)
    with pytest.raises(InputError, match="another split"):
        load_paired(split_dir, split=tmp_path / "other.tsv")
    # a folder built without a split takes the file's
    with caplog.at_level(logging.WARNING, logger="ampflow.train.data"):
        old = load_paired(data_dir, split=split_file)
    assert "built without a split" in caplog.text
    assert list(old.obs.index[old.train_rows]) == list(split.index[split == "train"])
    assert len(load_paired(data_dir).train_rows) == 23


# ------------------------------------------------------------------ resume
@pytest.mark.parametrize(
    "stops",
    [(4,), (9,), (5, 11)],
    ids=["mid-epoch", "stage-boundary", "twice"],
)
def test_resume_in_process(paired, reference, tmp_path, caplog, stops):
    out = tmp_path / "run"
    for k in stops:
        assert fit(paired, out, stop_after=k) is False
        assert not (out / "model.pt").exists() and not (out / "embeddings.h5ad").exists()
        assert len(metrics(out / "checkpoints", "metrics.partial.jsonl")) == k  # rows past the last checkpoint too
    last = stops[-1] - stops[-1] % TRAIN.checkpoint_every
    with caplog.at_level(logging.INFO, logger="ampflow.train.trainer"):
        assert fit(paired, out) is True
    assert f"step-{last:08d}.pt (step {last}," in caplog.text
    assert_same_model(reference, out)
    assert_same_embeddings(reference, out)
    assert_same_metrics(reference, out)
    assert no_temporaries(out) == []


def test_finished_run_trains_again_from_step_0(paired, reference, tmp_path, caplog):
    """A finished run closes its checkpoints (finished.json): the same folder run again,
    its outputs deleted as Snakemake's --forcerun deletes them, trains from step 0 (not
    from the last checkpoint) and ends bit-identical."""
    out = tmp_path / "run"
    assert fit(paired, out) is True
    ck = out / "checkpoints"
    closed = json.loads((ck / checkpoint.FINISHED).read_text())
    assert closed["steps"] == N_STEPS and len(checkpoint.list_checkpoints(ck)) == TRAIN.keep_checkpoints
    for name in ("model.pt", "embeddings.h5ad", "metrics.jsonl", "config.yaml"):
        (out / name).unlink()
    with caplog.at_level(logging.INFO, logger="ampflow.train"):
        done, seen = watched_fit(paired, out)
    assert done is True
    assert seen == [list(range(1, k + 1)) for k in range(N_STEPS)]  # every step trained, from the first
    assert "training from step 0" in caplog.text and "finished run" in caplog.text
    assert "resumed from" not in caplog.text
    assert_same_model(reference, out)
    assert_same_embeddings(reference, out)
    assert_same_metrics(reference, out)
    assert json.loads((ck / checkpoint.FINISHED).read_text())["steps"] == N_STEPS


def test_killed_after_outputs_before_closing_resumes(paired, reference, tmp_path, caplog):
    """Without finished.json (a kill between the last output and the marker) the
    checkpoints are an unfinished attempt's: the next run resumes from the newest."""
    out = tmp_path / "run"
    assert fit(paired, out) is True
    (out / "checkpoints" / checkpoint.FINISHED).unlink()
    (out / "model.pt").unlink()
    with caplog.at_level(logging.INFO, logger="ampflow.train.trainer"):
        assert fit(paired, out) is True  # nothing left to train
    assert f"step-{N_STEPS:08d}.pt (step {N_STEPS}," in caplog.text
    assert_same_model(reference, out)
    assert_same_metrics(reference, out)


def corrupt(path: Path, how: str) -> None:
    raw = path.read_bytes()
    if how == "garbage":
        path.write_bytes(np.random.default_rng(0).bytes(len(raw)))
    elif how == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    else:
        path.write_bytes(b"")


@pytest.mark.parametrize("how", ["garbage", "truncated", "empty"])
def test_corrupt_newest_checkpoint_falls_back(paired, reference, tmp_path, caplog, how):
    out = tmp_path / "run"
    assert fit(paired, out, stop_after=8) is False
    ckpts = checkpoint.list_checkpoints(out / "checkpoints")
    assert [p.name for p in ckpts] == ["step-00000006.pt", "step-00000003.pt"]
    corrupt(ckpts[0], how)
    with caplog.at_level(logging.INFO, logger="ampflow.train"):
        assert fit(paired, out) is True
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "ampflow.train.checkpoint"]
    assert len(warnings) == 1 and "step-00000006.pt" in warnings[0].getMessage()
    assert "step-00000003.pt (step 3," in caplog.text
    assert_same_model(reference, out)
    assert_same_embeddings(reference, out)
    assert_same_metrics(reference, out)


def test_all_checkpoints_corrupt_starts_over(paired, reference, tmp_path, caplog):
    out = tmp_path / "run"
    assert fit(paired, out, stop_after=7) is False
    for p in checkpoint.list_checkpoints(out / "checkpoints"):
        corrupt(p, "garbage")
    with caplog.at_level(logging.WARNING, logger="ampflow.train.checkpoint"):
        assert fit(paired, out) is True
    assert len([r for r in caplog.records if r.name == "ampflow.train.checkpoint"]) == 2
    assert_same_model(reference, out)
    assert_same_metrics(reference, out)


def test_leftovers_of_a_crash(paired, reference, tmp_path):
    """A metrics line cut short and a half-written checkpoint under its temporary name."""
    out = tmp_path / "run"
    assert fit(paired, out, stop_after=7) is False
    ck = out / "checkpoints"
    with open(ck / "metrics.partial.jsonl", "a") as fh:
        fh.write('{"cells_per_s": 1.0, "epoch": 2, "lo')
    stale = ck / ".tmp-999999-step-00000009.pt"
    stale.write_bytes(b"\0" * 1000)
    assert fit(paired, out) is True
    assert not stale.exists()
    assert no_temporaries(out) == []
    assert_same_model(reference, out)
    assert_same_metrics(reference, out)


# ------------------------------------------------------------------ kill -9
def train_command(data_dir: Path, out: Path, settings: dict) -> list[str]:
    exe = Path(sys.executable).parent / "ampflow"
    return [
        str(exe), "train", "--data", str(data_dir), "--out", str(out), "--name", "killtest",
        "--model", json.dumps(MODEL.to_dict()), "--train", json.dumps(settings),
    ]  # fmt: skip


def complete_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


@pytest.mark.slow
def test_resume_after_sigkill(data_dir, tmp_path):
    """``ampflow train`` killed with SIGKILL after its first checkpoint, then run again,
    ends bit-identical to an uninterrupted run, with every step in metrics.jsonl once."""
    # ~1500 steps: the kill lands after the first checkpoint (step 25), long before the end
    settings = {**SETTINGS, "checkpoint_every": 25, "pretrain": {"epochs": 350}, "finetune": {"epochs": 150}}
    n_steps = 500 * STEPS_PER_EPOCH
    killed, uninterrupted = tmp_path / "killed", tmp_path / "uninterrupted"
    ref_log = open(tmp_path / "uninterrupted.log", "wb")
    ref = subprocess.Popen(train_command(data_dir, uninterrupted, settings), stdout=ref_log, stderr=subprocess.STDOUT)
    try:
        with open(tmp_path / "killed.log", "wb") as log_fh:
            proc = subprocess.Popen(train_command(data_dir, killed, settings), stdout=log_fh, stderr=subprocess.STDOUT)
            try:
                deadline = time.monotonic() + 300
                while True:
                    assert proc.poll() is None, "training ended before it could be killed:\n" + (tmp_path / "killed.log").read_text()
                    ckpts = checkpoint.list_checkpoints(killed / "checkpoints")
                    newest = int(checkpoint.NAME.match(ckpts[0].name).group(1)) if ckpts else None
                    # kill once some steps past the newest checkpoint are in the metrics
                    if newest and complete_lines(killed / "checkpoints" / "metrics.partial.jsonl") >= newest + 2:
                        break
                    assert time.monotonic() < deadline, "no checkpoint within 300 s"
                    time.sleep(0.01)
                os.kill(proc.pid, signal.SIGKILL)
            finally:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
        log_text = (tmp_path / "killed.log").read_text()
        assert proc.returncode == -signal.SIGKILL, f"the run was not killed (exit {proc.returncode}):\n{log_text}"
        assert not (killed / "model.pt").exists(), "the run finished before the kill; make it longer"
        done = complete_lines(killed / "checkpoints" / "metrics.partial.jsonl")
        assert newest < done < n_steps

        again = subprocess.run(train_command(data_dir, killed, settings), capture_output=True, text=True, timeout=600)
        assert again.returncode == 0, again.stderr
        assert "resumed from" in again.stderr and f"{n_steps} steps" in again.stderr
    finally:
        if ref.poll() is None:
            ref.wait(timeout=600)
        ref_log.close()
    assert ref.returncode == 0, (tmp_path / "uninterrupted.log").read_text()
    assert "resumed from" not in (tmp_path / "uninterrupted.log").read_text()

    assert_same_model(uninterrupted, killed)
    assert_same_embeddings(uninterrupted, killed)
    rows = metrics(killed)
    assert [r["step"] for r in rows] == list(range(1, n_steps + 1))
    assert_same_metrics(uninterrupted, killed)
    assert no_temporaries(killed) == []


def test_cli_retrains_a_finished_run_from_step_0(data_dir, tmp_path):
    """``ampflow train`` on a folder whose training finished, outputs removed (what
    ``snakemake --forcerun train`` does): the log counts steps from the first, says it
    trains from step 0, resumes from nothing, and the model equals the first run's."""
    out = tmp_path / "run"
    first = subprocess.run(train_command(data_dir, out, SETTINGS), capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    model_a, metrics_a = (out / "model.pt").read_bytes(), metrics(out)
    for name in ("model.pt", "embeddings.h5ad", "metrics.jsonl", "config.yaml"):
        (out / name).unlink()
    again = subprocess.run(train_command(data_dir, out, SETTINGS), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert "resumed from" not in again.stderr and "training from step 0" in again.stderr, again.stderr
    assert f"trained {N_STEPS}/{N_STEPS} steps" in again.stderr and f"training done: {N_STEPS} steps" in again.stderr
    b = torch.load(out / "model.pt", map_location="cpu", weights_only=True)["state_dict"]
    a = torch.load(io.BytesIO(model_a), map_location="cpu", weights_only=True)["state_dict"]
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["loss"] for r in metrics(out)] == [r["loss"] for r in metrics_a]
    assert [r["step"] for r in metrics(out)] == list(range(1, N_STEPS + 1))


# ------------------------------------------------------------------ real formats
@pytest.mark.slow
def test_train_on_real_rna_matrix(shared_data, tmp_path):
    """The HiRES brain RNA matrix (fractional counts, real gene symbols and mm10
    annotation) for 12 cells, paired with synthetic Hi-C, through prepare and training."""
    rna_src = shared_data / "hires" / "GSE223917_HiRES_brain.rna.umicount.tsv.gz"
    bed_src = shared_data / "annotation" / "mm10_ensembl96_genes.bed.gz"
    for p in (rna_src, bed_src):
        if not p.exists():
            pytest.skip(f"{p} not present")
    n = 12
    paths = write_demo(tmp_path / "demo", n_cells=n, seed=0, n_genes=50)
    cells = pd.read_csv(paths["sheet"], sep="\t")["cell_id"].tolist()

    real = pd.read_csv(rna_src, sep="\t", index_col=0, usecols=range(n + 1))
    assert real.shape[1] == n
    real.columns = cells
    real.index.name = "gene"
    with gzip.open(paths["rna"], "wt") as fh:  # replaces the demo's matrix
        real.to_csv(fh, sep="\t", float_format="%g")

    sizes = read_chromsizes(paths["chromsizes"])
    with gzip.open(bed_src, "rt") as fh:
        bed = pd.read_csv(fh, sep="\t", comment="#", header=None, usecols=range(6))
    bed = bed[bed[0].isin(list(sizes)) & (bed[2] <= bed[0].map(sizes))]
    assert len(bed) > 1000
    genes = tmp_path / "genes.bed"
    bed.to_csv(genes, sep="\t", header=False, index=False)

    data = prepare(paths, tmp_path / "work", genes=genes)
    counts = ad.read_h5ad(tmp_path / "work" / "rna" / "counts.h5ad")
    rounding = counts.uns["ampflow"]["rounding"]
    assert rounding["fractional_entries"] > 0 and rounding["total_before"] != rounding["total_after"]
    assert np.array_equal(counts.X.data, np.round(counts.X.data))
    rna = ad.read_h5ad(data / "rna.h5ad")
    assert rna.n_obs == n and rna.n_vars > 50
    assert rna.uns["ampflow"]["rounding"]["fractional_entries"] == rounding["fractional_entries"]
    assert set(rna.var["chrom"]) <= set(sizes)

    out = tmp_path / "train"
    train = {"pretrain": {"epochs": 2}, "finetune": {"epochs": 1}, "early_stopping": {"patience": 0}, "batch_size": 4, "device": "cpu"}
    assert main(["train", "--data", str(data), "--out", str(out), "--train", json.dumps(train)]) == 0
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 3 * 3 + 1))
    assert all(np.isfinite(r["loss"]["total"]) for r in rows)
    emb = ad.read_h5ad(out / "embeddings.h5ad")
    assert emb.obsm["X_joint"].shape == (n, ModelConfig().latent_dim + ModelConfig().private)
    assert np.isfinite(emb.obsm["X_joint"]).all()


class _Ticks:
    """``time`` for the trainer module with a ``monotonic`` that advances one second per
    call (the trainer reads it at the start, at each multiple of ``checkpoint_every`` and
    after each checkpoint)."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        self.now += 1.0
        return self.now

    def __getattr__(self, name):
        return getattr(time, name)


def test_checkpoints_wait_checkpoint_seconds_and_resume_the_same_model(paired, reference, tmp_path, monkeypatch, caplog):
    """``train.checkpoint_seconds``: a checkpoint is written at a multiple of
    ``checkpoint_every`` only once that many seconds have passed since the last one, so
    on a fake clock only some multiples get one; where they fall does not change the
    model: killed after step 11 and resumed from the last one, the run equals the
    uninterrupted reference (checkpoints at every multiple) bit for bit."""
    import ampflow.train.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "time", _Ticks())
    saved, real_save = [], checkpoint.save

    def save(folder, step, payload, keep):
        saved.append(step)
        return real_save(folder, step, payload, keep)

    monkeypatch.setattr(checkpoint, "save", save)
    cfg = dataclasses.replace(TRAIN, checkpoint_seconds=2.5)
    out = tmp_path / "run"
    assert StoppingTrainer(paired, MODEL, cfg, out, stop_after=11).fit() is False
    multiples = [k for k in range(1, 12) if k % TRAIN.checkpoint_every == 0]
    assert saved and set(saved) < set(multiples), (saved, multiples)  # some multiples, not all
    last = saved[-1]
    with caplog.at_level(logging.INFO, logger="ampflow.train.trainer"):
        assert StoppingTrainer(paired, MODEL, cfg, out).fit() is True
    assert f"step-{last:08d}.pt (step {last}," in caplog.text  # resumed from the last one written
    assert_same_model(reference, out)
    assert_same_embeddings(reference, out)
    assert_same_metrics(reference, out)


def test_checkpoint_seconds_auto_waits_on_a_gpu_only():
    """``auto``: 30 s on CUDA, where 50 steps take a fraction of a second; none on CPU."""
    from ampflow.contract.config import GPU_CHECKPOINT_SECONDS

    auto = TrainConfig()
    assert auto.checkpoint_seconds == "auto"
    assert auto.checkpoint_interval("cuda") == GPU_CHECKPOINT_SECONDS == 30.0
    assert auto.checkpoint_interval("cpu") == 0.0
    assert TrainConfig(checkpoint_seconds=5).checkpoint_interval("cpu") == 5.0
    for bad in (-1, True, "soon", float("nan")):
        with pytest.raises(InputError, match="train.checkpoint_seconds"):
            TrainConfig(checkpoint_seconds=bad)


def test_checkpoints_of_another_run_are_not_resumed(paired, reference, tmp_path, caplog):
    """After the settings change, old checkpoints are deleted and training starts fresh."""
    out = tmp_path / "run"
    other = dataclasses.replace(MODEL, hidden_dim=16)
    StoppingTrainer(paired, other, TRAIN, out, stop_after=7).fit()
    assert checkpoint.list_checkpoints(out / "checkpoints")
    with caplog.at_level(logging.WARNING):
        fit(paired, out)
    assert "from another run" in caplog.text
    assert_same_model(out, reference)
    assert_same_metrics(out, reference)


def test_deterministic_turns_on_torchs_switch_and_keeps_a_users_cublas_setting():
    """``train.deterministic``: torch's deterministic algorithms (warn-only) on CPU and
    CUDA, and on CUDA the cuBLAS workspace its documentation requires, unless the user set
    one; off, the switch is off and the log says why CUDA runs may differ. Referee: torch's
    own switches."""
    from ampflow.train.device import DETERMINISTIC_CUBLAS, use_deterministic

    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        env: dict = {}
        assert "differ" in use_deterministic(False, True, env)
        assert env == {} and not torch.are_deterministic_algorithms_enabled()
        why = use_deterministic(True, True, env)
        assert env == {"CUBLAS_WORKSPACE_CONFIG": DETERMINISTIC_CUBLAS} == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert ":4096:8" in why
        users = {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}
        assert ":16:8" in use_deterministic(True, True, users) and users == {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}
        # CPU: the switch alone, no cuBLAS setting
        cpu: dict = {}
        assert "thread count" in use_deterministic(False, False, cpu) and not torch.are_deterministic_algorithms_enabled()
        assert "thread count" in use_deterministic(True, False, cpu) and torch.are_deterministic_algorithms_enabled()
        assert cpu == {}
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])


def test_train_deterministic_must_be_a_boolean():
    with pytest.raises(InputError, match=r"train\.deterministic.*'yes'"):
        TrainConfig.from_dict({"deterministic": "yes"})
    assert TrainConfig().deterministic is True and TrainConfig.from_dict({"deterministic": False}).deterministic is False


def test_clipping_reaches_the_trainers_step_and_its_log(paired, tmp_path, caplog):
    """``train.clip_grad_norm`` above every norm changes nothing: the model of a run with
    it equals one without clipping, bit for bit. Below every norm it scales every step:
    another model, each row's norm (read before clipping; the first step's equals the
    unclipped run's) above it, and the log says on how many steps."""
    runs = {}
    for name, clip in (("off", None), ("never", 1e9), ("always", 1e-4)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ampflow.train.trainer"):
            Trainer(paired, MODEL, TrainConfig.from_dict({**SETTINGS, "clip_grad_norm": clip}), tmp_path / name).fit()
        runs[name] = (load_model(tmp_path / name)["state_dict"], metrics(tmp_path / name), caplog.text)
    off, never, always = runs["off"], runs["never"], runs["always"]
    assert all(torch.equal(off[0][k], never[0][k]) for k in off[0])
    assert "grad_norm" not in off[1][0] and all(r["grad_norm"] < 1e9 for r in never[1])
    assert any(not torch.equal(off[0][k], always[0][k]) for k in off[0])
    assert all(r["grad_norm"] > 1e-4 for r in always[1]) and len(always[1]) == N_STEPS
    assert always[1][0]["grad_norm"] == never[1][0]["grad_norm"]
    assert f"pretrain: the gradient norm was above train.clip_grad_norm 0.0001 on {3 * STEPS_PER_EPOCH} of {3 * STEPS_PER_EPOCH} step(s)" in always[2]
    assert "clip_grad_norm" not in off[2]


@pytest.mark.parametrize("stops", [(4,), (7, 11)], ids=["mid-epoch", "twice-across-stages"])
def test_zscore_clipping_scales_spikes_and_resumes_as_the_uninterrupted_run(paired, tmp_path, monkeypatch, caplog, stops):
    """``train.clip_grad_norm: zscore`` (with a warm-up of 3 steps and a z of 0.5 here, so
    that it bites within the test's 15 steps): rows carry the bound where a step was
    scaled, each below that step's norm, none in a stage's first 3 steps (each stage warms
    up anew), the log counts them; a run killed and resumed (the bound's state read back
    from the checkpoint) ends with the uninterrupted run's model and rows, bit for bit."""
    from ampflow.parallel import clip

    monkeypatch.setattr(clip, "ZSCORE_WARMUP", 3)
    monkeypatch.setattr(clip, "ZSCORE_Z", 0.5)
    # the Hi-C KL weight fixed at 20, the default this test was written under: its norms
    # then rise past z 0.5 on the run's last step (70.8 against about 50 before it); at 5
    # none of the 15 steps does, and the test would have no spike to scale
    weights = {"weights": {"hic_kl": 20.0}}
    stages = {"pretrain": {**SETTINGS["pretrain"], **weights}, "finetune": {**SETTINGS["finetune"], **weights}}
    cfg = TrainConfig.from_dict({**SETTINGS, **stages, "clip_grad_norm": "zscore"})
    whole = tmp_path / "whole"
    with caplog.at_level(logging.INFO, logger="ampflow.train.trainer"):
        assert Trainer(paired, MODEL, cfg, whole).fit() is True
    rows = metrics(whole)
    scaled = [r for r in rows if r["grad_bound"] is not None]
    assert scaled and all(r["grad_bound"] < r["grad_norm"] for r in scaled)
    for stage in ("pretrain", "finetune"):
        own = [r for r in rows if r["stage"] == stage]
        assert [r["grad_bound"] for r in own[:3]] == [None] * 3
        n = sum(r["grad_bound"] is not None for r in own)
        assert f"{stage}: the gradient norm was a spike (z-score above 0.5 against its moving mean and spread) on {n} of {len(own)} step(s)" in caplog.text
    out = tmp_path / "run"
    for k in stops:
        assert StoppingTrainer(paired, MODEL, cfg, out, stop_after=k).fit() is False
    assert StoppingTrainer(paired, MODEL, cfg, out).fit() is True
    assert_same_model(whole, out)
    resumed = metrics(out)
    assert [(r["grad_norm"], r["grad_bound"]) for r in resumed] == [(r["grad_norm"], r["grad_bound"]) for r in rows]


@pytest.mark.parametrize("bad", [-0.1, float("inf"), float("nan"), True, "0.1", None])
def test_bad_weight_decay_names_the_key_and_value(bad):
    with pytest.raises(InputError, match="train.weight_decay") as err:
        TrainConfig(weight_decay=bad)
    assert bad is None or f"(value: {bad!r})" in str(err.value)


def test_weight_decay_is_decoupled_from_the_gradient(paired, tmp_path):
    """``train.weight_decay``: after the first step, from the same start and the same
    batch, the parameters differ from a run without decay by exactly ``-lr x
    weight_decay x`` their starting value. Referee: that closed form of AdamW's update,
    computed here from the starting parameters. An L2 term added to the gradient (Adam's
    own ``weight_decay``) would pass through Adam's normalisation and miss it by orders of
    magnitude. With 0 the optimizer is the plain Adam of every run before."""
    lr, decay = TRAIN.pretrain.lr, 0.5
    runs = {}
    for name, w in (("plain", 0.0), ("decayed", decay)):
        trainer = StoppingTrainer(paired, MODEL, TrainConfig.from_dict({**SETTINGS, "weight_decay": w}), tmp_path / name, stop_after=1)
        start = {k: p.detach().clone() for k, p in trainer.model.named_parameters()}
        assert trainer.fit() is False
        runs[name] = (trainer, start)
    plain, decayed = runs["plain"][0], runs["decayed"][0]
    assert type(plain.optimizer) is torch.optim.Adam and type(decayed.optimizer) is torch.optim.AdamW
    start = runs["plain"][1]
    assert all(torch.equal(start[k], runs["decayed"][1][k]) for k in start)
    moved = 0
    for (k, a), (_, b) in zip(plain.model.named_parameters(), decayed.model.named_parameters()):
        if a.grad is None and torch.equal(a, start[k]):
            continue  # not in the step (AdamW leaves a parameter without a gradient alone)
        want = -lr * decay * start[k]
        torch.testing.assert_close(b - a, want, rtol=1e-4, atol=1e-6, msg=k)
        moved += 1
    assert moved > 10


def resumed_as_uninterrupted(paired, reference, tmp_path, setting: dict) -> Path:
    """A run with ``setting`` killed mid-epoch and resumed ends with the uninterrupted
    run's model and rows, bit for bit, and is another model than the reference run
    without it; returns the uninterrupted run's folder."""
    cfg = TrainConfig.from_dict({**SETTINGS, **setting})
    whole, out = tmp_path / "whole", tmp_path / "run"
    assert Trainer(paired, MODEL, cfg, whole).fit() is True
    assert StoppingTrainer(paired, MODEL, cfg, out, stop_after=4).fit() is False
    assert StoppingTrainer(paired, MODEL, cfg, out).fit() is True
    assert_same_model(whole, out)
    assert_same_metrics(whole, out)
    a, b = load_model(reference)["state_dict"], load_model(whole)["state_dict"]
    assert any(not torch.equal(a[k], b[k]) for k in a)
    return whole


def test_hic_thinning_resumes_as_the_uninterrupted_run(paired, reference, tmp_path):
    """``train.hic_keep_min``: killed and resumed (each cell's draws keyed by the step
    read back from the checkpoint) as the uninterrupted run, another model than without
    thinning, and its first step's Hi-C reconstruction term is that of thinned counts
    (fewer contacts to explain: a lower per-element negative log-likelihood than the
    reference's first step, from the same start, where the RNA's term is the reference's
    exactly)."""
    whole = resumed_as_uninterrupted(paired, reference, tmp_path, {"hic_keep_min": 0.2, "hic_thinned": "both"})
    first, plain = metrics(whole)[0]["loss"], metrics(reference)[0]["loss"]
    assert first["hic_nll"] < plain["hic_nll"] and first["rna_nll"] == plain["rna_nll"]  # the RNA read as it is


def test_a_denoising_encoder_resumes_as_the_uninterrupted_run(paired, reference, tmp_path):
    """``train.hic_thinned: encoder``: killed and resumed (the encoder's thinned copy
    drawn with the same keys) as the uninterrupted run; another model than the run whose
    likelihood reads the thinned counts too, though both draw the same copies."""
    whole = resumed_as_uninterrupted(paired, reference, tmp_path / "encoder", {"hic_keep_min": 0.2, "hic_thinned": "encoder"})
    both = tmp_path / "both"
    assert Trainer(paired, MODEL, TrainConfig.from_dict({**SETTINGS, "hic_keep_min": 0.2, "hic_thinned": "both"}), both).fit() is True
    a, b = load_model(both)["state_dict"], load_model(whole)["state_dict"]
    assert any(not torch.equal(a[k], b[k]) for k in a)
    assert metrics(whole)[0]["loss"]["hic_nll"] != metrics(both)[0]["loss"]["hic_nll"]


def test_weight_decay_resumes_as_the_uninterrupted_run(paired, reference, tmp_path):
    """``train.weight_decay``: killed and resumed (AdamW's state and its decay read back
    from the checkpoint) as the uninterrupted run, another model than without decay."""
    resumed_as_uninterrupted(paired, reference, tmp_path, {"weight_decay": 0.5})
