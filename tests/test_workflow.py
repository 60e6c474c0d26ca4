"""The prepare workflow end to end on a tiny demo dataset, in a temp folder."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import anndata as ad
import cooler
import numpy as np
import pandas as pd
import pytest
from conftest import workflow_copy
from helpers import BIN, QUICK, job_counts, snakemake

from ampflow.train.trainer import MEASURED_STEPS

pytestmark = pytest.mark.slow

# 28 training steps (7 epochs of 4 batches of the 99 training cells; 17 of the 116
# passing cells draw held out at 0.2): the workflow is under test here, not the fit.
# float64, so that the sharded runs can be compared with one process beyond the
# rounding drift that Adam amplifies in float32 (see test_train_dist). A float64 step holds
# about twice the bytes of a float32 one, and AMP plans the dtype the run trains in. With
# these 120 cells the float64 plans predict 73.9 MiB per device for the light configuration
# at dp 2 and 128.3 MiB for the heavy one at dp 2: a budget of 0.9 x 125 MiB = 112.5 MiB
# keeps the demo's plans (light: S1, dp 2; heavy: S1 S2 S4 S5, tp 2).
QUICK_CONFIG = """
prepare: {block_cells: 50}
train: {pretrain: {epochs: 6}, finetune: {epochs: 1}, early_stopping: {patience: 0}, dtype: float64}
amp: {device_memory_gb: 0.1220703125}
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """The demo dataset (120 cells, seed 0, as `make demo`); the first run sees 118 of them (the sheet grows later)."""
    from ampflow.demo import write_demo

    root = workflow_copy(tmp_path_factory.mktemp("wf"))
    (root / "config/quick.yaml").write_text(QUICK_CONFIG)
    write_demo(root / "resources" / "demo", n_cells=120, seed=0)
    sheet = pd.read_csv(root / "resources/demo/cells.tsv", sep="\t")
    sheet.to_csv(root / "resources/demo/cells.full.tsv", sep="\t", index=False)
    sheet.iloc[:118].to_csv(root / "resources/demo/cells.tsv", sep="\t", index=False)
    r = snakemake(root, "--profile", "profiles/local")
    assert r.returncode == 0, r.stderr[-3000:]
    return root


def test_every_output_written(run_dir):
    res = run_dir / "results" / "demo"
    for rel in [
        "qc/cells.tsv",
        "binned/500kb.scool",
        "binned/250kb.scool",
        "binned/pseudobulk.mcool",
        "data/500kb_s10/hic.h5ad",
        "data/500kb_s10/rna.h5ad",
        "data/500kb_s10/graph/nodes.parquet",
        "data/500kb_s10/graph/edges.parquet",
        "data/250kb_s12/hic.h5ad",
        "amp/500kb_s10/profile.json",
        "amp/500kb_s10/plan.json",
        "amp/250kb_s12/plan.json",
        "amp/devices.json",
        "amp/calibration.json",
        "train/500kb_s10/model.pt",
        "train/500kb_s10/embeddings.h5ad",
        "train/500kb_s10/metrics.jsonl",
        "train/500kb_s10/config.yaml",
        "train/250kb_s12/model.pt",
        "eval/500kb_s10/scores.json",
        "eval/500kb_s10/umap.png",
        "eval/250kb_s12/scores.json",
    ]:
        assert (res / rel).exists(), rel
    # nothing temporary left under the results
    assert not [p for p in res.rglob(".tmp-*")]
    qc = pd.read_csv(res / "qc/cells.tsv", sep="\t", index_col="cell_id")
    for col in ["total", "cis", "trans", "dropped_unknown_chrom", "rna_umis", "rna_genes", "matched", "pass", "reason"]:
        assert col in qc.columns
    # the demo's imperfect cells are reported, not dropped silently
    assert qc.loc["cell0001", "pass"] == False  # noqa: E712 - too few contacts
    assert "contacts" in qc.loc["cell0001", "reason"]
    assert not qc.loc["orphan0001", "in_pairs"] and qc.loc["orphan0001", "in_rna"]
    assert set(cooler.fileops.list_coolers(str(res / "binned/pseudobulk.mcool"))) == {f"/resolutions/{r}" for r in (250000, 500000, 1000000, 2000000, 5000000)}


def test_demo_plans_light_and_heavy(run_dir):
    """The light configuration diagnoses to data parallelism; the heavy one to S2, S4 and
    S5, tp >= 2. Both run their attention in one block, the fastest that fits by the cost
    model calibrated by the devices rule, so S3 is raised but not taken."""
    amp = run_dir / "results/demo/amp"
    light = json.loads((amp / "500kb_s10/plan.json").read_text())
    heavy = json.loads((amp / "250kb_s12/plan.json").read_text())
    assert [s["id"] for s in light["strategies"]] == ["S1"] and light["mesh"] == {"dp": 2, "tp": 1}
    assert [s["id"] for s in heavy["strategies"]] == ["S1", "S2", "S4", "S5"] and heavy["mesh"]["tp"] >= 2
    assert light["fits"] and heavy["fits"]
    calibration = json.loads((amp / "calibration.json").read_text())
    for plan in (light, heavy):
        assert plan["chunk_size"] is None and any(r.startswith("S3 chunked_attention not taken") for r in plan["reasons"])
        assert plan["cost_model"]["constants"] == calibration["constants"] and plan["predicted_step_seconds"] > 0
    log = (run_dir / "logs/demo/train.250kb_s12.log").read_text()
    assert f"chunk {heavy['chunk_size'] or '-'}, key-first True" in log


def test_heavy_plan_trains_sharded_like_one_process(run_dir, tmp_path):
    """The heavy configuration trains under torchrun on its dp x tp mesh (tp >= 2), and
    its first 20 steps' losses equal a single-process run of the same command."""
    plan = json.loads((run_dir / "results/demo/amp/250kb_s12/plan.json").read_text())
    mesh = plan["mesh"]
    log = (run_dir / "logs/demo/train.250kb_s12.log").read_text()
    assert f"launching {mesh['dp'] * mesh['tp']} processes" in log
    rows = [json.loads(x) for x in (run_dir / "results/demo/train/250kb_s12/metrics.jsonl").read_text().splitlines()]
    assert len(rows) >= 20
    for r in rows:
        assert r["mesh"] == mesh
        if r["step"] <= MEASURED_STEPS:  # the allocator's peak is measured on the first steps
            assert len(r["rank_stratum_bytes"]) == mesh["dp"] * mesh["tp"]
    config = (run_dir / "results/demo/train/250kb_s12/config.yaml").read_text()
    import yaml

    saved = yaml.safe_load(config)
    one = tmp_path / "one"
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    cmd = [str(BIN / "ampflow"), "train", "--data", str(run_dir / "results/demo/data/250kb_s12"), "--out", str(one),
           "--model", json.dumps(saved["model"]), "--train", json.dumps(saved["train"]),
           "--plan", str(run_dir / "results/demo/amp/250kb_s12/plan.json")]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    ref = [json.loads(x) for x in (one / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(rows[:20], ref[:20], strict=True):
        for term, value in b["loss"].items():
            assert a["loss"][term] == pytest.approx(value, rel=1e-4), f"step {a['step']} {term}"


def test_pseudobulk_levels_equal_summed_cells(run_dir):
    """Aggregated zoom levels equal the training cells' own binning at that resolution
    (held-out cells stay out of the pool the graph's contact edges come from)."""
    from ampflow.io.split import read_split

    res = run_dir / "results" / "demo"
    split = read_split(res / "qc/split.tsv")
    training = list(split.index[split == "train"])
    assert len(training) < len(split)
    mcool = str(res / "binned/pseudobulk.mcool")
    for r, label in ((250000, "250kb"), (500000, "500kb")):
        total = None
        for cell in training:
            px = cooler.Cooler(f"{res}/binned/{label}.scool::/cells/{cell}").pixels()[:].set_index(["bin1_id", "bin2_id"])
            total = px["count"] if total is None else total.add(px["count"], fill_value=0)
        got = cooler.Cooler(f"{mcool}::resolutions/{r}").pixels()[:].set_index(["bin1_id", "bin2_id"])["count"]
        assert got.sort_index().astype(int).equals(total.sort_index().astype(int))


def test_strata_round_trip(run_dir):
    """Σ features of stratum k per cell == that cell's cis contacts at bin distance k."""
    res = run_dir / "results" / "demo"
    for cfg, label, n_strata in (("500kb_s10", "500kb", 10), ("250kb_s12", "250kb", 12)):
        hic = ad.read_h5ad(res / f"data/{cfg}/hic.h5ad")
        meta = hic.uns["ampflow"]
        assert meta["modality"] == "hic" and meta["prob_model"] == "HiCZINB" and meta["n_strata"] == n_strata
        strata = hic.var["stratum"].to_numpy()
        assert (np.diff(strata) >= 0).all(), "features must be stratum-major"
        assert meta["n_anchors"] == int((strata == 0).sum())
        kept = set(zip(hic.var["anchor"], strata))
        scool = str(res / f"binned/{label}.scool")
        assert len(hic.layers) == 0, "the counts are stored once, in X"
        X = hic.X.tocsr()
        for i, cell in enumerate(hic.obs_names):
            clr = cooler.Cooler(f"{scool}::/cells/{cell}")
            chrom = clr.bins()["chrom"][:].astype(str).to_numpy()
            px = clr.pixels()[:]
            b1, b2, n = px["bin1_id"].to_numpy(), px["bin2_id"].to_numpy(), px["count"].to_numpy()
            k = b2 - b1
            cis = (chrom[b1] == chrom[b2]) & (k < n_strata)
            row = X[i].toarray().ravel()
            for s in range(n_strata):
                sel = cis & (k == s)
                # restricted to kept features (anchor index == bin id: all chromosomes kept)
                expect = sum(int(c) for a, c in zip(b1[sel], n[sel]) if (a, s) in kept)
                assert row[strata == s].sum() == expect, (cell, s)


def test_feature_names_encode_strata(run_dir):
    hic = ad.read_h5ad(run_dir / "results/demo/data/500kb_s10/hic.h5ad", backed="r")
    for name, k in zip(hic.var_names[:: max(1, hic.n_vars // 50)], hic.var["stratum"][:: max(1, hic.n_vars // 50)]):
        parts = name.split(":")[1].split("-")
        assert (len(parts) == 2 and k == 0) or (len(parts) == 3 and int(parts[2]) == k)


def test_paired_files_share_cells(run_dir):
    d = run_dir / "results/demo/data/500kb_s10"
    rna = ad.read_h5ad(d / "rna.h5ad", backed="r")
    hic = ad.read_h5ad(d / "hic.h5ad", backed="r")
    assert list(rna.obs_names) == list(hic.obs_names)
    assert rna.uns["ampflow"]["prob_model"] == "NB"
    assert rna.uns["ampflow"]["rounding"]["fractional_entries"] > 0
    nodes = pd.read_parquet(d / "graph/nodes.parquet")
    edges = pd.read_parquet(d / "graph/edges.parquet")
    assert (nodes["kind"] == "gene").sum() == rna.n_vars
    assert (nodes["kind"] == "anchor").sum() == hic.uns["ampflow"]["n_anchors"]
    assert ((edges["weight"] > 0) & (edges["weight"] <= 1)).all()
    assert set(edges["sign"].unique()) <= {-1, 1}
    fwd = set(zip(edges["source"], edges["target"]))
    assert all((t, s) in fwd for s, t in fwd), "every edge in both directions"
    assert set(edges["kind"]) == {"gene_bin", "bin_bin", "self"}


def test_heldout_cells_in_the_dag(run_dir):
    """split_cells feeds rna_data, strata and train: each passing cell is held out on its
    own draw at evaluate.holdout 0.2 (a binomial share per cell type, within three standard
    deviations), every type keeps training cells, and the held-out cells are marked in
    every data file and embedding, and in no training step."""
    from ampflow.io.split import read_split
    from ampflow.prepare.qc import passing_cells, read_qc
    from ampflow.prepare.split import split_cells
    from ampflow.train.trainer import epoch_batches

    res = run_dir / "results/demo"
    qc = read_qc(res / "qc/cells.tsv")
    split = read_split(res / "qc/split.tsv")
    assert list(split.index) == passing_cells(qc)
    assert split.equals(split_cells(qc, 0.2, seed=0, label_key="cell_type")), "the rule passes the evaluate section"
    labels = qc.loc[split.index, "cell_type"]
    for label in sorted(set(labels)):
        mine = split[labels == label]
        assert (mine == "train").any(), label
        assert abs((mine == "heldout").mean() - 0.2) <= 3 * (0.2 * 0.8 / len(mine)) ** 0.5, label
    n_train = int((split == "train").sum())
    assert 0 < len(split) - n_train < len(split)
    for cfg in ("500kb_s10", "250kb_s12"):
        rna = ad.read_h5ad(res / f"data/{cfg}/rna.h5ad", backed="r")
        hic = ad.read_h5ad(res / f"data/{cfg}/hic.h5ad", backed="r")
        emb = ad.read_h5ad(res / f"train/{cfg}/embeddings.h5ad")
        for a in (rna, hic, emb):
            assert list(a.obs_names) == list(split.index) and list(a.obs["split"].astype(str)) == list(split)
        assert rna.uns["ampflow"]["hvg"]["fitted_cells"] == hic.uns["ampflow"]["filter_cells"] == n_train
        assert emb.uns["ampflow"]["trained_cells"] == n_train
        rows = [json.loads(x) for x in (res / f"train/{cfg}/metrics.jsonl").read_text().splitlines()]
        per_epoch = len(epoch_batches(n_train, 32, 0, 0, 0))
        assert len(rows) == 7 * per_epoch
        for e in range(7):  # both plans launch two processes: rows carry each dp group's cells
            assert sum(sum(r["rank_cells"]) for r in rows[e * per_epoch : (e + 1) * per_epoch]) == n_train
        assert f"({len(split) - n_train} held out)" in (run_dir / f"logs/demo/train.{cfg}.log").read_text()


def _rank_pid(rank: int, cwd: Path) -> int | None:
    """The pid of a running torchrun worker of ``ampflow train`` with this RANK, started in ``cwd``."""
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            env = (proc / "environ").read_bytes().split(b"\0")
            if Path(os.readlink(proc / "cwd")) != cwd.resolve():
                continue
        except (OSError, ValueError):
            continue
        if b"ampflow.cli" in cmd and b"train" in cmd and f"RANK={rank}".encode() in env and b"TORCHELASTIC_RUN_ID" in b" ".join(env):
            return int(proc.name)
    return None


def test_kill_one_rank_then_resume_bit_identical(run_dir, tmp_path):
    """SIGKILL rank 1 of the heavy configuration's training after a checkpoint: torchrun
    fails, Snakemake reports the failed job; the same command again resumes from the
    checkpoint and ends with the model and metrics of the uninterrupted run."""
    import shutil
    import signal
    import time

    import torch

    root = tmp_path / "wf"
    shutil.copytree(run_dir, root, symlinks=True)
    train = root / "results/demo/train/250kb_s12"
    shutil.rmtree(train)
    # a checkpoint every 2 steps (checkpoint settings do not enter the run's key)
    (root / "config/quick.yaml").write_text(QUICK_CONFIG.replace("dtype: float64}", "dtype: float64, checkpoint_every: 2}"))
    target = "results/demo/train/250kb_s12/model.pt"
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    cmd = [str(BIN / "snakemake"), "--cores", "2", *QUICK, "--profile", "profiles/local", target]
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed, deadline = None, time.time() + 300
    while proc.poll() is None and time.time() < deadline and killed is None:
        if list((train / "checkpoints").glob("step-*.pt")) and (pid := _rank_pid(1, root)) is not None:
            os.kill(pid, signal.SIGKILL)
            killed = pid
        time.sleep(0.02)
    out = proc.communicate(timeout=300)[0]
    assert killed is not None, "rank 1 was not found running after a checkpoint:\n" + out[-3000:]
    assert proc.returncode != 0, out[-3000:]
    assert "Error in rule train" in out
    log = (root / "logs/demo/train.250kb_s12.log").read_text()
    assert "torchrun exited with status" in log
    assert not (train / "model.pt").exists()
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    log = (root / "logs/demo/train.250kb_s12.log").read_text()
    assert "resumed from" in log
    a = torch.load(run_dir / target, weights_only=True)["state_dict"]
    b = torch.load(root / target, weights_only=True)["state_dict"]
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    ma = [json.loads(x)["loss"] for x in (run_dir / "results/demo/train/250kb_s12/metrics.jsonl").read_text().splitlines()]
    mb = [json.loads(x)["loss"] for x in (train / "metrics.jsonl").read_text().splitlines()]
    assert ma == mb


def test_new_cells_embed_without_retraining(run_dir):
    """A folder of cells named in config "embed" is embedded with the trained model: the
    dry run lists no train job; the training folder embeds to train's vectors bit for bit."""
    data = run_dir / "results/demo/data/500kb_s10"
    new = run_dir / "resources/new_cells"
    new.mkdir(parents=True, exist_ok=True)
    for name in ("rna.h5ad", "hic.h5ad"):
        a = ad.read_h5ad(data / name)
        a[::3, ::-1].copy().write_h5ad(new / name)  # a third of the cells, columns reversed
    (run_dir / "config/embed.yaml").write_text("embed: {new: {data: resources/new_cells}}\n")
    args = ["--configfile", *QUICK[1:], "config/embed.yaml", "--profile", "profiles/local"]
    targets = ["results/demo/embed/500kb_s10/new/embeddings.h5ad", "results/demo/embed/500kb_s10/embeddings.h5ad"]
    r = snakemake(run_dir, *args, "-n", *targets)
    assert r.returncode == 0, r.stderr[-3000:]
    assert set(dry_run_jobs(r)) == {"embed", "embed_cells"}, r.stdout
    r = snakemake(run_dir, *args, *targets)
    assert r.returncode == 0, r.stderr[-3000:]
    trained = ad.read_h5ad(run_dir / "results/demo/train/500kb_s10/embeddings.h5ad")
    again = ad.read_h5ad(run_dir / targets[1])
    for key in ("X_rna", "X_hic", "X_joint"):
        assert np.array_equal(again.obsm[key], trained.obsm[key]), key
    cells = ad.read_h5ad(run_dir / targets[0])
    assert list(cells.obs_names) == list(trained.obs_names[::3])
    assert cells.uns["ampflow"]["genes"]["missing"] == 0
    for key in ("X_rna", "X_hic", "X_joint"):  # a cell's vector does not depend on the cells beside it
        assert np.array_equal(cells.obsm[key], trained.obsm[key][::3]), key


def dry_run_jobs(r: subprocess.CompletedProcess) -> dict[str, int]:
    """The rules and job counts of a dry run's "Job stats" table."""
    return job_counts(r.stdout + r.stderr)


@pytest.mark.parametrize(
    ("change", "measured"),
    [
        ("train: {seed: 1}", False),
        ("train: {pretrain: {epochs: 7, lr: 0.002, weights: {align: 10.0}}}", False),
        ("model: {dropout: 0.2}", False),
        ("model: {hidden_dim: 128}", True),  # the encoders' width: the benchmark times their hidden layers
        ("model: {heads: 8}", True),
    ],
    ids=["seed", "schedule", "dropout", "hidden_dim", "heads"],
)
def test_a_changed_config_times_the_machine_again_only_when_the_measurement_changes(run_dir, change, measured):
    """After a finished run, one config value changed: every configuration is planned
    again (diagnose takes the whole train section) and trained again; the devices job
    (devices.json and the calibration) runs again only for a key the benchmark measures
    with (contract.config.calibration_sections)."""
    r = snakemake(run_dir, "--profile", "profiles/local", "-n")
    assert r.returncode == 0 and dry_run_jobs(r) == {}, r.stdout  # nothing to do before
    (run_dir / "config/change.yaml").write_text(change + "\n")
    r = snakemake(run_dir, "--configfile", *QUICK[1:], "config/change.yaml", "--profile", "profiles/local", "-n")
    assert r.returncode == 0, r.stderr[-3000:]
    jobs = dry_run_jobs(r)
    assert jobs["diagnose"] == 2 and jobs["train"] == 2, r.stdout
    assert ("devices" in jobs) == measured, jobs


def test_nothing_to_do_then_only_new_cells_binned(run_dir):
    """118 cells are blocks of 50, 50 and 18; two appended cells re-bin the last block
    only (its rows changed), and plan the outputs downstream of the gather again. The split is drawn
    again and every earlier cell keeps its side (the demo's cell types, of about thirty
    cells, each have training cells by their own draws, so the guard does not act)."""
    from ampflow.io.split import read_split

    r = snakemake(run_dir, "--profile", "profiles/local", "-n")
    assert r.returncode == 0 and "Nothing to be done" in r.stdout + r.stderr
    blocks = run_dir / "results/demo/binned/blocks"
    before = {p.parent.name: p.stat().st_mtime_ns for p in blocks.glob("*/contacts.tsv")}
    assert sorted(before) == ["0000", "0001", "0002"]
    split_path = run_dir / "results/demo/qc/split.tsv"
    split_before, split_written = read_split(split_path), split_path.stat().st_mtime_ns
    (run_dir / "resources/demo/cells.full.tsv").replace(run_dir / "resources/demo/cells.tsv")
    # the dry run plans everything downstream of the gather again (training included);
    # the real run then stops at the split and one configuration's matrices, which is
    # all this test reads (training the demo twice more is the other tests' business)
    r = snakemake(run_dir, "--profile", "profiles/local", "-n")
    planned = job_counts(r.stdout + r.stderr)
    assert r.returncode == 0, r.stderr[-3000:]
    assert planned.get("bin_block") == 1 and {"gather_blocks", "split_cells", "strata", "train"} <= set(planned), planned
    r = snakemake(run_dir, "--profile", "profiles/local", "results/demo/qc/split.tsv", "results/demo/data/500kb_s10/hic.h5ad")
    assert r.returncode == 0, r.stderr[-3000:]
    after = {p.parent.name: p.stat().st_mtime_ns for p in blocks.glob("*/contacts.tsv")}
    assert [b for b in sorted(after) if after[b] != before[b]] == ["0002"]
    assert "binned and written 20/20 cells" in (run_dir / "logs/demo/bin_block/0002.log").read_text()
    split_after = read_split(split_path)
    assert split_path.stat().st_mtime_ns != split_written and split_before.index.isin(split_after.index).all()
    assert split_after[split_before.index].equals(split_before)
    hic = ad.read_h5ad(run_dir / "results/demo/data/500kb_s10/hic.h5ad", backed="r")
    assert "cell0117" in hic.obs_names or "cell0118" in hic.obs_names
