"""Does the Hi-C latent keep cell identity on real cells it never trained on? Against the
BandNorm-style baseline, with shuffled-label controls, and ablations of the decoder.

Data: the 174 labelled Lee et al. 2019 cortex cells of ``../shared/data/schic/
lee2019_pfc_chr1`` (snm3C-seq, chr1 at 1 Mb; four types, three sequencing batches)
(or, with ``--lee``, another folder of that layout: ``scripts/lee2019_from_bandnorm.py``
writes all 400 labelled cells of the source, five batches), binned, quality-controlled
and turned into 1 Mb x 10 strata by the product's own prepare
commands (``ampflow bin-cells``, ``qc-cells``, ``pseudobulk``, ``strata``, ``graph``). The
strata feature filter sees every cell (it is label-free); each split then holds out a
random fifth of the cells (``--splits`` seeds) that no training step, BatchNorm statistic,
validation loss or baseline axis sees.

Per split and variant, a Hi-C-only model is trained by :class:`ampflow.train.trainer.Trainer`
with the template's model and training settings (``config/config.yaml``) and its latent
``X_hic`` is clustered by k-means with k = the number of labels (seed 0, 100 starts), on the
held-out cells alone and on all cells. The referee is the BandNorm-style baseline
(:func:`ampflow.evaluate.baselines.bandnorm_baseline`: strata 1-9 band-normalised, log1p,
PCA 20 fitted on the same split's training cells) clustered the same way; beside it the
same without its log (``bandnorm_nolog``) and without its log over strata 1-3 alone
(``bandnorm_near``, the strongest simple baseline on these cells), a PCA of the model's
own input (``input_pca``) and the workflow's own scHiCluster-style baseline. Every ARI has a shuffled-label control: the
95th percentile of the ARI of the same clusters against 200 permutations of the labels.
ARI against the sequencing batch says whether the latent sorts by batch instead.

Variants (``--ablations``): ``model`` is the template's model. The Hi-C encoder's input
(:class:`ampflow.model.encoders.HiCInput`), as model settings:

* ``band_none``: every stratum weighed alike (``model.hic_band_weight: none``: the input
  before the training cells' band means weighed it);
* ``band_sqrt``: the square root of the band means;
* ``no_diagonal``: the encoder does not read stratum 0 (``model.hic_diagonal: false``);
* ``log1p``, ``linear``: the weighed input through ``log1p`` or as it is
  (``model.hic_transform``);
* ``pcs20``: the input projected on the training cells' first 20 principal axes
  (``model.hic_pcs: 20``), as GLUE's encoders read a PCA;
* ``near_pcs``: BandNorm's input without its log over strata 1-3 (``hic_transform:
  linear``, ``hic_diagonal: false``, ``hic_max_stratum: 3``), projected as ``pcs20``;
* ``patience10``: early stopping waits 10 epochs, not the template's 30
  (``train.early_stopping.patience``; a stage that stopped inside a loss spike's
  recovery kept a fifth-trained model);
* ``pretrain300``: pretraining stops at epoch 300 at the latest, not the template's 600
  (``train.pretrain.epochs``; most runs' validation loss still improved there);
* ``hic_kl1``: the Hi-C latent's KL term at weight 1, the plain ELBO (``weights.hic_kl``,
  5 by default);
* ``hic_kl20``: that term at 20, the default before (on a few hundred training cells it
  left the latent about two effective dimensions);
* ``thin30``: each training step's cells keep each Hi-C contact with a probability drawn
  per cell from [0.3, 1], read by the encoder and the likelihood (``train.hic_keep_min:
  0.3``, ``hic_thinned: both``: the template's thinning before the denoising encoder);
* ``near_thin``: ``near_pcs`` and ``thin30`` together (the template's Hi-C input and
  thinning at 1 Mb, where its 3 Mb reach is strata 1-3);
* ``log1p_all``: the encoder reads every stratum, the diagonal included, through
  ``log1p``, unprojected (the template's Hi-C input before it took ``near_thin``'s);
* ``unthinned``: no thinning (``train.hic_keep_min: 1``);
* ``log1p_all_unthinned``: both, the template's Hi-C settings before ``near_thin``;
* ``likelihood_all``: the Hi-C likelihood scores every stratum's features, not only those
  of the strata the encoder reads (``model.hic_likelihood: all``, the model before);
* ``latent8``: ``model.latent_dim`` 8, not the template's 12 (k-means weighs every
  dimension, and the latent spreads its variance evenly over all of them);
* ``pcs10``: the encoder's input projected on 10 principal axes, not the template's 20
  (``model.hic_pcs``);
* ``thin15``: each training step's cells keep each contact with a probability drawn per
  cell from [0.15, 1], read by both (``train.hic_keep_min: 0.15``, ``hic_thinned:
  both``): training cells as shallow as the shallowest batch's.
* ``denoise15``: the encoder reads a thinned copy of each training cell's Hi-C counts
  (each cell's keep probability drawn from [0.15, 1], then each contact) while the
  likelihood scores the counts as they are: a denoising autoencoder
  (``train.hic_thinned: encoder``, ``train.hic_keep_min: 0.15``; the template's own
  settings since it was measured, so ``model`` whatever the template). Validation and
  the embeddings read every contact.

Each other ablation puts back one thing the decoder used to do, to show what it cost:

* ``sampled_keys``: the decoder's keys from a sample of the anchor latents (noise of the
  prior's size) instead of their means; the node KL is then taken at the sample;
* ``decay_head``: the per-stratum library predicted from the latent (``library x
  softmax(head(u))``) instead of the cell's observed contacts per stratum;
* ``no_loadings``: no per-feature loadings, the keys alone;
* ``full_key_scale``: the key term starting at softplus(0) instead of softplus(-5);
* ``latent32``: ``model.latent_dim`` 32 (the template's value before);
* ``old``: all of the above at once, i.e. the decoder and latent before this change.

Ablations are applied by rebinding model methods inside this script only.

Sections (``--sections``, all by default):

* ``lee``: the splits and variants above;
* ``lobo``: each Lee 2019 batch held back in turn; the Hi-C-only workflow trains on the
  other batches (its decoders conditioned on them, ``model.batch_key``) and its
  ``embed`` rule embeds the held-back batch's raw cells without retraining; their ARI
  beside the BandNorm-style baseline fitted on that batch and fitted on the training
  batches, the strongest simple baseline of the splits (BandNorm without its log over
  strata 1-3) fitted on that batch and on the training batches, and the shuffled-label
  95th percentile; label transfer (each new cell given the type most of its nearest
  training cells have: balanced accuracy) from the latent beside the two baselines
  fitted on the training batches; ARI against batch over training and new cells together; and the
  latent's spread (its mean variance per dimension) over the cells trained on, over the
  training batches' cells never trained on (early stopping's validation cells: no cell
  of a training batch is held out, so the model trains on the cells the baselines fit
  on) and over the new batch, and how many dimensions each group spreads over
  (the participation ratio), beside the baseline's;
* ``gageseq``: the 101 GAGE-seq cortex cells (labels from a join the data's README
  calls an assumption: an honest figure, no threshold), model against BandNorm;
* ``hires``: the RNA latent on the real HiRES brain RNA (the negative control's run of
  the workflow with the template's settings, seeds ``--hires-seeds``) against the
  scanpy-style RNA baseline, and that control's verdict.

    PYTHONPATH=src python scripts/bench_science.py --splits 5 --train-seeds 0,1,2 --ablations model
    PYTHONPATH=src python scripts/bench_science.py --sections lee --splits 5 --ablations hic_kl1,band_none,band_sqrt,no_diagonal
    PYTHONPATH=src python scripts/bench_science.py --sections lee --splits 2 --ablations model,sampled_keys,decay_head,no_loadings,full_key_scale,latent32,old
    PYTHONPATH=src python scripts/bench_science.py --sections lobo,gageseq,hires
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import scipy.sparse as sp
import torch
import torch.nn as nn
import yaml
from sklearn.cluster import KMeans
from sklearn.metrics import adjusted_rand_score, balanced_accuracy_score
from sklearn.neighbors import KNeighborsClassifier

from ampflow.cli import main as cli
from ampflow.contract.config import EarlyStoppingConfig, ModelConfig, TrainConfig
from ampflow.contract.layout import HELDOUT, SPLIT_COLUMN, TRAIN, training_rows
from ampflow.evaluate.baselines import bandnorm_baseline, counts_matrix, hic_baseline, pca_fit_transform
from ampflow.evaluate.clusters import KMEANS_STARTS
from ampflow.evaluate.embed import HIC_INPUT_BEFORE, map_columns
from ampflow.evaluate.spread import effective_dims
from ampflow.io.h5ad import read_h5ad
from ampflow.model import decoders, paired
from ampflow.model.encoders import HiCInput
from ampflow.model.prob import ZINB
from ampflow.train.data import load_paired
from ampflow.train.early_stopping import validation_split
from ampflow.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
ABLATIONS = ("model", "band_none", "band_sqrt", "no_diagonal", "log1p", "linear", "pcs20", "near_pcs", "patience10", "pretrain300", "hic_kl1", "hic_kl20",
             "thin30", "near_thin", "log1p_all", "unthinned", "log1p_all_unthinned", "sampled_keys", "decay_head", "no_loadings", "full_key_scale",
             "latent32", "old", "likelihood_all", "latent8", "pcs10", "thin15", "denoise15")  # fmt: skip
#: Ablations that are model settings (``model.*``), not rebound methods.
CONFIG_ABLATIONS = {
    "band_none": {"hic_band_weight": "none"},
    "band_sqrt": {"hic_band_weight": "sqrt"},
    "no_diagonal": {"hic_diagonal": False},
    "latent32": {"latent_dim": 32},
    "log1p": {"hic_transform": "log1p"},
    "linear": {"hic_transform": "linear"},
    "pcs20": {"hic_pcs": 20},
    "near_pcs": {"hic_transform": "linear", "hic_diagonal": False, "hic_max_stratum": 3, "hic_pcs": 20},
    "log1p_all": dict(HIC_INPUT_BEFORE),  # what a model.pt from before these settings read
    "likelihood_all": {"hic_likelihood": "all"},  # the likelihood over every stratum, as before it read the reach
    "latent8": {"latent_dim": 8},
    "pcs10": {"hic_pcs": 10},
}
#: Ablations that are training settings (``train.*``, merged into the template's).
TRAIN_ABLATIONS = {
    "patience10": {"early_stopping": {"patience": 10}},
    "pretrain300": {"pretrain": {"epochs": 300}},
    "thin30": {"hic_keep_min": 0.3, "hic_thinned": "both"},
    "unthinned": {"hic_keep_min": 1.0},
    "thin15": {"hic_keep_min": 0.15, "hic_thinned": "both"},
    "denoise15": {"hic_keep_min": 0.15, "hic_thinned": "encoder"},
}
#: Ablations that are loss weights of both training stages (``train.*.weights``).
WEIGHT_ABLATIONS = {"hic_kl1": {"hic_kl": 1.0}, "hic_kl20": {"hic_kl": 20.0}}
OLD = ("sampled_keys", "decay_head", "no_loadings", "full_key_scale", "latent32")
#: Variants that are several ablations at once.
COMBINED = {"old": OLD, "near_thin": ("near_pcs", "thin30"), "log1p_all_unthinned": ("log1p_all", "unthinned")}
PERMUTATIONS = 200
#: Training cells whose types a new cell's type is voted from (label transfer).
TRANSFER_NEIGHBOURS = 15
#: Leading principal axes a representation's tuned label transfer may keep (and its width).
TRANSFER_AXES = (2, 3, 5, 10, 20)


# ------------------------------------------------------------------ data
def prepare(src: Path, work: Path, resolution: int, strata: int) -> Path:
    """The product's prepare commands on the cells of ``src`` (``cells.tsv``, pairs paths
    relative to it, ``chrom.sizes``): the data folder."""
    cells = pd.read_csv(src / "cells.tsv", sep="\t")
    cells["pairs"] = [str(src / p) for p in cells["pairs"]]
    return prepare_sheet(cells, src / "chrom.sizes", work, resolution, strata)


def prepare_sheet(cells: pd.DataFrame, sizes: Path, work: Path, resolution: int, strata: int, bin_args: tuple = ()) -> Path:
    """``ampflow bin-cells``, ``qc-cells``, ``pseudobulk``, ``strata`` and ``graph`` on the
    cell sheet ``cells`` (absolute pairs paths): the data folder under ``work``."""
    data = work / "data"
    if (data / "graph").exists():
        return data
    work.mkdir(parents=True, exist_ok=True)
    sheet = work / "cells.tsv"
    cells.to_csv(sheet, sep="\t", index=False)
    scool, qc, mcool = work / "binned.scool", work / "qc" / "cells.tsv", work / "pseudobulk.mcool"
    steps = [
        ["bin-cells", "--sheet", sheet, "--chromsizes", sizes, "--resolutions", resolution, "--out-scool", scool,
         "--stats", work / "qc" / "contacts.tsv", "--cache-dir", work / "cache", "--threads", "2", *bin_args],
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


def input_pca(data, fit: np.ndarray, model_cfg: dict, n_comps: int = 20) -> np.ndarray:
    """PCA of the Hi-C encoder's own input (the template's transform and strata, its band
    means from the ``fit`` cells) of ``data`` (:func:`load_paired`), axes fitted on those
    cells: what a model that learnt nothing beyond its input would score. (Its own
    ``hic_pcs`` projection is left out: this PCA is that projection.) A reach in base
    pairs is the stratum it is at the data's resolution, as training resolves it."""
    cfg = ModelConfig.from_dict(model_cfg).at_resolution(data.meta.get("hic", {}).get("resolution"))
    transform = HiCInput(data.feature_stratum, data.n_strata, cfg.hic_band_weight, cfg.hic_diagonal, cfg.hic_transform, max_stratum=cfg.hic_max_stratum)
    transform = transform.double()
    transform.fit(data.stratum_totals(np.flatnonzero(fit)))
    x = transform(torch.as_tensor(data.hic.toarray(), dtype=torch.float64)).numpy()
    return pca_fit_transform(x, fit, n_comps)


# ------------------------------------------------------------------ scores
def kmeans(z: np.ndarray, k: int) -> np.ndarray:
    return KMeans(k, n_init=KMEANS_STARTS, random_state=0).fit_predict(np.asarray(z, dtype=np.float64))


def ari_with_control(labels: np.ndarray, clusters: np.ndarray, seed: int = 0) -> tuple[float, float]:
    """ARI, and the 95th percentile of the ARI against permuted labels (chance)."""
    rng = np.random.default_rng(seed)
    null = [adjusted_rand_score(rng.permutation(labels), clusters) for _ in range(PERMUTATIONS)]
    return float(adjusted_rand_score(labels, clusters)), float(np.percentile(null, 95))


def transfer_accuracy(
    z_train: np.ndarray, y_train: np.ndarray, z_new: np.ndarray, y_new: np.ndarray, seed: int = 0, permutations: int = PERMUTATIONS
) -> tuple[float, float]:
    """Label transfer, as a reference atlas is used: each new cell takes the type most of
    its ``TRANSFER_NEIGHBOURS`` nearest training cells have (Euclidean, the coordinates as
    they are). Balanced accuracy over the new cells (the mean over types of the share of
    each type's cells given their type: 1/types by chance, whatever the types' sizes),
    and its 95th percentile with the training cells' types permuted ``permutations``
    times (chance; 0: NaN)."""

    def vote(labels):
        knn = KNeighborsClassifier(min(TRANSFER_NEIGHBOURS, len(labels))).fit(np.asarray(z_train, dtype=np.float64), labels)
        return balanced_accuracy_score(y_new, knn.predict(np.asarray(z_new, dtype=np.float64)))

    rng = np.random.default_rng(seed)
    null = [vote(rng.permutation(y_train)) for _ in range(permutations)]
    return float(vote(np.asarray(y_train))), float(np.percentile(null, 95)) if null else float("nan")


def tuned_transfer(z_train: np.ndarray, y_train: np.ndarray, batch_train: np.ndarray, z_new: np.ndarray, y_new: np.ndarray) -> tuple[float, int]:
    """Label transfer on the leading principal axes of a representation (fitted on the
    training cells), as many as the training batches alone say: each training batch's
    cells voted from the other training batches' cells, with each count of
    ``TRANSFER_AXES`` below the width and the whole width; the count with the highest
    mean balanced accuracy (ties: the fewest) is kept. So a baseline is not held to a
    width (the 20 axes of BandNorm's example) that votes worse than another would, nor is
    the latent, and the new batch's labels choose nothing. Returns the new cells'
    balanced accuracy with that count, and the count."""
    from sklearn.decomposition import PCA

    z_train, z_new = np.asarray(z_train, dtype=np.float64), np.asarray(z_new, dtype=np.float64)
    pca = PCA(random_state=0).fit(z_train)
    p_train, p_new = pca.transform(z_train), pca.transform(z_new)
    width = p_train.shape[1]
    counts = sorted({k for k in TRANSFER_AXES if k < width} | {width})
    batches = np.unique(batch_train)
    if len(batches) < 2:
        raise ValueError(f"choosing the axes needs two training batches or more, got {list(batches)}")

    def within(k):
        return np.mean([transfer_accuracy(p_train[batch_train != b, :k], y_train[batch_train != b], p_train[batch_train == b, :k],
                                          y_train[batch_train == b], permutations=0)[0] for b in batches])  # fmt: skip

    best = max(counts, key=lambda k: (within(k), -k))
    return transfer_accuracy(p_train[:, :best], y_train, p_new[:, :best], y_new, permutations=0)[0], int(best)


def score(z: np.ndarray, types: np.ndarray, batches: np.ndarray | None, held: np.ndarray) -> dict:
    """k-means (k = the number of labels) on the held-out cells and on all cells, scored
    over the labelled ones (``types`` None = unlabelled) with the shuffled-label control;
    ARI against ``batches`` over every cell of the group; and the held-out cells' types
    voted from their nearest labelled training cells (:func:`transfer_accuracy`; with
    two training batches or more, also on the leading axes they choose,
    :func:`tuned_transfer`)."""
    labelled = np.array([t is not None and t == t for t in types])
    k = len(np.unique(types[labelled]))
    out = {}
    for group, rows in (("heldout", held), ("all", np.ones_like(held))):
        c = kmeans(z[rows], k)
        lab = labelled[rows]
        ari, p95 = ari_with_control(types[rows][lab], c[lab])
        out[group] = {"ari": ari, "shuffled_p95": p95}
        if batches is not None:
            out[group]["ari_batch"] = float(adjusted_rand_score(batches[rows], c))
    ref, new = labelled & ~held, labelled & held
    out["heldout"]["transfer"], out["heldout"]["transfer_shuffled_p95"] = transfer_accuracy(z[ref], types[ref], z[new], types[new])
    if batches is not None and len(np.unique(batches[ref])) > 1:
        out["heldout"]["transfer_tuned"], out["heldout"]["transfer_tuned_axes"] = tuned_transfer(z[ref], types[ref], batches[ref], z[new], types[new])
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

        def forward(self, u, v_anchors, band_totals, on_stratum=None, cond=None):
            u_D = self.u_proj(u) if self.u_proj is not None else u
            u_load = self.loading_input(u, cond)
            w = torch.softmax(self.strata_head(u), dim=1)
            library = band_totals.sum(1)
            means = [torch.softmax(self.stratum_logits(k, u, u_D, v_anchors, u_load), dim=1) * (library * w[:, k]).unsqueeze(1)
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
def ablation_names(variant: str) -> set[str]:
    """The single ablations a variant applies (``model``: none)."""
    return set(COMBINED.get(variant, (variant,))) - {"model"}


def ablated_model(model_cfg: dict, names: set[str]) -> dict:
    """The ``model`` section with the model-setting ablations of ``names`` set."""
    model_cfg = dict(model_cfg)
    for name in sorted(names & set(CONFIG_ABLATIONS)):
        model_cfg.update(CONFIG_ABLATIONS[name])
    return model_cfg


def ablated_train(train_cfg: dict, names: set[str]) -> dict:
    """The ``train`` section with the training and loss-weight ablations of ``names``: a
    section (``early_stopping``, a stage) merged into the template's, a value set, a
    weight set in both stages' ``weights``."""
    train_cfg = dict(train_cfg)
    for name in sorted(names & set(TRAIN_ABLATIONS)):
        for key, value in TRAIN_ABLATIONS[name].items():
            train_cfg[key] = {**(train_cfg.get(key) or {}), **value} if isinstance(value, dict) else value
    for name in sorted(names & set(WEIGHT_ABLATIONS)):
        for stage in ("pretrain", "finetune"):
            stage_cfg = dict(train_cfg.get(stage) or {})
            stage_cfg["weights"] = {**(stage_cfg.get("weights") or {}), **WEIGHT_ABLATIONS[name]}
            train_cfg[stage] = stage_cfg
    return train_cfg


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


def lee_splits(a, template: dict, variants: list[str]) -> list[dict]:
    """The Lee 2019 shared cells over ``a.splits`` held-out splits: every variant against
    the baselines fitted on the same split's training cells."""
    data_dir = prepare(a.lee, a.work / "lee2019", 1_000_000, 10)
    hic = read_h5ad(data_dir / "hic.h5ad")
    sheet = pd.read_csv(a.lee / "cells.tsv", sep="\t").set_index("cell_id").loc[hic.obs_names]
    types, batches = sheet["cell_type"].to_numpy(), sheet["batch"].to_numpy()
    print(f"Lee 2019 shared cells: {hic.n_obs} cells x {hic.n_vars} features (1 Mb x 10 strata), "
          f"types {pd.Series(types).value_counts().to_dict()}, batches {pd.Series(batches).value_counts().to_dict()}")  # fmt: skip
    paired_data = load_paired(data_dir)  # read once for every split's input PCA
    rows = []
    for split in range(a.splits):
        held = holdout(hic.n_obs, split)
        fit = ~held
        baselines = (("bandnorm", bandnorm_baseline(hic, fit)[0]), ("bandnorm_nolog", bandnorm_baseline(hic, fit, log1p=False)[0]),
                     ("bandnorm_near", bandnorm_baseline(hic, fit, log1p=False, max_stratum=3)[0]),
                     ("workflow_baseline", hic_baseline(hic, fit)[0]), ("input_pca", input_pca(paired_data, fit, template.get("model") or {})))  # fmt: skip
        for name, z in baselines:
            rows.append({"split": split, "method": name, **_flat(score(z, types, batches, held))})
        rng = np.random.default_rng(split)
        shuffled = score(dict(baselines)["bandnorm"], rng.permutation(types), batches, held)
        rows.append({"split": split, "method": "bandnorm_shuffled_labels", **_flat(shuffled)})
        for variant in variants:
            names = ablation_names(variant)
            model_cfg = ablated_model(template.get("model") or {}, names)
            for seed in a.train_seeds:
                train_cfg = ablated_train({**_train_cfg(template, a), "seed": seed}, names)
                with ablated(names - set(CONFIG_ABLATIONS) - set(WEIGHT_ABLATIONS) - set(TRAIN_ABLATIONS)):
                    z, seconds, steps, lines = train_and_embed(data_dir, held, model_cfg, train_cfg, a.work / "runs" / f"{variant}-{split}-{seed}")
                rows.append({"split": split, "train_seed": seed, "method": variant, "seconds": seconds, "steps": steps,
                             **_flat(score(z, types, batches, held))})  # fmt: skip
                print(f"split {split} seed {seed} {variant}: held-out ARI {rows[-1]['heldout_ari']:.3f} (baseline {_base(rows, split, 'heldout_ari'):.3f}), "
                      f"all {rows[-1]['all_ari']:.3f} (baseline {_base(rows, split, 'all_ari'):.3f}), batch {rows[-1]['all_ari_batch']:.3f}, "
                      f"held-out label transfer {rows[-1]['heldout_transfer']:.3f} (BandNorm without its log over strata 1-3 "
                      f"{_base(rows, split, 'heldout_transfer', 'bandnorm_near'):.3f}), on the axes the batches choose "
                      f"{rows[-1].get('heldout_transfer_tuned', np.nan):.3f} ({_base(rows, split, 'heldout_transfer_tuned', 'bandnorm_near'):.3f}), "
                      f"{steps} steps in {seconds:.0f} s; {' / '.join(lines)}", flush=True)  # fmt: skip
    runs = f"{a.splits} split(s) x {len(a.train_seeds)} training seed(s)"
    _summary(rows, variants, f"Lee 2019, mean, sd and worst over {runs}; k-means with k = {len(np.unique(types))}")
    return [{**r, "dataset": "lee"} for r in rows]


def gageseq_splits(a, template: dict) -> list[dict]:
    """The labelled GAGE-seq cortex cells (chr1, broad classes; ``NA`` and ``Unk`` are
    unlabelled: trained on and embedded, not scored) over ``a.splits`` splits, the model
    against the BandNorm-style baseline. The labels come from a join the data's README
    calls an assumption: an honest figure, no threshold."""
    src = a.gageseq
    cells = pd.read_csv(src / "cells_labels.tsv", sep="\t", keep_default_na=False)
    sheet = pd.DataFrame({"cell_id": cells["cell"], "pairs": [str(src / p) for p in cells["pairs"]], "cell_type": cells["broad_class"]})
    work = a.work / "gageseq"
    work.mkdir(parents=True, exist_ok=True)
    sizes = work / "chr1.sizes"  # the files hold chr1 alone: a genome of chr1 keeps every bin populated
    sizes.write_text(next(line for line in (a.genome_sizes).read_text().splitlines() if line.split("\t")[0] == "chr1") + "\n")
    data_dir = prepare_sheet(sheet, sizes, work, 1_000_000, 10, ("--strip-prefix", "mm10_"))
    hic = read_h5ad(data_dir / "hic.h5ad")
    label = sheet.set_index("cell_id").loc[hic.obs_names, "cell_type"].to_numpy(dtype=object)
    types = np.array([t if t not in ("NA", "Unk", "") else None for t in label], dtype=object)
    print(f"\nGAGE-seq cortex: {hic.n_obs} cells x {hic.n_vars} features (1 Mb x 10 strata), "
          f"labels {pd.Series([t for t in types if t is not None]).value_counts().to_dict()}, {sum(t is None for t in types)} unlabelled")  # fmt: skip
    rows = []
    for split in range(a.splits):
        held = holdout(hic.n_obs, split)
        z, _ = bandnorm_baseline(hic, ~held)
        rows.append({"split": split, "method": "bandnorm", **_flat(score(z, types, None, held))})
        z, seconds, steps, lines = train_and_embed(
            data_dir, held, dict(template.get("model") or {}), _train_cfg(template, a), a.work / "runs" / f"gageseq-{split}"
        )
        rows.append({"split": split, "method": "model", "seconds": seconds, "steps": steps, **_flat(score(z, types, None, held))})
        print(f"split {split}: held-out ARI {rows[-1]['heldout_ari']:.3f} (baseline {_base(rows, split, 'heldout_ari'):.3f}, shuffled p95 "
              f"{rows[-1]['heldout_shuffled_p95']:.3f}), all {rows[-1]['all_ari']:.3f} (baseline {_base(rows, split, 'all_ari'):.3f}, "
              f"shuffled p95 {rows[-1]['all_shuffled_p95']:.3f}), {steps} steps in {seconds:.0f} s; {' / '.join(lines)}", flush=True)  # fmt: skip
    _summary(rows, ["model"], f"GAGE-seq, mean and sd over {a.splits} split(s); k-means with k = {len({t for t in types if t is not None})}")
    return [{**r, "dataset": "gageseq"} for r in rows]


def baselines_on_new_batch(trained_hic, new_hic) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Simple baselines on a new batch's cells: the strongest one on the Lee splits
    (``bandnorm_near``: BandNorm without its ``log1p`` over strata 1-3) fitted on the new
    batch itself (its band means, axes and centre) and fitted on the training batches'
    cells and applied to the new ones, as the model is (the new cells' features put in
    the training file's order by name, a feature they lack counting zero); and BandNorm
    itself (with its ``log1p``, strata k >= 1) fitted on the training batches the same
    way: within one batch there is no batch effect to remove, and there it is the
    stronger of the two. Returns the new cells' coordinates of each, and the training
    cells' (in ``trained_hic``'s order) of the two fitted on them."""
    on_batch, _ = bandnorm_baseline(new_hic, np.ones(new_hic.n_obs, dtype=bool), log1p=False, max_stratum=3)
    # the embed rule's own mapping of a file's columns onto the trained ones
    cols = map_columns(list(trained_hic.var_names), list(new_hic.var_names), None, "var_names")
    picked = sp.csr_matrix(cols.dense(counts_matrix(new_hic)))
    both = ad.AnnData(X=sp.vstack([counts_matrix(trained_hic), picked]).tocsr(), var=trained_hic.var.copy())
    fit = np.arange(both.n_obs) < trained_hic.n_obs
    near, _ = bandnorm_baseline(both, fit, log1p=False, max_stratum=3)
    full, _ = bandnorm_baseline(both, fit)
    new = {"bandnorm_near_on_batch": on_batch, "bandnorm_near_trained": near[~fit], "bandnorm_trained": full[~fit]}
    return new, {"bandnorm_near_trained": near[fit], "bandnorm_trained": full[fit]}


def latent_spread(z: np.ndarray, split: np.ndarray, validation_rows: np.ndarray, z_new: np.ndarray) -> dict[str, float]:
    """Mean variance per latent dimension of three groups of cells: the training batches'
    cells the model trained on (``split`` train, less early stopping's
    ``validation_rows``), the training batches' cells it never trained on (held out, and
    the validation rows), and the new batch's (``z_new``). Where the first is far wider
    than the other two, the encoder spreads the cells it trained on by what is theirs
    alone; where only the new batch is narrow, the batch itself differs. Beside each
    spread (``spread_*``), the group's :func:`effective_dims` (``dims_*``)."""
    split = np.asarray(split).astype(str)
    unseen = split == HELDOUT
    unseen[np.asarray(validation_rows, dtype=np.int64)] = True
    trained = (split == TRAIN) & ~unseen
    out = {}
    for name, rows in (("trained", z[trained]), ("unseen", z[unseen]), ("new", z_new)):
        out[f"spread_{name}"] = float(np.var(rows, axis=0).mean())
        out[f"dims_{name}"] = effective_dims(rows)
    return out


def lobo_config(template: dict, dest: Path, chromsizes: Path, threads: int, seed: int) -> dict:
    """The workflow's configuration of one held-back batch: the template's settings,
    trained on ``dest/train_cells.tsv`` and embedding ``dest/new_cells.tsv`` at 1 Mb."""
    cfg = yaml.safe_load(yaml.safe_dump(template))
    cfg.update(dataset="lobo", configs=[{"resolution": 1_000_000, "strata": 10}])
    cfg["inputs"] = {"cells": str(dest / "train_cells.tsv"), "chromsizes": str(chromsizes)}
    cfg["pseudobulk"]["resolutions"] = []
    cfg["cluster"]["gpus_per_node"] = 0  # a CPU machine
    # the new batch is what is scored: no training batch's cell is held out, so the model
    # trains on (and fits its input's axes on) the cells the baselines fit on
    cfg.setdefault("evaluate", {})["holdout"] = 0
    cfg["train"]["threads"] = threads
    cfg["train"]["seed"] = seed
    cfg["embed"] = {"new": {"cells": str(dest / "new_cells.tsv")}}
    return cfg


def leave_one_batch_out(a, template: dict) -> list[dict]:
    """Each Lee 2019 batch held back in turn: the Hi-C-only workflow (the template's
    settings) trains on the other batches, and its ``embed`` rule embeds the held-back
    batch's raw cells (``embed.{name}.cells``; no retraining, nothing fitted on them).
    Scored on the held-back batch: k-means ARI against type beside the BandNorm-style
    baseline fitted on that batch itself and the shuffled-label 95th percentile; and over
    training + held-back cells, ARI of the same k-means against batch."""
    sheet = pd.read_csv(a.lee / "cells.tsv", sep="\t")
    sheet["pairs"] = [str(a.lee / p) for p in sheet["pairs"]]
    rows = []
    print("\nLee 2019, each batch held back and embedded by a model trained on the others (the workflow, `embed`):")
    for batch, seed in ((b, s) for s in a.train_seeds for b in sorted(sheet["batch"].unique())):
        dest = a.work / "lobo" / (batch if seed == template["train"].get("seed", 0) else f"{batch}-seed{seed}")
        dest.mkdir(parents=True, exist_ok=True)
        sheet[sheet["batch"] != batch].to_csv(dest / "train_cells.tsv", sep="\t", index=False)
        sheet[sheet["batch"] == batch].to_csv(dest / "new_cells.tsv", sep="\t", index=False)
        cfg = lobo_config(template, dest, a.lee / "chrom.sizes", a.threads, seed)
        seconds = run_workflow(dest, cfg, ["results/lobo/embed/1mb_s10/new/embeddings.h5ad"])
        res = dest / "results" / "lobo"
        new = read_h5ad(res / "embed" / "1mb_s10" / "new" / "embeddings.h5ad")
        trained = read_h5ad(res / "train" / "1mb_s10" / "embeddings.h5ad")
        new_hic = read_h5ad(res / "embed" / "cells" / "new" / "1mb_s10" / "hic.h5ad")
        meta = sheet.set_index("cell_id")
        types = meta.loc[new.obs_names, "cell_type"].to_numpy()
        k = len(np.unique(meta["cell_type"]))
        c = kmeans(np.asarray(new.obsm["X_hic"]), k)
        ari, p95 = ari_with_control(types, c)
        base_z, _ = bandnorm_baseline(new_hic[new.obs_names], np.ones(new.n_obs, dtype=bool))
        base_ari, base_p95 = ari_with_control(types, kmeans(base_z, k))
        data_hic = read_h5ad(res / "data" / "1mb_s10" / "hic.h5ad")
        fitted, fitted_training = baselines_on_new_batch(data_hic, new_hic[new.obs_names])
        fitted_ari = {name: float(adjusted_rand_score(types, kmeans(z, k))) for name, z in fitted.items()}
        # label transfer from the training batches' cells (all of them: the model and the
        # baselines fitted on them alike), plain and on the axes those batches choose; the
        # chance percentile once, for the latent
        transfer_base = {}
        represented = {"latent": (trained.obsm["X_hic"], trained.obs_names, new.obsm["X_hic"])}
        represented.update({name: (z, data_hic.obs_names, fitted[name]) for name, z in fitted_training.items()})
        for name, (z, cells_of, z_new) in represented.items():
            y_ref, batch_ref = meta.loc[cells_of, "cell_type"].to_numpy(), meta.loc[cells_of, "batch"].to_numpy()
            plain = transfer_accuracy(z, y_ref, z_new, types, permutations=PERMUTATIONS if name == "latent" else 0)
            if name == "latent":
                transfer, transfer_p95 = plain
            else:
                transfer_base[f"transfer_{name}"] = plain[0]
            transfer_base[f"transfer_tuned_{name}"], transfer_base[f"transfer_tuned_axes_{name}"] = tuned_transfer(z, y_ref, batch_ref, z_new, types)
        base_dims = effective_dims(fitted["bandnorm_near_trained"])
        # early stopping's validation cells, drawn as the trainer draws them (its settings in
        # model.pt) from the training rows in the data folder's order
        run = torch.load(res / "train" / "1mb_s10" / "model.pt", map_location="cpu", weights_only=False)["train_config"]
        in_order = trained[data_hic.obs_names]
        _, validation = validation_split(training_rows(in_order.obs), EarlyStoppingConfig(**run["early_stopping"]), run["seed"])
        spread = latent_spread(np.asarray(in_order.obsm["X_hic"]), in_order.obs[SPLIT_COLUMN].to_numpy(), validation, np.asarray(new.obsm["X_hic"]))
        both = np.vstack([np.asarray(trained.obsm["X_hic"]), np.asarray(new.obsm["X_hic"])])
        cells = list(trained.obs_names) + list(new.obs_names)
        c_all = kmeans(both, k)
        ari_batch = float(adjusted_rand_score(meta.loc[cells, "batch"].to_numpy(), c_all))
        ari_all_type = float(adjusted_rand_score(meta.loc[cells, "cell_type"].to_numpy(), c_all))
        stop = next(
            (ln.strip() for ln in (dest / "logs" / "lobo" / "train.1mb_s10.log").read_text().splitlines() if "stopped after" in ln or "ran all" in ln), ""
        )
        rows.append({"dataset": "lobo", "batch": batch, "train_seed": seed, "n_new": int(new.n_obs), "n_train": int(trained.n_obs),
                     "ari": ari, "shuffled_p95": p95, "bandnorm_on_batch": base_ari, **fitted_ari,
                     "all_ari_type": ari_all_type, "all_ari_batch": ari_batch, **spread,
                     "transfer": transfer, "transfer_shuffled_p95": transfer_p95, **transfer_base,
                     "dims_bandnorm_near_trained": base_dims, "seconds": seconds})  # fmt: skip
        print(f"  {batch} (seed {seed}): {new.n_obs} new cells (trained on {trained.n_obs}): ARI {ari:.3f}, shuffled p95 {p95:.3f} "
              f"({'above' if ari > p95 else 'NOT above'}), BandNorm fitted on the batch {base_ari:.3f}, BandNorm without its log over "
              f"strata 1-3 fitted on the batch {fitted_ari['bandnorm_near_on_batch']:.3f} and on the training batches "
              f"{fitted_ari['bandnorm_near_trained']:.3f}, BandNorm fitted on the training batches {fitted_ari['bandnorm_trained']:.3f}; training + new cells: "
              f"ARI vs type {ari_all_type:.3f}, vs batch {ari_batch:.3f}; label transfer from the training batches' cells "
              f"(balanced accuracy): latent {transfer:.3f} (shuffled p95 {transfer_p95:.3f}), BandNorm without its log over strata 1-3 "
              f"{transfer_base['transfer_bandnorm_near_trained']:.3f}, BandNorm {transfer_base['transfer_bandnorm_trained']:.3f}; "
              f"on the leading axes the training batches choose: latent {transfer_base['transfer_tuned_latent']:.3f} "
              f"({transfer_base['transfer_tuned_axes_latent']} axes), BandNorm without its log over strata 1-3 "
              f"{transfer_base['transfer_tuned_bandnorm_near_trained']:.3f} ({transfer_base['transfer_tuned_axes_bandnorm_near_trained']}), "
              f"BandNorm {transfer_base['transfer_tuned_bandnorm_trained']:.3f} ({transfer_base['transfer_tuned_axes_bandnorm_trained']}); "
              f"latent variance per dimension: cells trained on "
              f"{spread['spread_trained']:.3f}, training batches' cells never trained on {spread['spread_unseen']:.3f}, new batch "
              f"{spread['spread_new']:.3f}; effective dimensions: cells trained on {spread['dims_trained']:.1f}, never trained on "
              f"{spread['dims_unseen']:.1f}, new batch {spread['dims_new']:.1f} (BandNorm without its log over strata 1-3 fitted on the "
              f"training batches: {base_dims:.1f}); workflow {seconds:.0f} s; {stop.split(': ', 1)[-1]}", flush=True)  # fmt: skip
    table = pd.DataFrame(rows)
    print(f"  over {len(table)} runs ({len(a.train_seeds)} training seed(s)): new batch ARI {table['ari'].mean():.3f} mean, "
          f"{table['ari'].min():.3f} worst; training + new cells ARI vs type {table['all_ari_type'].mean():.3f} mean; "
          f"BandNorm without its log over strata 1-3 on the new batch {table['bandnorm_near_on_batch'].mean():.3f} mean "
          f"({table['bandnorm_near_on_batch'].min():.3f} worst) fitted on it, {table['bandnorm_near_trained'].mean():.3f} "
          f"({table['bandnorm_near_trained'].min():.3f}) fitted on the training batches; BandNorm fitted on the training batches "
          f"{table['bandnorm_trained'].mean():.3f} ({table['bandnorm_trained'].min():.3f}); label transfer (balanced accuracy): latent "
          f"{table['transfer'].mean():.3f} ({table['transfer'].min():.3f} worst), BandNorm without its log over strata 1-3 "
          f"{table['transfer_bandnorm_near_trained'].mean():.3f} ({table['transfer_bandnorm_near_trained'].min():.3f}), BandNorm "
          f"{table['transfer_bandnorm_trained'].mean():.3f} ({table['transfer_bandnorm_trained'].min():.3f}); on the axes the training "
          f"batches choose: latent {table['transfer_tuned_latent'].mean():.3f} ({table['transfer_tuned_latent'].min():.3f}), BandNorm "
          f"without its log over strata 1-3 {table['transfer_tuned_bandnorm_near_trained'].mean():.3f} "
          f"({table['transfer_tuned_bandnorm_near_trained'].min():.3f}), BandNorm {table['transfer_tuned_bandnorm_trained'].mean():.3f} "
          f"({table['transfer_tuned_bandnorm_trained'].min():.3f}); latent variance per dimension: cells "
          f"trained on {table['spread_trained'].mean():.3f}, never trained on {table['spread_unseen'].mean():.3f}, new batch "
          f"{table['spread_new'].mean():.3f}; effective dimensions: cells trained on {table['dims_trained'].mean():.1f}, never "
          f"trained on {table['dims_unseen'].mean():.1f}, new batch {table['dims_new'].mean():.1f} (the baseline: "
          f"{table['dims_bandnorm_near_trained'].mean():.1f})")  # fmt: skip
    return rows


def hires_rna(a) -> list[dict]:
    """The RNA latent on the real HiRES brain RNA (399 cells), trained by the workflow of
    ``scripts/negative_control.py`` with the template's model and training (``--defaults``;
    its Hi-C carries no information, so the RNA latent is what the RNA side learnt), once
    per seed of ``--hires-seeds`` (each its own subsample, split and training seed):
    k-means and Leiden ARI against the inferred labels beside the scanpy-style RNA
    baseline and the shuffled-label control; and the control's own acceptance (held-out
    FOSCTTM at chance, joint not below the RNA latent)."""
    sys.path.insert(0, str(REPO / "scripts"))
    import negative_control as nc

    rows = []
    for seed in a.hires_seeds:
        settings = nc.Settings(seed=seed, defaults=True)
        work = a.work / f"negctl-s{seed}"
        t0 = time.perf_counter()
        result = nc.run_control(work, a.shared, settings, log=lambda m: None)
        seconds = time.perf_counter() - t0
        scores = json.loads((work / "results" / nc.DATASET / "eval" / settings.cfg / "scores.json").read_text())
        print(f"\nHiRES brain RNA, seed {seed} ({settings.label_column}, labels inferred from the RNA: partly circular), k-means with k = labels:")
        for group in ("heldout", "train"):
            methods = scores["groups"][group]["methods"]
            for method in ("rna_latent", "rna_baseline", "joint"):
                km = methods[method]["kmeans"]
                rows.append({"dataset": "hires", "group": group, "seed": seed, "method": method, "ari": km["ari"],
                             "shuffled_p95": km["ari_shuffled_p95"], "leiden_ari": methods[method]["ari"], "seconds": seconds})  # fmt: skip
                print(f"  {group:<8} {method:<13} ARI {km['ari']:.3f} (shuffled p95 {km['ari_shuffled_p95']:.3f}; Leiden {methods[method]['ari']:.3f})")
        print(nc.table(result, settings))
        print(f"  negative control: {'PASS' if result.passed else 'FAIL: ' + '; '.join(result.failures())} ({seconds:.0f} s)")
        rows.append({"dataset": "hires", "seed": seed, "method": "negative_control", "passed": result.passed, "seconds": seconds})
    print(f"\nHiRES brain RNA, held-out cells over seeds {','.join(map(str, a.hires_seeds))} (mean +- sd, worst):")
    for method in ("rna_latent", "rna_baseline", "joint"):
        mine = [r for r in rows if r.get("group") == "heldout" and r["method"] == method]
        figures = [f"{what} {np.mean(v):.3f} +- {np.std(v):.3f} ({min(v):.3f})" for what, v in
                   (("k-means", [r["ari"] for r in mine]), ("Leiden", [r["leiden_ari"] for r in mine]))]  # fmt: skip
        print(f"  {method:<13} " + "; ".join(figures))
    return rows


def run_workflow(dest: Path, config: dict, targets: list[str]) -> float:
    """Snakemake with this checkout's workflow and ``config`` in ``dest``: the seconds."""
    import shutil
    import subprocess

    for name in ("workflow", "config", "profiles", "envs"):
        shutil.copytree(REPO / name, dest / name, dirs_exist_ok=True)
    (dest / "config" / "bench.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    t0 = time.perf_counter()
    with open(dest / "snakemake.log", "w") as log:
        proc = subprocess.run([str(bin_dir / "snakemake"), *targets, "--cores", "2", "--profile", "profiles/local", "--configfile", "config/bench.yaml"],
                              cwd=dest, env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    if proc.returncode != 0:
        sys.exit(f"{dest}: snakemake exited {proc.returncode}; see {dest / 'snakemake.log'}")
    return time.perf_counter() - t0


SECTIONS = ("lee", "lobo", "gageseq", "hires")
#: Rows of the figure that are the model's latents (the rest are baselines).
LATENTS = ("rna_latent", "hic_latent", "joint")


def figure_bars(rows: list[dict]) -> list[tuple[str, list[tuple[str, list[float]]], list[float]]]:
    """What the figure draws, per panel: its title, (method, ARIs over runs) pairs and the
    shuffled-label 95th percentiles of those runs (the chance band)."""
    table = pd.DataFrame(rows)
    panels = []
    if "dataset" not in table:
        return panels
    lee = table[table.dataset == "lee"]
    for group, title in (("heldout", "Lee 2019, held-out cells"), ("all", "Lee 2019, all cells")):
        if len(lee):
            methods = [m for m in lee.method.unique() if m != "bandnorm_shuffled_labels"]
            bars = [(m, lee[lee.method == m][f"{group}_ari"].dropna().tolist()) for m in methods]
            panels.append((title, bars, lee[f"{group}_shuffled_p95"].dropna().tolist()))
    lobo = table[table.dataset == "lobo"]
    if len(lobo):
        bars = [("model (embed)", lobo["ari"].tolist()), ("bandnorm on the batch", lobo["bandnorm_on_batch"].tolist())]
        # rows of an older run lack the later baselines: a bar is drawn over the runs that have it
        for column, name in (
            ("bandnorm_near_trained", "bandnorm_near, fitted on the training batches"),
            ("bandnorm_trained", "bandnorm, fitted on the training batches"),
        ):
            if column in lobo:
                bars.append((name, lobo[column].dropna().tolist()))
        panels.append(("Lee 2019, each batch new to the model", bars, lobo["shuffled_p95"].tolist()))
    gage = table[table.dataset == "gageseq"]
    if len(gage):
        bars = [(m, gage[gage.method == m]["heldout_ari"].tolist()) for m in gage.method.unique()]
        panels.append(("GAGE-seq cortex, held-out cells", bars, gage["heldout_shuffled_p95"].dropna().tolist()))
    hires = table[(table.dataset == "hires") & (table.get("group") == "heldout")] if "group" in table else table.iloc[:0]
    if len(hires):
        bars = [(m, hires[hires.method == m]["ari"].tolist()) for m in hires.method.unique()]
        panels.append(("HiRES brain RNA, held-out cells", bars, hires["shuffled_p95"].tolist()))
    return panels


def write_figure(rows: list[dict], path: Path) -> None:
    """One panel per dataset: k-means ARI of the latent and the baselines (bar = mean,
    dots = runs) over the shuffled-label 95th percentile (grey band: chance)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = figure_bars(rows)
    if not panels:
        return
    fig = Figure(figsize=(4.2 * len(panels), 4.0), layout="constrained")
    FigureCanvasAgg(fig)
    for i, (title, bars, chance) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        ax.axhspan(-0.05, max(chance) if chance else 0.0, color="0.85", label="shuffled labels, 95th pct")
        for x, (name, values) in enumerate(bars):
            ax.bar(x, np.mean(values) if values else 0.0, color="C0" if name.startswith("model") or name in LATENTS else "C7", alpha=0.8)
            ax.plot([x] * len(values), values, "k.", ms=4)
        ax.set_xticks(range(len(bars)), [name for name, _ in bars], rotation=40, ha="right", fontsize=8)
        ax.set_ylim(-0.05, 1.0)
        ax.set_ylabel("k-means ARI against cell type")
        ax.set_title(title, fontsize=9)
        if i == 0:
            ax.legend(fontsize=7, loc="upper right")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shared", type=Path, default=SHARED, help="the shared real-data folder")
    ap.add_argument(
        "--lee",
        type=Path,
        help="the Lee 2019 folder of sections lee and lobo (default: the shared folder's "
        "schic/lee2019_pfc_chr1, 174 cells; scripts/lee2019_from_bandnorm.py writes all 400)",
    )
    ap.add_argument("--work", type=Path, default=Path("/tmp/ampflow-bench-science"))
    ap.add_argument("--config", type=Path, default=REPO / "config" / "config.yaml", help="model and train settings (the template)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {','.join(SECTIONS)}")
    ap.add_argument("--splits", type=int, default=5)
    ap.add_argument("--train-seeds", default="0", help="comma-separated train.seed values run on every split (section lee) and batch (section lobo)")
    ap.add_argument("--hires-seeds", default="0,1,2,3,4", help="comma-separated negative-control seeds (section hires)")
    ap.add_argument("--ablations", default="model", help=f"comma-separated, of {','.join(ABLATIONS)} (section lee)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--figure", type=Path, help="write the figure (latent vs baselines per dataset, chance band) here")
    ap.add_argument("--from-json", type=Path, nargs="+", help="draw --figure from these --json-out files, running nothing")
    a = ap.parse_args(argv)
    a.lee = a.lee or a.shared / "schic" / "lee2019_pfc_chr1"
    a.gageseq = a.shared / "schic" / "gageseq_cortex_chr1"
    a.genome_sizes = a.shared / "annotation" / "mm10.chrom.sizes"
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if a.from_json:
        rows = [r for f in a.from_json for r in json.loads(f.read_text())]
        write_figure(rows, a.figure or Path("bench_science.png"))
        return 0
    if not (a.lee / "cells.tsv").is_file():
        print(f"skipped: {a.lee} not present")
        return 0
    variants = [v.strip() for v in a.ablations.split(",") if v.strip()]
    a.train_seeds = [int(v) for v in a.train_seeds.split(",") if v.strip()]
    a.hires_seeds = [int(v) for v in a.hires_seeds.split(",") if v.strip()]
    sections = [v.strip() for v in a.sections.split(",") if v.strip()]
    for given, known, what in ((variants, ABLATIONS, "ablation"), (sections, SECTIONS, "section")):
        unknown = sorted(set(given) - set(known))
        if unknown:
            ap.error(f"unknown {what}(s) {unknown}; known: {', '.join(known)}")
    template = yaml.safe_load(a.config.read_text())
    rows = []
    if "lee" in sections:
        rows += lee_splits(a, template, variants)
    if "lobo" in sections:
        rows += leave_one_batch_out(a, template)
    if "gageseq" in sections:
        rows += gageseq_splits(a, template)
    if "hires" in sections:
        rows += hires_rna(a)
    if a.json_out:
        a.json_out.write_text(json.dumps(rows, indent=1, default=str))
    if a.figure:
        write_figure(rows, a.figure)
    return 0


def _train_cfg(template: dict, a) -> dict:
    return {**(template.get("train") or {}), "threads": a.threads, "device": "cpu", "checkpoint_every": 100_000}


def _summary(rows: list[dict], variants: list[str], title: str) -> None:
    table = pd.DataFrame(rows)
    named = ("heldout_ari", "heldout_shuffled_p95", "heldout_transfer", "heldout_transfer_shuffled_p95", "heldout_transfer_tuned", "all_ari",
             "all_shuffled_p95", "all_ari_batch")  # fmt: skip
    cols = [c for c in (*named, "seconds", "steps") if c in table]
    summary = table.groupby("method", sort=False)[cols].agg(["mean", "std", "min"])
    pd.set_option("display.width", 250)
    print(f"\n{title}; shuffled = 95th percentile of {PERMUTATIONS} label permutations")
    print(summary.round(3).to_string())
    base = table[table.method == "bandnorm"].set_index("split")
    for variant in variants:
        runs = table[table.method == variant]
        for group in ("heldout", "all"):
            # each run against the baseline fitted on its own split's training cells
            gaps = runs[f"{group}_ari"].to_numpy() - base.loc[runs["split"], f"{group}_ari"].to_numpy()
            print(
                f"{variant} {group}: latent - BandNorm baseline = {gaps.mean():+.3f} mean, {gaps.min():+.3f} worst run "
                f"({len(gaps)} runs; {int((gaps < -0.05).sum())} below the baseline - 0.05)"
            )


def _flat(scores: dict) -> dict:
    return {f"{g}_{k}": v for g, d in scores.items() for k, v in d.items()}


def _base(rows: list[dict], split: int, key: str, method: str = "bandnorm") -> float:
    return next(r.get(key, np.nan) for r in rows if r["split"] == split and r["method"] == method)


if __name__ == "__main__":
    sys.exit(main())
