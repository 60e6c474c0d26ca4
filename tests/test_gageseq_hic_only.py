"""Real GAGE-seq mouse cortex cells (chr1, Hi-C only, ../shared/data/schic/gageseq_cortex_chr1,
see its README) through the Hi-C-only path: prepare without RNA, train the Hi-C branch,
and score the Hi-C latent against the published broad classes next to the Hi-C-only
baseline (PCA of the same strata counts).

An honest figure, not a benchmark: the labels come from an assumed join (README), and
the numbers are printed, not held to a threshold; the test asserts that the run
completes and the scores are finite.

Choices: 1 Mb bins with 5 strata (chr1 has 196 such bins; about 16,600 contacts per
cell fill the near-diagonal strata well); no held-out cells (101 cells, a fifth would
leave ~15 labelled cells to cluster), so both the model and the baseline see every cell
without its label, and the scores are those of the group ``all``. Only cells with a
broad class are scored: ``NA`` (no label found) and ``Unk`` (the publication's own
"unknown") are unlabelled.
"""

from __future__ import annotations

import math
import time

import anndata as ad
import numpy as np
import pandas as pd
import pytest

from ampflow.cli import main
from ampflow.contract.config import ModelConfig, TrainConfig
from ampflow.evaluate.run import main_evaluate
from ampflow.train.data import load_paired
from ampflow.train.trainer import Trainer

pytestmark = pytest.mark.slow

RESOLUTION, STRATA = 1_000_000, 5
UNLABELLED = {"NA", "Unk"}
MODEL = ModelConfig(latent_dim=16, hidden_dim=128, heads=2, window=4, dropout=0.1)
TRAIN = {"seed": 0, "batch_size": 32, "threads": 2, "device": "cpu", "checkpoint_every": 1000,
         "pretrain": {"epochs": 25, "lr": 0.002}, "finetune": {"epochs": 5, "lr": 0.0005}, "early_stopping": {"patience": 0}}  # fmt: skip


def test_gageseq_cortex_hic_only(shared_data, tmp_path):
    src = shared_data / "schic" / "gageseq_cortex_chr1"
    if not (src / "cells_labels.tsv").is_file():
        pytest.skip(f"{src} not present")
    labels = pd.read_csv(src / "cells_labels.tsv", sep="\t", dtype=str, keep_default_na=False).set_index("cell")
    sheet = tmp_path / "cells.tsv"
    pd.DataFrame({"cell_id": labels.index, "pairs": [str(src / p) for p in labels["pairs"]]}).to_csv(sheet, sep="\t", index=False)
    sizes = tmp_path / "chr1.sizes"
    full = pd.read_csv(shared_data / "annotation" / "mm10.chrom.sizes", sep="\t", header=None, names=["chrom", "size"])
    full[full["chrom"] == "chr1"].to_csv(sizes, sep="\t", header=False, index=False)

    work = tmp_path / "work"
    data, scool, qc = work / "data", work / "binned.scool", work / "qc" / "cells.tsv"
    mcool = work / "pseudobulk.mcool"
    steps = [
        ["bin-cells", "--sheet", sheet, "--chromsizes", sizes, "--resolutions", RESOLUTION, "--out-scool", scool,
         "--stats", work / "qc" / "contacts.tsv", "--cache-dir", work / "cache", "--threads", "2", "--strip-prefix", "mm10_"],
        ["qc-cells", "--sheet", sheet, "--contacts", work / "qc" / "contacts.tsv", "--min-contacts", "1000", "--out", qc],
        ["pseudobulk", "--scool", f"{RESOLUTION}={scool}", "--qc", qc, "--out", mcool],
        ["strata", "--scool", scool, "--qc", qc, "--chromsizes", sizes, "--strata", STRATA, "--min-cells", "3",
         "--min-count", "3", "--out", data / "hic.h5ad"],
        ["graph", "--hic", data / "hic.h5ad", "--mcool", mcool, "--chromsizes", sizes, "--out", data / "graph"],
    ]  # fmt: skip
    t0 = time.perf_counter()
    for step in steps:
        assert main([str(x) for x in step]) == 0, step[0]
    t1 = time.perf_counter()

    paired = load_paired(data)
    assert not paired.has_rna
    out = tmp_path / "train"
    assert Trainer(paired, MODEL, TrainConfig.from_dict(TRAIN), out).fit()
    t2 = time.perf_counter()

    emb = ad.read_h5ad(out / "embeddings.h5ad")
    broad = labels["broad_class"].reindex(emb.obs_names)
    emb.obs["broad_class"] = [None if v in UNLABELLED else v for v in broad]
    emb.obs["broad_class"] = emb.obs["broad_class"].astype("category")
    labelled = tmp_path / "embeddings.labelled.h5ad"
    emb.write_h5ad(labelled)
    scores = main_evaluate(labelled, tmp_path / "eval", label_key="broad_class", seed=0, data=data)

    t3 = time.perf_counter()
    group = scores["groups"]["all"]
    methods = group["methods"]
    line = ", ".join(
        f"{m}: ARI {methods[m]['ari']:.3f} NMI {methods[m]['nmi']:.3f} ({methods[m]['n_clusters']} clusters)" for m in ("hic_latent", "hic_baseline")
    )
    print(
        f"\nGAGE-seq cortex chr1, Hi-C only, {RESOLUTION // 1000} kb x {STRATA} strata, "
        f"{paired.hic.shape[1]} features: {group['n_cells']} cells, {group['n_labelled']} labelled "
        f"(broad classes {pd.Series([v for v in emb.obs['broad_class'] if isinstance(v, str)]).value_counts().to_dict()}); {line}; "
        f"seconds: prepare {t1 - t0:.0f}, train {t2 - t1:.0f}, evaluate {t3 - t2:.0f}"
    )
    for m in ("hic_latent", "hic_baseline", "joint"):
        assert math.isfinite(methods[m]["ari"]) and math.isfinite(methods[m]["nmi"])
    assert group["n_labelled"] == int(np.sum([isinstance(v, str) for v in emb.obs["broad_class"]]))
