"""Cells that arrive later, embedded through the workflow without retraining.

A small workflow (one configuration, a short fit) runs once in a temp folder. Then config
"embed" names raw cells (a cell sheet and RNA counts): the dry run lists the embed-side
jobs and no train job, and the new cells are QC'd, binned, stratified and embedded. The
referees: the training run's own ``embeddings.h5ad`` (its held-out cells, sent through the
raw path from the same pairs and RNA, embed to its rows bit for bit) and the model's gene
and feature lists (the missing/extra counts of the log).
"""

from __future__ import annotations

import gzip
import re

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import torch
from conftest import workflow_copy
from helpers import job_counts, snakemake

pytestmark = pytest.mark.slow

CFG = "500kb_s4"
SMALL = """
configs: [{resolution: 500000, strata: 4}]
train: {pretrain: {epochs: 3}, finetune: {epochs: 1}, early_stopping: {patience: 0}}
amp: {devices: 1, device_memory_gb: 1.0}
"""
KEYS = ("X_rna", "X_hic", "X_joint")
EMBED_JOBS = {"embed_bin_cells", "embed_load_rna", "embed_qc_cells", "embed_rna_data", "embed_strata", "embed_cells"}


def run(cwd, *flags, config=(), targets=()):
    """``snakemake`` with the small run's config (``config/quick.yaml``, as test_workflow's
    QUICK names it), or with ``config`` (``--configfile`` and its files: last on the line,
    where they take no target along)."""
    return snakemake(cwd, "--profile", "profiles/local", *flags, *targets, *config)


def dry_run_jobs(cwd, config=(), targets=()) -> dict[str, int]:
    """Rule -> job count of ``snakemake -n``."""
    r = run(cwd, "-n", config=config, targets=targets)
    assert r.returncode == 0, r.stdout[-3000:]
    return job_counts(r.stdout + r.stderr)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from ampflow.demo import write_demo

    root = workflow_copy(tmp_path_factory.mktemp("wf-embed"))
    # QUICK in test_workflow names config/quick.yaml: the small run's settings go there
    (root / "config/quick.yaml").write_text(SMALL)
    write_demo(root / "resources" / "demo", n_cells=60, seed=0)
    r = run(root)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return root


def write_embed_config(root, **sets) -> list[str]:
    lines = [f"  {name}: {{cells: {sheet}, rna: {rna}}}" for name, (sheet, rna) in sets.items()]
    (root / "config/embed.yaml").write_text("embed:\n" + "\n".join(lines) + "\n")
    return ["--configfile", "config/demo.yaml", "config/quick.yaml", "config/embed.yaml"]  # replaces QUICK's


def test_heldout_cells_through_the_raw_path_give_training_vectors(run_dir):
    """The held-out cells' rows of the cell sheet, with the full RNA matrix, go through
    the embed-side QC, binning, strata and RNA: their vectors equal training's rows."""
    from ampflow.io.split import read_split

    res = run_dir / "results/demo"
    split = read_split(res / "qc/split.tsv")
    held = list(split.index[split == "heldout"])
    assert 3 <= len(held) < len(split)
    sheet = pd.read_csv(run_dir / "resources/demo/cells.tsv", sep="\t", dtype=str).set_index("cell_id")
    sheet.loc[held[::-1]].reset_index().to_csv(run_dir / "resources/heldout.tsv", sep="\t", index=False)  # another order
    args = write_embed_config(run_dir, heldout=("resources/heldout.tsv", "resources/demo/rna.tsv.gz"))
    target = f"results/demo/embed/{CFG}/heldout/embeddings.h5ad"
    jobs = dry_run_jobs(run_dir, args, [target])
    assert set(jobs) == EMBED_JOBS, jobs
    r = run(run_dir, config=args, targets=[target])
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    emb = ad.read_h5ad(run_dir / target)
    trained = ad.read_h5ad(res / f"train/{CFG}/embeddings.h5ad")
    assert list(emb.obs_names) == held[::-1]
    ref = trained[held[::-1]]
    for key in KEYS:
        assert emb.obsm[key].dtype == ref.obsm[key].dtype == np.float32
        assert np.array_equal(emb.obsm[key], ref.obsm[key]), (key, float(np.abs(emb.obsm[key] - ref.obsm[key]).max()))
    assert emb.uns["ampflow"]["genes"]["missing"] == emb.uns["ampflow"]["features"]["missing"] == 0
    # nothing was fitted on them: every gene and every candidate feature came along
    rna = ad.read_h5ad(res / "embed/cells/heldout/rna.h5ad", backed="r")
    hic = ad.read_h5ad(res / f"embed/cells/heldout/{CFG}/hic.h5ad", backed="r")
    assert rna.n_vars > ad.read_h5ad(res / f"data/{CFG}/rna.h5ad", backed="r").n_vars
    assert hic.n_vars > ad.read_h5ad(res / f"data/{CFG}/hic.h5ad", backed="r").n_vars
    assert emb.obs.loc[held, "cell_type"].tolist() == sheet.loc[held, "cell_type"].tolist()


def new_cells(root, n_cells: int, n_genes: int):
    """Cells of another demo draw (seed 1) with ids new0000..., measuring fewer genes."""
    from ampflow.demo import write_demo

    paths = write_demo(root / "resources/new", n_cells=n_cells, seed=1, n_genes=n_genes)
    sheet = pd.read_csv(paths["sheet"], sep="\t", dtype=str)
    sheet["cell_id"] = sheet["cell_id"].str.replace("cell", "new")
    rna = pd.read_csv(paths["rna"], sep="\t", index_col=0)
    rna.columns = [c.replace("cell", "new") for c in rna.columns]
    with gzip.open(root / "resources/new/rna.tsv.gz", "wt") as f:
        rna.to_csv(f, sep="\t")
    return sheet


def test_new_cells_embed_without_retraining(run_dir):
    res = run_dir / "results/demo"
    sheet = new_cells(run_dir, n_cells=24, n_genes=2000)
    sheet.iloc[:20].to_csv(run_dir / "resources/new/sheet.tsv", sep="\t", index=False)
    args = write_embed_config(run_dir, new=("resources/new/sheet.tsv", "resources/new/rna.tsv.gz"))
    jobs = dry_run_jobs(run_dir, args)  # the default target
    assert "train" not in jobs and set(jobs) == EMBED_JOBS | {"all"}, jobs
    r = run(run_dir, config=args)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    out = res / f"embed/{CFG}/new/embeddings.h5ad"
    emb = ad.read_h5ad(out)
    qc = pd.read_csv(res / "embed/cells/new/qc/cells.tsv", sep="\t", index_col="cell_id")
    assert list(emb.obs_names) == [c for c in qc.index if qc.loc[c, "pass"]] and 10 <= emb.n_obs < 20
    # the latents are 32 wide; the joint adds the Hi-C latent's 8 private dimensions
    for key, width in zip(KEYS, (32, 32, 40)):
        assert emb.obsm[key].shape == (emb.n_obs, width) and np.isfinite(emb.obsm[key]).all()
    # the counts against the model's own lists: its genes beyond Gene01999 are missing
    model = torch.load(res / f"train/{CFG}/model.pt", map_location="cpu", weights_only=True)
    given = set(ad.read_h5ad(res / "embed/cells/new/rna.h5ad", backed="r").var_names)
    missing = sum(g not in given for g in model["genes"])
    assert missing > 0 and emb.uns["ampflow"]["genes"] == {
        "trained": len(model["genes"]), "given": 2000, "kept": len(model["genes"]) - missing,
        "missing": missing, "extra": 2000 - (len(model["genes"]) - missing),
    }  # fmt: skip
    n_features = ad.read_h5ad(res / f"embed/cells/new/{CFG}/hic.h5ad", backed="r").n_vars
    assert emb.uns["ampflow"]["features"]["missing"] == 0
    assert emb.uns["ampflow"]["features"]["extra"] == n_features - len(model["features"])
    log = (run_dir / f"logs/demo/embed.{CFG}.new.log").read_text()
    g = emb.uns["ampflow"]["genes"]
    assert re.search(rf"genes: {g['kept']} of the model's {g['trained']} kept; {g['missing']} missing \(zeros\); {g['extra']} extra", log)
    assert re.search(r"features: \d+ of the model's \d+ kept; 0 missing \(zeros\); \d+ extra", log)

    # the sheet grows: only the embed side runs again, the new cells alone are binned
    sheet.to_csv(run_dir / "resources/new/sheet.tsv", sep="\t", index=False)
    jobs = dry_run_jobs(run_dir, args)
    # the RNA file did not change: not even embed_load_rna runs again
    assert set(jobs) == EMBED_JOBS - {"embed_load_rna"} | {"all"}, jobs
    r = run(run_dir, config=args)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "4 cell(s) binned now, 20 reused from cache" in (run_dir / "logs/demo/embed/new/bin_cells.log").read_text()
    assert ad.read_h5ad(out, backed="r").n_obs > emb.n_obs
    done = run(run_dir, "-n", config=args)
    assert "Nothing to be done" in done.stdout + done.stderr
