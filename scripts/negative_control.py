#!/usr/bin/env python
"""Real-data negative control: real brain RNA paired with Hi-C that carries no information.

The 399 cells of the real HiRES brain RNA matrix (GEO GSE223917) are each paired with
an independent, seeded binomial subsample (default 15%) of the contacts of the ONE real
HiRES embryo cell (GSM6998595). Every cell's Hi-C is then a draw from the same
distribution, independent of its RNA: nothing in it can tell which RNA profile is its
partner. The real workflow (``snakemake`` with the project's Snakefile) runs on this
dataset through QC, the held-out split, binning, strata, RNA, graph, profile, plan,
training (attention off, few epochs) and ``ampflow evaluate``. What it must show:

1. held-out FOSCTTM within ``0.5 +- 3 / sqrt(12 n)`` for ``n`` held-out cells. When
   nothing pairs, one cell's FOSCTTM is uniform on [0, 1] (variance 1/12), so the mean
   over ``n`` cells lies there unless the alignment has learnt something it cannot
   know (it memorised the training pairs, or a real signal leaks, see below);
2. joint ARI >= the RNA latent's ARI - 0.05 on held-out cells: a modality without
   information must not dilute the joint embedding.

The printed table also holds the training cells' FOSCTTM (computed here from
``embeddings.h5ad``: ``scores.json`` has none for them), the shuffled-pairing control
and, as a leak check, the Spearman correlation between each cell's Hi-C depth and
its RNA UMIs (near 0 by construction: the subsample depths are drawn independently
of the RNA).

Labels: the ``cluster_label`` column of ``GSE223917_HiRES_brain.inferred_labels.tsv``
(see ``--label-column``). They are inferred from the RNA itself, so RNA-based scores
against them are partly circular; here they only compare the joint latent with the
RNA latent, which the circularity affects alike.

Examples::

    python scripts/negative_control.py                         # report only, exit 0
    python scripts/negative_control.py --check                 # exit 1 when a condition fails
    python scripts/negative_control.py --work /tmp/nc --keep --epochs 40 --resolution 2000000

Without ``--work`` the dataset and results go to a temporary folder removed at the end
(kept with ``--keep``). The data folder is found as ``$AMPFLOW_SHARED_DATA``, then
``../shared/data`` beside the repository (or ``--data-dir``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# this checkout's package, here and (through PYTHONPATH, see run_workflow) in every job
if str(REPO / "src") not in sys.path:
    sys.path.insert(0, str(REPO / "src"))
CELL_PAIRS = "hires/GSM6998595_GasaE751001.pairs.gz"
RNA = "hires/GSE223917_HiRES_brain.rna.umicount.tsv.gz"
LABELS = "hires/GSE223917_HiRES_brain.inferred_labels.tsv"
GENES = "annotation/mm10_ensembl96_genes.bed.gz"
CHROMSIZES = "annotation/mm10.chrom.sizes"
REQUIRED = (CELL_PAIRS, RNA, LABELS, GENES, CHROMSIZES)
DATASET = "negctl"
#: The acceptance's allowance for the joint latent's ARI below the RNA latent's.
ARI_SLACK = 0.05
METHODS = ("joint", "rna_latent", "hic_latent", "rna_baseline", "hic_baseline")


@dataclass
class Settings:
    """One configuration of the control; the defaults run in 1.5 to 2.5 minutes on 2 CPU cores."""

    fraction: float = 0.15
    seed: int = 0
    # 2 Mb, 8 strata, 1000 genes: 93 s for the whole control on 2 cores shared with
    # other jobs; 1 Mb, 10 strata, 2000 genes took 333 s there (then with two torch threads)
    resolution: int = 2_000_000
    strata: int = 8
    n_top_genes: int = 1000
    # pretrain + finetune: 90 passes over the training cells (900 steps, about a minute).
    # After the 18 of the first report the RNA latent itself was unsettled (held-out ARI
    # 0.22-0.75 over seeds and thread counts against 0.78 for the RNA baseline), so the
    # comparison of the joint with it read noise
    pretrain_epochs: int = 80
    finetune_epochs: int = 10
    # cluster_label, not marker_label: the majority marker label of a Leiden cluster is
    # steadier than one cell's argmax of module scores (sparse cells flip between close
    # scores), and its composition (Ex 265, In 90, Oli 24, Ast 20) is near HiGLUE's
    # published one for these cells (Ex 259, In 99, Ast 20, Oli 20)
    label_column: str = "cluster_label"
    cores: int = 2
    # off: the control asks whether the alignment memorises, which attention does not
    # change; on (the model default) times training at the real shape
    attention: bool = False
    #: leave the model keys and every train key but the seed and the threads out: the
    #: schema's defaults, which equal the template's (tests/test_config.py), so the
    #: control trains what a user's config.yaml trains (epochs and attention above unused)
    defaults: bool = False

    @property
    def cfg(self) -> str:
        from ampflow.io.genome import resolution_label

        return f"{resolution_label(self.resolution)}_s{self.strata}"


@dataclass
class Result:
    """What the control measured (see :func:`summarise`)."""

    n_heldout: int
    n_train: int
    foscttm_heldout: float
    foscttm_train: float
    shuffled_heldout: float
    ari: dict
    tolerance: float
    depth_umi_spearman: float
    #: the same Leiden ARIs on the training cells (more cells: a steadier figure)
    ari_train: dict = field(default_factory=dict)
    wall_s: dict = field(default_factory=dict)

    @property
    def foscttm_at_chance(self) -> bool:
        return abs(self.foscttm_heldout - 0.5) <= self.tolerance

    @property
    def joint_not_diluted(self) -> bool:
        joint, rna = self.ari.get("joint"), self.ari.get("rna_latent")
        return joint is not None and rna is not None and joint >= rna - ARI_SLACK

    @property
    def passed(self) -> bool:
        return self.foscttm_at_chance and self.joint_not_diluted

    def failures(self) -> list[str]:
        """The acceptance conditions that failed, in words (empty when both hold)."""
        out = []
        if not self.foscttm_at_chance:
            out.append(f"held-out FOSCTTM {self.foscttm_heldout:.3f} outside the chance band 0.5 +- {self.tolerance:.3f} ({self.n_heldout} cells)")
        if not self.joint_not_diluted:
            out.append(f"joint ARI {_fmt(self.ari.get('joint'))} < RNA latent ARI {_fmt(self.ari.get('rna_latent'))} - {ARI_SLACK}")
        return out


def find_data(data_dir=None) -> Path | None:
    """The shared real-data folder holding every file the control reads, or None."""
    env = os.environ.get("AMPFLOW_SHARED_DATA")
    if data_dir:  # asked for: that folder or none, never another one silently
        cands = [Path(data_dir)]
    else:
        cands = ([Path(env)] if env else []) + [REPO.parent / "shared" / "data"]
    for d in cands:
        if all((d / rel).is_file() for rel in REQUIRED):
            return d
    return None


def tool(name: str) -> str:
    """A console script next to this interpreter first (the project's venv), then on PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        sys.exit(f"negative_control: {name} not found next to {sys.executable} or on PATH")
    return found


# ------------------------------------------------------------------ dataset
def _write_gz_atomic(path: Path, text_chunks) -> None:
    tmp = path.with_name(f".tmp-{path.name}")
    # level 1: 399 files of ~20k contacts; the workflow reads them once
    with gzip.open(tmp, "wt", compresslevel=1) as fh:
        for chunk in text_chunks:
            fh.write(chunk)
    os.replace(tmp, path)


def control_config(data: Path, settings: Settings) -> dict:
    """The control's own complete workflow configuration, reading the inputs in ``data``."""
    config = {
        "dataset": DATASET,
        "inputs": {
            "cells": "resources/cells.tsv",
            # read where they lie: the matrix (fractional counts, rounded half-up by the
            # workflow and reported in rna.h5ad) and the Ensembl BED, whose columns
            # (chrom start0 end symbol ensembl_id strand, '#' header) ampflow reads as is
            "rna": str(data / RNA),
            "genes": str(data / GENES),
            "chromsizes": str(data / CHROMSIZES),
        },
        "configs": [{"resolution": settings.resolution, "strata": settings.strata}],
        "rna": {"rounding": "half_up", "n_top_genes": settings.n_top_genes},
        # the graph reads the pseudobulk at the training resolution only
        "pseudobulk": {"balance": True, "resolutions": []},
        "train": {
            "seed": settings.seed,
            "batch_size": 32,
            # one torch thread: on cores shared with other jobs two spinning OpenMP threads
            # ran 40x slower (0.3 against 12 steps/s), one loses little when idle
            "threads": 1,
            "device": "cpu",
            "pretrain": {"epochs": settings.pretrain_epochs},
            "finetune": {"epochs": settings.finetune_epochs},
        },
        "model": {"attention": settings.attention},
        # one CPU process with room to spare: the plan is plain single-process training
        "amp": {"devices": 1, "device_memory_gb": 16.0},
        "evaluate": {"label_key": "cell_type", "holdout": 0.2, "seed": settings.seed},
        "threads": settings.cores,
    }
    if settings.defaults:
        config["train"] = {key: config["train"][key] for key in ("seed", "threads")}
        del config["model"]
    return config


def build_dataset(work: Path, data: Path, settings: Settings) -> dict:
    """Write the cell sheet, one subsampled ``.pairs.gz`` per RNA cell and the config.

    Each cell keeps every contact of the embryo cell independently with probability
    ``settings.fraction``, from its own generator (``SeedSequence([seed, i])``), so the
    cells' Hi-C are independent draws of one distribution, and their depths too.

    Returns
    -------
    dict
        ``cells`` (ids in RNA-matrix order), ``contacts`` (kept per cell).
    """
    import numpy as np
    import pandas as pd
    import yaml

    with gzip.open(data / RNA, "rt") as fh:
        cells = fh.readline().rstrip("\n").split("\t")[1:]
    labels = pd.read_csv(data / LABELS, sep="\t", index_col="cell_id")
    missing = sorted(set(cells) - set(labels.index))
    if missing:
        sys.exit(f"negative_control: {len(missing)} RNA cells without a label, e.g. {missing[:3]}")

    header, body = [], []
    with gzip.open(data / CELL_PAIRS, "rt") as fh:
        for line in fh:
            (header if line.startswith("#") else body).append(line)
    head = "".join(header)
    body = np.array(body, dtype=object)

    pairs_dir = work / "resources" / "pairs"
    pairs_dir.mkdir(parents=True, exist_ok=True)
    kept = []
    rows = []
    for i, cell in enumerate(cells):
        rng = np.random.default_rng(np.random.SeedSequence([settings.seed, i]))
        keep = rng.random(len(body)) < settings.fraction
        kept.append(int(keep.sum()))
        path = pairs_dir / f"{cell}.pairs.gz"
        _write_gz_atomic(path, [head, "".join(body[keep])])
        rows.append((cell, str(path.relative_to(work)), labels.loc[cell, settings.label_column]))
    sheet = pd.DataFrame(rows, columns=["cell_id", "pairs", "cell_type"])
    tmp = work / "resources" / ".tmp-cells.tsv"
    sheet.to_csv(tmp, sep="\t", index=False)
    os.replace(tmp, work / "resources" / "cells.tsv")

    config = control_config(data, settings)
    (work / "config").mkdir(exist_ok=True)
    tmp = work / "config" / ".tmp-config.yaml"
    tmp.write_text(yaml.safe_dump(config, sort_keys=False))
    os.replace(tmp, work / "config" / "config.yaml")
    return {"cells": cells, "contacts": kept}


# ------------------------------------------------------------------ workflow
#: Seconds between the progress lines printed while the workflow runs.
PROGRESS_EVERY_S = 20.0


def latest_progress(work: Path) -> str | None:
    """The last line of the rule log written most recently under ``work/logs`` (while the
    model trains, the trainer's steps, rate and ETA), named by its log; None before any."""
    try:
        logs = [p for p in (work / "logs").rglob("*.log") if p.is_file()] if (work / "logs").is_dir() else []
        if not logs:
            return None
        newest = max(logs, key=lambda p: p.stat().st_mtime)
        text = newest.read_text(errors="replace")
    except OSError:  # a log replaced while it was looked at: the next tick reads it
        return None
    # the profiler's own stage markers (torch's CPU memory measurement) say nothing of progress
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith(("USDT:", "STAGE:"))]
    return f"{newest.relative_to(work / 'logs')}: {lines[-1]}" if lines else None


def run_workflow(work: Path, settings: Settings, log=print, every: float = PROGRESS_EVERY_S) -> None:
    """``snakemake`` up to this configuration's ``scores.json``, in ``work``.

    ``work/config/config.yaml`` is this control's own complete configuration, given with
    ``--configfile``: the Snakefile then reads no other config file (no demo inputs, no
    FASTA extraction inputs). Only the scores are asked for: no report figures, no
    extraction. Snakemake's output goes to ``work/snakemake.log``; every ``every`` seconds
    the newest rule log's last line is passed to ``log`` (:func:`latest_progress`), so a
    run of minutes is never silent.
    """
    target = f"results/{DATASET}/eval/{settings.cfg}/scores.json"
    cmd = [
        tool("snakemake"), "--snakefile", str(REPO / "workflow" / "Snakefile"), "--directory", str(work),
        "--configfile", str(work / "config" / "config.yaml"), "--cores", str(settings.cores),
        "--rerun-incomplete", "--show-failed-logs", target,
    ]  # fmt: skip
    # the tools this interpreter's venv installs first (ampflow, torchrun), and this
    # checkout's package for every job: PYTHONPATH is inherited by the rules' shells
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    src = str(REPO / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != src]])
    log(f"  running: {' '.join(cmd)}")
    out = work / "snakemake.log"
    t0 = time.perf_counter()
    with open(out, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=fh, stderr=subprocess.STDOUT, text=True)
        while True:
            try:
                proc.wait(timeout=every)
                break
            except subprocess.TimeoutExpired:
                log(f"  [{time.perf_counter() - t0:.0f} s] {latest_progress(work) or 'snakemake started'}")
    if proc.returncode != 0:
        raise RuntimeError(f"snakemake failed (exit {proc.returncode}); log {out}:\n{out.read_text(errors='replace')[-4000:]}")


# ------------------------------------------------------------------ scores
def summarise(work: Path, settings: Settings) -> Result:
    """The figures of the table from ``scores.json``, ``embeddings.h5ad`` and the QC table."""
    import anndata as ad
    import pandas as pd
    from scipy.stats import spearmanr

    from ampflow.evaluate.clusters import aligned_latents
    from ampflow.evaluate.controls import chance_tolerance
    from ampflow.evaluate.foscttm import foscttm

    res = work / "results" / DATASET
    scores = json.loads((res / "eval" / settings.cfg / "scores.json").read_text())
    held = scores["groups"]["heldout"]
    emb = ad.read_h5ad(res / "train" / settings.cfg / "embeddings.h5ad")
    train = (emb.obs["split"] == "train").to_numpy()
    # scores.json scores alignment on held-out cells only; the training cells' FOSCTTM
    # is what shows memorisation (low there, chance on held-out cells); in the aligned
    # dimensions, as scores.json compares them
    x_rna, x_hic = aligned_latents(emb)
    fos_train = foscttm(x_rna[train], x_hic[train])
    qc = pd.read_csv(res / "qc" / "cells.tsv", sep="\t", index_col="cell_id")
    passing = qc[qc["pass"].astype(bool)]
    rho = float(spearmanr(passing["total"], passing["rna_umis"]).statistic)
    n = int(held["n_cells"])
    return Result(
        n_heldout=n,
        n_train=int(train.sum()),
        foscttm_heldout=float(held["foscttm"]["foscttm"]),
        foscttm_train=float(fos_train),
        shuffled_heldout=float(held["shuffled_control"]["foscttm"]),
        ari=_aris(held),
        ari_train=_aris(scores["groups"].get("train") or {}),
        tolerance=chance_tolerance(n),
        depth_umi_spearman=rho,
    )


def _aris(group: dict) -> dict:
    methods = group.get("methods") or {}
    return {m: (methods[m] or {}).get("ari") if methods.get(m) else None for m in METHODS}


def _fmt(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def _training(settings: Settings) -> str:
    if settings.defaults:
        return "the template's model and training (the schema's defaults)"
    return f"attention {'on' if settings.attention else 'off'}, {settings.pretrain_epochs}+{settings.finetune_epochs} epochs"


def table(r: Result, settings: Settings) -> str:
    """The printed report."""
    lines = [
        f"Negative control: real HiRES brain RNA + uninformative Hi-C ({settings.fraction:.0%} subsamples of one embryo cell)",
        (f"  configuration {settings.cfg}, {_training(settings)}, {settings.n_top_genes} HVGs, labels {settings.label_column}, seed {settings.seed}"),
        f"  cells: {r.n_heldout} held-out, {r.n_train} training",
        (f"  FOSCTTM held-out        {r.foscttm_heldout:.3f}   chance band 0.5 +- {r.tolerance:.3f} = [{0.5 - r.tolerance:.3f}, {0.5 + r.tolerance:.3f}]"),
        f"  FOSCTTM training        {r.foscttm_train:.3f}   (memorised pairs read low here)",
        f"  FOSCTTM shuffled (held-out, chance) {r.shuffled_heldout:.3f}",
        f"  Hi-C depth vs RNA UMIs  Spearman {r.depth_umi_spearman:+.3f}   (independent by construction)",
        f"  ARI vs {settings.label_column}  held-out  training",
    ]
    lines += [f"    {m:<13}     {_fmt(r.ari[m]):>8}  {_fmt(r.ari_train.get(m)):>8}" for m in METHODS]
    lines += [
        f"  [{'PASS' if r.foscttm_at_chance else 'FAIL'}] held-out FOSCTTM within 0.5 +- 3/sqrt(12 n)",
        (f"  [{'PASS' if r.joint_not_diluted else 'FAIL'}] joint ARI {_fmt(r.ari['joint'])} >= RNA latent ARI {_fmt(r.ari['rna_latent'])} - {ARI_SLACK}"),
    ]
    if r.wall_s:
        lines.append("  wall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in r.wall_s.items()))
    return "\n".join(lines)


def run_control(work: Path, data: Path, settings: Settings, log=print) -> Result:
    """Build the dataset in ``work``, run the workflow, and summarise: the whole control."""
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    built = build_dataset(work, data, settings)
    t1 = time.perf_counter()
    log(f"  dataset: {len(built['cells'])} cells, {sum(built['contacts']) / len(built['contacts']):,.0f} contacts each on average")
    run_workflow(work, settings, log=log)
    t2 = time.perf_counter()
    result = summarise(work, settings)
    result.wall_s = {"dataset": t1 - t0, "workflow": t2 - t1, "total": time.perf_counter() - t0}
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Settings()
    p.add_argument("--work", type=Path, help="folder for the dataset and results (default: a temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder")
    p.add_argument("--data-dir", type=Path, help="the shared real-data folder (default: found, see above)")
    p.add_argument("--check", action="store_true", help="exit 1 when an acceptance condition fails")
    p.add_argument(
        "--fraction",
        type=float,
        default=d.fraction,
        help=f"share of the embryo cell's contacts per cell (default {d.fraction})",
    )
    p.add_argument("--seed", type=int, default=d.seed, help=f"subsampling, split and training seed (default {d.seed})")
    p.add_argument("--resolution", type=int, default=d.resolution, help=f"bin size in bp (default {d.resolution})")
    p.add_argument("--strata", type=int, default=d.strata, help=f"strata (default {d.strata})")
    p.add_argument("--n-top-genes", type=int, default=d.n_top_genes, help=f"highly variable genes (default {d.n_top_genes})")
    p.add_argument("--epochs", type=int, default=d.pretrain_epochs, help=f"pretraining epochs (default {d.pretrain_epochs})")
    p.add_argument(
        "--finetune-epochs",
        type=int,
        default=d.finetune_epochs,
        help=f"fine-tuning epochs (default {d.finetune_epochs})",
    )
    p.add_argument("--label-column", choices=["cluster_label", "marker_label"], default=d.label_column,
                   help=f"column of the inferred labels (default {d.label_column})")  # fmt: skip
    p.add_argument("--cores", type=int, default=d.cores, help=f"cores for snakemake and torch (default {d.cores})")
    p.add_argument("--attention", action="store_true", help="train with the model's local attention (default off)")
    p.add_argument(
        "--defaults",
        action="store_true",
        help="leave the model keys and the train keys but seed and threads out: the template's settings "
        "(its epochs with early stopping, attention on; --epochs, --finetune-epochs and --attention unused)",
    )
    args = p.parse_args(argv)
    data = find_data(args.data_dir)
    if data is None:
        print("negative_control: the shared real-data folder (hires/, annotation/) was not found", file=sys.stderr)
        return 2
    settings = Settings(
        fraction=args.fraction, seed=args.seed, resolution=args.resolution, strata=args.strata,
        n_top_genes=args.n_top_genes, pretrain_epochs=args.epochs, finetune_epochs=args.finetune_epochs,
        label_column=args.label_column, cores=args.cores, attention=args.attention, defaults=args.defaults,
    )  # fmt: skip
    tmp = None
    if args.work is None:
        tmp = Path(tempfile.mkdtemp(prefix="ampflow-negctl-"))
        work = tmp
    else:
        work = args.work.resolve()
    print(f"negative control in {work} (data {data})")
    try:
        result = run_control(work, data, settings)
    finally:
        if tmp is not None and not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print(table(result, settings))
    if args.check and not result.passed:
        print("negative_control: FAIL: " + "; ".join(result.failures()), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
