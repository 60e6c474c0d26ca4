"""The workflow end to end on a tiny Hi-C-only dataset (a config without ``inputs.rna``):
no RNA rule runs, and every Hi-C output, the plan, training, evaluation, embedding and
the report are written, in a temp folder."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
from conftest import workflow_copy

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
# inputs.rna and inputs.genes null: a Hi-C-only dataset. One small configuration, one
# process, a few steps: the workflow is under test, not the fit.
CONFIG = """
dataset: hiconly
inputs: {cells: resources/demo/cells.tsv, rna: null, genes: null, chromsizes: resources/demo/chrom.sizes}
configs: [{resolution: 1000000, strata: 4}]
train: {pretrain: {epochs: 3}, finetune: {epochs: 1}, early_stopping: {patience: 0}, batch_size: 16}
model: {hidden_dim: 32, latent_dim: 8}
amp: {devices: 1, device_memory_gb: 1.0}
pseudobulk: {resolutions: [2000000]}
embed: {again: {data: results/hiconly/data/1mb_s4}, raw: {cells: resources/demo/cells.tsv}}
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from ampflow.demo import write_demo

    root = workflow_copy(tmp_path_factory.mktemp("wf-hic-only"))
    (root / "config/hic_only.yaml").write_text(CONFIG)
    write_demo(root / "resources" / "demo", n_cells=40, seed=0, n_genes=50)
    (root / "resources/demo/rna.tsv.gz").unlink()  # no RNA anywhere
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    cmd = [str(BIN / "snakemake"), "--cores", "2", "--configfile", "config/demo.yaml", "config/hic_only.yaml", "--profile", "profiles/local"]
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return root


def test_hic_only_outputs(run_dir):
    res = run_dir / "results/hiconly"
    for rel in [
        "qc/cells.tsv", "qc/split.tsv", "data/1mb_s4/hic.h5ad", "data/1mb_s4/graph/nodes.parquet",
        "amp/1mb_s4/profile.json", "amp/1mb_s4/plan.json", "train/1mb_s4/model.pt",
        "train/1mb_s4/embeddings.h5ad", "eval/1mb_s4/scores.json", "eval/1mb_s4/umap.png",
        "embed/1mb_s4/again/embeddings.h5ad", "embed/1mb_s4/raw/embeddings.h5ad", "figures/summary.html", "figures/scores.png",
        "figures/qc/contacts.png", "figures/1mb_s4/plan.html",
    ]:  # fmt: skip
        assert (res / rel).exists(), rel
    # no RNA rule ran
    assert not (res / "data/1mb_s4/rna.h5ad").exists() and not (res / "qc/rna.tsv").exists() and not (res / "rna").exists()
    qc = pd.read_csv(res / "qc/cells.tsv", sep="\t", index_col="cell_id")
    assert qc["pass"].sum() > 10 and not qc["in_rna"].any()


def test_hic_only_profile_plan_train_and_scores(run_dir):
    res = run_dir / "results/hiconly"
    profile = json.loads((res / "amp/1mb_s4/profile.json").read_text())
    assert set(profile["modalities"]) == {"hic"}
    plan = json.loads((res / "amp/1mb_s4/plan.json").read_text())
    # 1 GB is room for one block of attention, the fastest: S3's signal is raised but not taken
    assert [s["id"] for s in plan["strategies"]] == [] and plan["fits"] and plan["chunk_size"] is None
    assert any(r.startswith("S3 chunked_attention not taken") for r in plan["reasons"])
    assert plan["cost_model"]["source"].startswith("calibrated on cpu") and plan["predicted_step_seconds"] > 0
    nodes = pd.read_parquet(res / "data/1mb_s4/graph/nodes.parquet")
    assert set(nodes["kind"]) == {"anchor"}
    rows = [json.loads(x) for x in (res / "train/1mb_s4/metrics.jsonl").read_text().splitlines()]
    assert set(rows[-1]["loss"]) == {"hic_nll", "hic_kl", "graph_nll", "graph_kl", "total"}
    emb = ad.read_h5ad(res / "train/1mb_s4/embeddings.h5ad")
    assert set(emb.obsm) == {"X_hic", "X_joint"}
    again = ad.read_h5ad(res / "embed/1mb_s4/again/embeddings.h5ad")
    assert set(again.obsm) == {"X_hic", "X_joint"}
    # raw cells (a sheet without RNA) through the embed_* rules: QC'd on contacts alone,
    # every candidate feature mapped onto the model's by name; the referee is training's
    # own embedding of the same cells
    raw = ad.read_h5ad(res / "embed/1mb_s4/raw/embeddings.h5ad")
    assert set(raw.obsm) == {"X_hic", "X_joint"} and not (res / "embed/cells/raw/rna.h5ad").exists()
    assert list(raw.obs_names) == list(emb.obs_names)
    assert np.allclose(raw.obsm["X_hic"], emb.obsm["X_hic"], rtol=0, atol=1e-5)
    scores = json.loads((res / "eval/1mb_s4/scores.json").read_text())
    assert scores["modalities"] == ["hic"] and scores["foscttm"] is None
    held = scores["groups"]["heldout"]
    assert set(held["methods"]) == {"joint", "hic_latent", "hic_baseline", "bandnorm_baseline"}
    assert {"rna_latent", "rna_baseline", "foscttm", "shuffled_control"} == set(held["absent"])
    assert all(math.isfinite(m["ari"]) for m in held["methods"].values())
    summary = (res / "figures/summary.txt").read_text()
    assert "1mb_s4" in summary
