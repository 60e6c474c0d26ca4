"""The workflow on a real SLURM (one node on this machine, tests/slurm/start_cluster.sh):
``snakemake --profile profiles/slurm-gpu`` on a 40-cell demo.

* the whole workflow exits 0, every job went through sbatch and slurmdbd recorded it
  COMPLETED, GPU rules on the GPU partition, training sized by its plan;
* the Snakemake head SIGKILLed at three moments (binning, training, evaluation/reports),
  each time followed by README.md's recovery (cancel this folder's jobs, ``--unlock``, the
  same command), ends with outputs identical to the uninterrupted run;
* a corrupt pairs file stops the run with one error line naming it, nothing half-written;
* a training job of one node and two tasks starts exactly one world.

What one host cannot show (sbatch lines of a 2-node job) stays with the stand-in
commands of test_profiles.py.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import anndata as ad
import cooler
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import torch
import yaml
from conftest import workflow_copy
from extract_helpers import random_fasta
from slurm_cluster import accounted_jobs, cancel_own_jobs, fit_profile, own_jobs, sacct_steps, scontrol_job

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

BIN = Path(sys.executable).parent
CONFIGS = ("500kb_s10", "250kb_s12")
RESOLUTIONS = ("500kb", "250kb")
# quick training as in test_workflow (float64 so that dp/tp runs are comparable), a
# checkpoint after every step so that a kill during training leaves one to resume from,
# and the extraction's FASTA files inside the folder (the demo's are optional, beside
# the repository)
TEST_CONFIG = """
prepare: {block_cells: 20}
cluster: {gpu_partition: gpu, gpus_per_node: 2, cpus_per_gpu: 1, mem_mb_per_gpu: 2000}
train: {pretrain: {epochs: 6}, finetune: {epochs: 1}, early_stopping: {patience: 0}, dtype: float64, checkpoint_every: 1, device: auto}
amp: {device_memory_gb: 0.1220703125}
extract:
  inputs:
    proteins: {fasta: prot.fa, models: [esm2_tiny]}
    viral_dna: {fasta: dna.fa, models: [dnabert_s_tiny]}
"""
CONFIG_ARGS = ["--configfile", "config/demo.yaml", "config/slurm.yaml"]
# fast polling for the test; everything else from the profile
POLL = ["--latency-wait", "1", "--seconds-between-status-checks", "1", "--slurm-init-seconds-before-status-checks", "1"]
RUN_TIMEOUT = 600
# what workflow/Snakefile runs in the Snakemake process itself (its `localrules`)
LOCAL_RULES = {"qc_cells", "split_cells", "profile", "diagnose", "report_plan", "report_memory", "report_training", "report_summary"}


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    e.pop("SNAKEMAKE_PROFILE", None)
    e["PATH"] = f"{BIN}{os.pathsep}{os.environ['PATH']}"
    return e


def command(*extra: str) -> list[str]:
    return [str(BIN / "snakemake"), "--profile", "profiles/slurm-gpu", *CONFIG_ARGS, *POLL, *extra]


def snakemake(root: Path, *extra: str, timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(command(*extra), cwd=root, env=env(), capture_output=True, text=True, timeout=timeout)


def now() -> str:
    return datetime.now().strftime("%Y-%m-%dT%H:%M:%S")


@pytest.fixture(scope="module")
def template(tmp_path_factory, slurm_cluster) -> Path:
    """A workflow folder with the demo data (40 cells), two FASTA files and the profile
    fitted to the cluster, copied by each test."""
    root = workflow_copy(tmp_path_factory.mktemp("slurm") / "template")
    (root / "config/slurm.yaml").write_text(TEST_CONFIG)
    fit_profile(root, slurm_cluster)
    # a site whose profile gives training jobs a task (and a core) per process (here 2):
    # the launcher must still start exactly one world in such an allocation (test d)
    path = root / "profiles/slurm-gpu/profile.yaml"
    prof = yaml.safe_load(path.read_text())
    prof.setdefault("set-resources", {}).setdefault("train", {}).update(tasks=2, cpus_per_task=1)
    path.write_text(yaml.safe_dump(prof, sort_keys=False))
    random_fasta(root / "prot.fa", "esm2", 8, lengths=(20, 200))
    random_fasta(root / "dna.fa", "dnabert_s", 8, lengths=(50, 300))
    r = subprocess.run([str(BIN / "ampflow"), "demo-data", "resources/demo", "--cells", "40", "--seed", "0"],
                       cwd=root, env=env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    return root


def copy_of(template: Path, name: str) -> Path:
    dest = template.parent / name
    subprocess.run(["cp", "-a", str(template), str(dest)], check=True)
    return dest


@pytest.fixture(scope="module")
def reference(template):
    """The uninterrupted run: (folder, completed process, start time for sacct)."""
    root = copy_of(template, "reference")
    since = now()
    r = snakemake(root)
    return root, r, since


# ------------------------------------------------------------------ (a) the whole workflow
def test_whole_workflow_through_sbatch(reference):
    root, r, since = reference
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    res = root / "results/demo"
    for rel in ("binned/500kb.scool", "binned/250kb.scool", "figures/summary.html",
                "extract/proteins.esm2_tiny.h5ad", "extract/viral_dna.dnabert_s_tiny.h5ad",
                *(f"train/{c}/model.pt" for c in CONFIGS), *(f"eval/{c}/scores.json" for c in CONFIGS)):  # fmt: skip
        assert (res / rel).exists(), rel
    # every job Snakemake ran was a SLURM job that slurmdbd recorded as COMPLETED
    submitted = [ln for ln in r.stderr.splitlines() if "has been submitted with SLURM jobid" in ln]
    jobs = accounted_jobs(root, since)
    ids = {ln.split("SLURM jobid ")[1].split()[0] for ln in submitted}
    assert ids and ids == {j["id"] for j in jobs}, (sorted(ids), jobs)
    assert {j["state"] for j in jobs} == {"COMPLETED"}, [j for j in jobs if j["state"] != "COMPLETED"]
    rules = {j["rule"] for j in jobs}
    assert {"bin_block", "strata", "devices", "train", "extract", "evaluate", "report_qc"} <= rules, rules
    # the light rules (workflow/Snakefile's localrules) ran in the head, never through
    # sbatch, and wrote their outputs: Snakemake's own record says so ("localrule X:")
    assert not rules & LOCAL_RULES, rules & LOCAL_RULES
    ran_here = {ln.split()[1].rstrip(":") for ln in r.stdout.splitlines() + r.stderr.splitlines() if ln.startswith("localrule ")}
    assert LOCAL_RULES <= ran_here, LOCAL_RULES - ran_here
    for rel in ("qc/split.tsv", "figures/summary.tsv", *(f"amp/{c}/plan.json" for c in CONFIGS)):
        assert (res / rel).is_file(), rel
    # CPU rules on the CPU partition, GPU rules (with GPUs) on the GPU partition
    by_rule = {}
    for j in jobs:
        by_rule.setdefault(j["rule"], []).append(j)
    for j in by_rule["bin_block"] + by_rule["strata"]:
        assert j["partition"] == "cpu" and "gres/gpu" not in j["tres"], j
    for rule in ("devices", "extract"):
        for j in by_rule[rule]:
            assert j["partition"] == "gpu", j
            assert int(j["tres"].get("gres/gpu", 0)) >= 1, j


def test_train_allocation_from_plan(reference):
    """Each training job holds what its plan's mesh uses (dp x tp processes): on a GPU
    plan that many GPUs on the GPU partition; on a CPU plan (this torch has no CUDA, so
    the devices job found no usable GPU among the fake ones) no GPU, on the CPU
    partition, and at least a core per process."""
    root, r, since = reference
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    train = {j["comment"].split("_wildcards_")[1]: j for j in accounted_jobs(root, since) if j["rule"] == "train"}
    assert set(train) == set(CONFIGS), train
    for cfg, job in train.items():
        plan = json.loads((root / f"results/demo/amp/{cfg}/plan.json").read_text())
        world = plan["mesh"]["dp"] * plan["mesh"]["tp"]
        if plan.get("cpu"):
            assert job["partition"] == "cpu" and "gres/gpu" not in job["tres"], (cfg, job)
            assert int(job["tres"]["cpu"]) >= world, (cfg, plan["mesh"], job)
        else:
            assert job["partition"] == "gpu", job
            assert int(job["tres"].get("gres/gpu", 0)) == world, (cfg, plan["mesh"], job)


# ------------------------------------------------- (d) one node, two tasks: one world
def test_one_node_two_tasks_one_world(reference):
    """The data-parallel configuration (dp 2) trains in a job of 1 node x 2 tasks that
    starts exactly one world of dp x tp processes: one launch in the log, every rank once
    in the metrics, and SLURM's own record of the job and its steps."""
    root, r, since = reference
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    cfg = "500kb_s10"
    plan = json.loads((root / f"results/demo/amp/{cfg}/plan.json").read_text())
    world = plan["mesh"]["dp"] * plan["mesh"]["tp"]
    assert plan["mesh"] == {"dp": 2, "tp": 1}, plan["mesh"]
    (job,) = [j for j in accounted_jobs(root, since) if j["comment"] == f"rule_train_wildcards_{cfg}"]
    info = scontrol_job(job["id"])
    steps = sacct_steps(job["id"])
    assert (info["NumNodes"], info["NumTasks"]) == ("1", "2"), (info.get("NumNodes"), info.get("NumTasks"), steps)
    assert steps[0]["nnodes"] == "1" and all(s["nnodes"] == "1" for s in steps), steps
    # the steps that ran the command (not the batch script, not the extern step): their
    # tasks each start one launcher, and all launchers together make one world
    work = [s for s in steps[1:] if not s["id"].endswith((".batch", ".extern"))]
    assert work, steps
    log = (root / f"logs/demo/train.{cfg}.log").read_text()
    launches = [ln for ln in log.splitlines() if "launching" in ln and "processes" in ln]
    assert len(launches) == 1 and f"launching {world} processes" in launches[0], (launches, steps)
    rows = [json.loads(x) for x in (root / f"results/demo/train/{cfg}/metrics.jsonl").read_text().splitlines()]
    assert rows and all(row["mesh"] == plan["mesh"] for row in rows)
    assert len(rows[0]["rank_stratum_bytes"]) == world
    assert [row["step"] for row in rows] == list(range(1, len(rows) + 1)), "each step once: one world"


# --------------------------------------------- (b) SIGKILL of the head, then recovery
def wait_for(proc: subprocess.Popen, root: Path, what: str, predicate, timeout: float = RUN_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before {what}: {tail(root)}")
        time.sleep(0.3)
    proc.kill()
    raise AssertionError(f"no {what} within {timeout:.0f} s: {tail(root)}")


def tail(root: Path) -> str:
    logs = sorted(root.glob("head.*.log"))
    return logs[-1].read_text()[-3000:] if logs else ""


def running(root: Path, *rules: str) -> bool:
    return any(j["state"] == "RUNNING" and j["rule"] in rules for j in own_jobs(root))


def running_prefix(root: Path, prefix: str) -> bool:
    return any(j["state"] == "RUNNING" and j["rule"].startswith(prefix) for j in own_jobs(root))


def recover(root: Path, n: int) -> subprocess.Popen:
    """README.md's recovery: cancel this folder's jobs, unlock, the same command again."""
    cancel_own_jobs(root)
    assert not [j for j in own_jobs(root)], own_jobs(root)
    u = subprocess.run(command("--unlock"), cwd=root, env=env(), capture_output=True, text=True, timeout=120)
    assert u.returncode == 0, u.stderr[-2000:]
    return start_head(root, n)


def start_head(root: Path, n: int) -> subprocess.Popen:
    log = open(root / f"head.{n}.log", "w")
    return subprocess.Popen(command(), cwd=root, env=env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def sigkill(proc: subprocess.Popen, root: Path) -> None:
    """SIGKILL the Snakemake process only: its SLURM jobs keep running, the folder stays locked."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert list((root / ".snakemake/locks").glob("*")), "a killed head leaves its lock"


def read_pixels(scool: Path) -> dict[str, pd.DataFrame]:
    return {c: cooler.Cooler(f"{scool}::{c}").pixels()[:] for c in cooler.fileops.list_scool_cells(str(scool))}


def assert_same_h5ad(a: Path, b: Path) -> None:
    x, y = ad.read_h5ad(a), ad.read_h5ad(b)
    assert list(x.obs_names) == list(y.obs_names) and list(x.var_names) == list(y.var_names), a
    pd.testing.assert_frame_equal(x.obs, y.obs, check_exact=True)
    pd.testing.assert_frame_equal(x.var, y.var, check_exact=True)
    X, Y = x.X, y.X
    if sp.issparse(X) or sp.issparse(Y):
        assert sp.issparse(X) and sp.issparse(Y) and X.dtype == Y.dtype and (X != Y).nnz == 0, a
    elif X is not None or Y is not None:
        assert X.dtype == Y.dtype and np.array_equal(X, Y), a
    assert set(x.obsm) == set(y.obsm), a
    for k in x.obsm:
        assert np.array_equal(np.asarray(x.obsm[k]), np.asarray(y.obsm[k])), (a, k)


def assert_same_outputs(got: Path, ref: Path) -> None:
    g, r = got / "results/demo", ref / "results/demo"
    for res in RESOLUTIONS:
        pa, pb = read_pixels(g / f"binned/{res}.scool"), read_pixels(r / f"binned/{res}.scool")
        assert list(pa) == list(pb), res
        for cell in pa:
            pd.testing.assert_frame_equal(pa[cell], pb[cell], check_exact=True, obj=f"{res} {cell}")
    for cfg in CONFIGS:
        assert_same_h5ad(g / f"data/{cfg}/hic.h5ad", r / f"data/{cfg}/hic.h5ad")
        assert json.loads((g / f"amp/{cfg}/plan.json").read_text()) == json.loads((r / f"amp/{cfg}/plan.json").read_text()), cfg
        ma = torch.load(g / f"train/{cfg}/model.pt", map_location="cpu", weights_only=False)
        mb = torch.load(r / f"train/{cfg}/model.pt", map_location="cpu", weights_only=False)
        assert ma["steps"] == mb["steps"] and list(ma["state_dict"]) == list(mb["state_dict"]), cfg
        for name, t in ma["state_dict"].items():
            u = mb["state_dict"][name]
            assert t.dtype == u.dtype and torch.equal(t, u), f"{cfg} {name}: differs from the uninterrupted run"
        assert_same_h5ad(g / f"train/{cfg}/embeddings.h5ad", r / f"train/{cfg}/embeddings.h5ad")
    for name in ("proteins.esm2_tiny", "viral_dna.dnabert_s_tiny"):
        assert_same_h5ad(g / f"extract/{name}.h5ad", r / f"extract/{name}.h5ad")


def test_head_killed_three_times_then_recovered(template, reference):
    """SIGKILL of the Snakemake head while binning, while training (after a checkpoint)
    and while evaluating or reporting; after each, README.md's recovery. The last run
    exits 0 with outputs identical to the uninterrupted run's."""
    ref, r, _ = reference
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    root = copy_of(template, "crashed")
    # the devices rule's calibration times a kernel and the plan records those timings:
    # both runs plan from the same measurements (the reference's), as a re-run would
    (root / "results/demo/amp").mkdir(parents=True)
    for name in ("devices.json", "calibration.json"):
        (root / "results/demo/amp" / name).write_bytes((ref / "results/demo/amp" / name).read_bytes())

    head = start_head(root, 0)
    wait_for(head, root, "a bin_block job running", lambda: running(root, "bin_block"))
    sigkill(head, root)
    head = recover(root, 1)

    ckpts = root / "results/demo/train"
    wait_for(head, root, "a train job running with a checkpoint written",
             lambda: running(root, "train") and any(ckpts.glob("*/checkpoints/step-*.pt")))  # fmt: skip
    sigkill(head, root)
    head = recover(root, 2)

    wait_for(head, root, "an evaluate or report job running",
             lambda: running(root, "evaluate") or running_prefix(root, "report_"))  # fmt: skip
    sigkill(head, root)
    head = recover(root, 3)

    assert head.wait(timeout=RUN_TIMEOUT) == 0, tail(root)
    assert not own_jobs(root)
    assert (root / "results/demo/amp/calibration.json").read_bytes() == (ref / "results/demo/amp/calibration.json").read_bytes()
    assert_same_outputs(root, ref)


# ------------------------------------------------------------------ (c) a corrupt input
def test_corrupt_pairs_file_stops_cleanly(template):
    """A truncated pairs.gz: the bin_block job fails (slurmdbd says FAILED), its log holds
    one error line naming the file and no traceback, the run stops non-zero with nothing
    of this folder left queued, and no half-written output remains."""
    root = copy_of(template, "corrupt")
    sheet = pd.read_csv(root / "resources/demo/cells.tsv", sep="\t")
    bad = root / sheet["pairs"].iloc[3]  # paths in the sheet are relative to the folder
    data = bad.read_bytes()
    with gzip.open(bad) as fh:
        assert fh.read(100)  # a readable gzip before
    bad.write_bytes(data[: len(data) // 2])
    since = now()
    r = snakemake(root, "results/demo/binned/500kb.scool", "--retries", "0")
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    failed = [j for j in accounted_jobs(root, since) if j["state"] == "FAILED"]
    assert [j["rule"] for j in failed] == ["bin_block"], accounted_jobs(root, since)
    logs = [p for p in (root / "logs/demo/bin_block").glob("*.log") if bad.name in p.read_text()]
    assert len(logs) == 1, [p.read_text()[-500:] for p in (root / "logs/demo/bin_block").glob("*.log")]
    text = logs[0].read_text()
    errors = [ln for ln in text.splitlines() if "error" in ln.lower()]
    assert "Traceback" not in text, text[-3000:]
    assert len(errors) == 1 and bad.name in errors[0], errors
    assert errors[0] in out, "the head shows the failed job's log"
    # nothing half-written: the failed block's folder holds no file, no scool was gathered,
    # no temporary file anywhere under results/
    block = logs[0].stem
    assert not [p for p in (root / "results/demo/binned/blocks" / block).rglob("*") if p.is_file()]
    assert not (root / "results/demo/binned/500kb.scool").exists()
    assert not [p for p in (root / "results").rglob("*") if ".tmp" in p.name]
    assert not own_jobs(root)
