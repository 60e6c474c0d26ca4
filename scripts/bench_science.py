"""Does the Hi-C latent keep cell identity on real cells it never trained on? Against the
BandNorm-style baseline, with shuffled-label controls, and ablations of the decoder.

Data: the 174 labelled Lee et al. 2019 cortex cells of ``../shared/data/schic/
lee2019_pfc_chr1`` (snm3C-seq, chr1 at 1 Mb; four types, three sequencing batches),
binned, quality-controlled and turned into 1 Mb x 10 strata by the product's own prepare
commands (``ampflow bin-cells``, ``qc-cells``, ``pseudobulk``, ``strata``, ``graph``). The
strata feature filter sees every cell (it is label-free); each split then holds out a
random fifth of the cells (``--splits`` seeds) that no training step, BatchNorm statistic,
validation loss or baseline axis sees.

Per split and variant, a Hi-C-only model is trained by :class:`ampflow.train.trainer.Trainer`
with the template's model and training settings (``config/config.yaml``) and its latent
``X_hic`` is clustered by k-means with k = the number of labels (seed 0, 10 starts), on the
held-out cells alone and on all cells. The referee is the BandNorm-style baseline
(:func:`ampflow.evaluate.baselines.bandnorm_baseline`: strata 1-9 band-normalised, log1p,
PCA 20 fitted on the same split's training cells) clustered the same way; the workflow's
own scHiCluster-style baseline is shown too. Every ARI has a shuffled-label control: the
95th percentile of the ARI of the same clusters against 200 permutations of the labels.
ARI against the sequencing batch says whether the latent sorts by batch instead.

Variants (``--ablations``): ``model`` is today's decoder; each ablation puts back one
thing the decoder used to do, to show what it cost:

* ``sampled_keys``: the decoder's keys from a sample of the anchor latents (noise of the
  prior's size) instead of their means; the node KL is then taken at the sample;
* ``decay_head``: the per-stratum library predicted from the latent (``library x
  softmax(head(u))``) instead of the cell's observed contacts per stratum;
* ``no_loadings``: no per-feature loadings, the keys alone;
* ``full_key_scale``: the key term starting at softplus(0) instead of softplus(-5);
* ``latent32``: ``model.latent_dim`` 32 (the template's value before);
* ``old``: all of the above at once, i.e. the decoder and latent before this change.

Ablations are applied by rebinding model methods inside this script only.

    PYTHONPATH=src python scripts/bench_science.py --splits 5 --ablations model
    PYTHONPATH=src python scripts/bench_science.py --splits 2 --ablations model,sampled_keys,decay_head,no_loadings,full_key_scale,latent32,old
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import yaml
from sklearn.cluster import KMeans
from sklearn.metrics import adjusted_rand_score

from ampflow.cli import main as cli
from ampflow.evaluate.baselines import bandnorm_baseline, hic_baseline
from ampflow.io.h5ad import read_h5ad
from ampflow.model import decoders, paired
from ampflow.model.prob import ZINB
from ampflow.spec.config import ModelConfig, TrainConfig
from ampflow.spec.layout import HELDOUT, SPLIT_COLUMN, TRAIN
from ampflow.train.data import load_paired
from ampflow.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
ABLATIONS = ("model", "sampled_keys", "decay_head", "no_loadings", "full_key_scale", "latent32", "old")
OLD = ("sampled_keys", "decay_head", "no_loadings", "full_key_scale", "latent32")
PERMUTATIONS = 200


# ------------------------------------------------------------------ data
def prepare(src: Path, work: Path, resolution: int, strata: int) -> Path:
    """The product's prepare commands on the cells of ``src``: the data folder."""
    data = work / "data"
    if (data / "graph").exists():
        return data
    cells = pd.read_csv(src / "cells.tsv", sep="\t")
    cells["pairs"] = [str(src / p) for p in cells["pairs"]]
    work.mkdir(parents=True, exist_ok=True)
    sheet = work / "cells.tsv"
    cells.to_csv(sheet, sep="\t", index=False)
    sizes, scool, qc, mcool = src / "chrom.sizes", work / "binned.scool", work / "qc" / "cells.tsv", work / "pseudobulk.mcool"
    steps = [
        ["bin-cells", "--sheet", sheet, "--chromsizes", sizes, "--resolutions", resolution, "--out-scool", scool,
         "--stats", work / "qc" / "contacts.tsv", "--cache-dir", work / "cache", "--threads", "2"],
        ["qc-cells", "--sheet", sheet, "--contacts", work / "qc" / "contacts.tsv", "--min-contacts", "1000", "--out", qc],
        ["pseudobulk", "--scool", f"{resolution}={scool}", "--qc", qc, "--out", mcool],
        ["strata", "--scool", scool, "--qc", qc, "--chromsizes", sizes, "--strata", strata, "--min-cells", "3",
         "--min-count", "3", "--out", data / "hic.h5ad"],
        ["graph", "--hic", data / "hic.h5ad", "--mcool", mcool, "--chromsizes", sizes, "--out", data / "graph"],
    ]  # fmt: skip
    for step in steps:
        if cli([str(x) for x in step]) != 0:
            sys.exit(f"prepare step {step[0]} failed")
    return data


def holdout(n: int, seed: int, share: float = 0.2) -> np.ndarray:
    rng = np.random.default_rng(seed)
    mask = np.zeros(n, dtype=bool)
    mask[rng.choice(n, int(round(share * n)), replace=False)] = True
    return mask


# ------------------------------------------------------------------ scores
def kmeans(z: np.ndarray, k: int) -> np.ndarray:
    return KMeans(k, n_init=10, random_state=0).fit_predict(z)


def ari_with_control(labels: np.ndarray, clusters: np.ndarray, seed: int = 0) -> tuple[float, float]:
    """ARI, and the 95th percentile of the ARI against permuted labels (chance)."""
    rng = np.random.default_rng(seed)
    null = [adjusted_rand_score(rng.permutation(labels), clusters) for _ in range(PERMUTATIONS)]
    return float(adjusted_rand_score(labels, clusters)), float(np.percentile(null, 95))


def score(z: np.ndarray, types: np.ndarray, batches: np.ndarray, held: np.ndarray) -> dict:
    k = len(np.unique(types))
    out = {}
    for group, rows in (("heldout", held), ("all", np.ones_like(held))):
        c = kmeans(z[rows], k)
        ari, p95 = ari_with_control(types[rows], c)
        out[group] = {"ari": ari, "shuffled_p95": p95, "ari_batch": float(adjusted_rand_score(batches[rows], c))}
    return out


# ------------------------------------------------------------------ ablations
@contextlib.contextmanager
def ablated(names: set[str]):
    """Rebind model methods for the listed ablations (undone on exit)."""
    saved = []

    def patch(owner, attr, value):
        saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, value)

    dec = decoders.StratifiedZINBDecoder
    init = dec.__init__
    if names & {"no_loadings", "full_key_scale", "decay_head"}:

        def new_init(self, latent, D, *args, **kwargs):
            init(self, latent, D, *args, **kwargs)
            if "no_loadings" in names:
                self.loading.data.zero_()
                self.loading.requires_grad_(False)
            if "full_key_scale" in names:
                self.scale_lin.data.fill_(0.0)
            if "decay_head" in names:
                self.strata_head = nn.Linear(latent, self.n_strata)

        patch(dec, "__init__", new_init)
    if "decay_head" in names:

        def forward(self, u, v_anchors, band_totals, on_stratum=None):
            u_D = self.u_proj(u) if self.u_proj is not None else u
            w = torch.softmax(self.strata_head(u), dim=1)
            library = band_totals.sum(1)
            means = [torch.softmax(self.stratum_logits(k, u, u_D, v_anchors), dim=1) * (library * w[:, k]).unsqueeze(1)
                     for k in range(self.n_strata)]  # fmt: skip
            mu = torch.cat(means, dim=1)
            return ZINB(mu, self.log_theta.exp(), self.zi_logits.expand_as(mu))

        patch(dec, "forward", forward)
    if "sampled_keys" in names:
        node_latents = paired.PairedModel.node_latents

        def sampled(self, sample, eps=None):
            v, loc, std = node_latents(self, sample, eps)
            return v, v, std

        patch(paired.PairedModel, "node_latents", sampled)
    try:
        yield
    finally:
        for owner, attr, value in reversed(saved):
            setattr(owner, attr, value)


# ------------------------------------------------------------------ runs
def train_and_embed(data_dir: Path, held: np.ndarray, model_cfg: dict, train_cfg: dict, out: Path) -> tuple[np.ndarray, float, int, list[str]]:
    data = load_paired(data_dir)
    data.obs = data.obs.copy()
    data.obs[SPLIT_COLUMN] = pd.Categorical(np.where(held, HELDOUT, TRAIN), categories=[TRAIN, HELDOUT])
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            msg = record.getMessage()
            if "stopped after" in msg or "ran all" in msg or "restored" in msg:
                lines.append(msg)

    handler = Keep()
    logging.getLogger("ampflow.train.trainer").addHandler(handler)
    logging.getLogger("ampflow.train.trainer").setLevel(logging.INFO)
    try:
        t0 = time.perf_counter()
        trainer = Trainer(data, ModelConfig.from_dict(model_cfg), TrainConfig.from_dict(train_cfg), out)
        trainer.fit()
        seconds = time.perf_counter() - t0
    finally:
        logging.getLogger("ampflow.train.trainer").removeHandler(handler)
    emb = read_h5ad(out / "embeddings.h5ad")
    return np.asarray(emb.obsm["X_hic"]), seconds, int(trainer.step), lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lee", type=Path, default=SHARED / "schic" / "lee2019_pfc_chr1")
    ap.add_argument("--work", type=Path, default=Path("/tmp/ampflow-bench-science"))
    ap.add_argument("--config", type=Path, default=REPO / "config" / "config.yaml", help="model and train settings (the template)")
    ap.add_argument("--splits", type=int, default=5)
    ap.add_argument("--ablations", default="model", help=f"comma-separated, of {','.join(ABLATIONS)}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if not (a.lee / "cells.tsv").is_file():
        print(f"skipped: {a.lee} not present")
        return 0
    variants = [v.strip() for v in a.ablations.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(ABLATIONS))
    if unknown:
        ap.error(f"unknown ablation(s) {unknown}; known: {', '.join(ABLATIONS)}")
    template = yaml.safe_load(a.config.read_text())
    data_dir = prepare(a.lee, a.work / "lee2019", 1_000_000, 10)
    hic = read_h5ad(data_dir / "hic.h5ad")
    sheet = pd.read_csv(a.lee / "cells.tsv", sep="\t").set_index("cell_id").loc[hic.obs_names]
    types, batches = sheet["cell_type"].to_numpy(), sheet["batch"].to_numpy()
    print(f"Lee 2019 shared cells: {hic.n_obs} cells x {hic.n_vars} features (1 Mb x 10 strata), "
          f"types {pd.Series(types).value_counts().to_dict()}, batches {pd.Series(batches).value_counts().to_dict()}")  # fmt: skip
    rows = []
    for split in range(a.splits):
        held = holdout(hic.n_obs, split)
        fit = ~held
        for name, (z, _) in (("bandnorm", bandnorm_baseline(hic, fit)), ("bandnorm_nolog", bandnorm_baseline(hic, fit, log1p=False)),
                             ("workflow_baseline", hic_baseline(hic, fit))):  # fmt: skip
            rows.append({"split": split, "method": name, **_flat(score(z, types, batches, held))})
        for variant in variants:
            names = set(OLD) if variant == "old" else ({variant} - {"model"})
            model_cfg = dict(template.get("model") or {})
            if "latent32" in names:
                model_cfg["latent_dim"] = 32
            train_cfg = {**(template.get("train") or {}), "threads": a.threads, "device": "cpu", "checkpoint_every": 100_000}
            with ablated(names):
                z, seconds, steps, lines = train_and_embed(data_dir, held, model_cfg, train_cfg, a.work / "runs" / f"{variant}-{split}")
            rows.append({"split": split, "method": variant, "seconds": seconds, "steps": steps, **_flat(score(z, types, batches, held))})
            print(f"split {split} {variant:>15}: held-out ARI {rows[-1]['heldout_ari']:.3f} (baseline {_base(rows, split, 'heldout_ari'):.3f}), "
                  f"all {rows[-1]['all_ari']:.3f} (baseline {_base(rows, split, 'all_ari'):.3f}), batch {rows[-1]['all_ari_batch']:.3f}, "
                  f"{steps} steps in {seconds:.0f} s; {' / '.join(lines)}", flush=True)  # fmt: skip
    table = pd.DataFrame(rows)
    cols = ["heldout_ari", "heldout_shuffled_p95", "all_ari", "all_shuffled_p95", "all_ari_batch", "seconds", "steps"]
    summary = table.groupby("method", sort=False)[cols].agg(["mean", "std"])
    pd.set_option("display.width", 250)
    print(f"\nmean and sd over {a.splits} split(s); k-means with k = {len(np.unique(types))}; shuffled = 95th percentile of {PERMUTATIONS} label permutations")
    print(summary.round(3).to_string())
    for variant in variants:
        for group in ("heldout", "all"):
            gap = table[table.method == variant][f"{group}_ari"].mean() - table[table.method == "bandnorm"][f"{group}_ari"].mean()
            print(f"{variant} {group}: latent - BandNorm baseline = {gap:+.3f}")
    if a.json_out:
        a.json_out.write_text(json.dumps(rows, indent=1))
    return 0


def _flat(scores: dict) -> dict:
    return {f"{g}_{k}": v for g, d in scores.items() for k, v in d.items()}


def _base(rows: list[dict], split: int, key: str) -> float:
    return next(r[key] for r in rows if r["split"] == split and r["method"] == "bandnorm")


if __name__ == "__main__":
    sys.exit(main())
