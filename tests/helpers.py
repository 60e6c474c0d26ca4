"""Helpers several test modules share, in one module so that no test module imports another:
the small trainer setup (``MODEL``, ``SETTINGS``, ``prepare``, ``metrics``), plans and
profiles for the diagnosis tests (``profile``, ``host``, ``plan_for``, ``Est``,
``mm10_profile``), a paired dataset with batches, the independent bin count, the
Snakemake runner of the workflow tests, the error-message and figure-label checks, and
the report's inputs, and the host-sync counter of the device-side steps."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import scipy.sparse as sp
import torch
from matplotlib.figure import Figure
from synthetic_shapes import SYNTHETIC_META, synthetic_features, synthetic_graph
from torch.utils._python_dispatch import TorchDispatchMode

from ampflow.amp.decide.diagnose import diagnose
from ampflow.cli import main
from ampflow.contract.config import ModelConfig, TrainConfig
from ampflow.contract.plan import Plan
from ampflow.contract.profile import as_profile
from ampflow.train.data import PairedData

UNIT = re.compile(r"\(.+\)")  # "memory held (MiB)", "UMAP 1 (arbitrary units)"


def assert_labelled(fig: Figure) -> None:
    """A title (on the figure or every panel) and, on every visible panel, x and y labels with a unit in parentheses."""
    suptitle = fig._suptitle.get_text() if fig._suptitle is not None else ""
    for ax in fig.axes:
        if not ax.get_visible() or not ax.axison:  # a text-only panel (axis off) has no axes to label
            continue
        assert suptitle or ax.get_title(), "figure or panel title"
        for label in (ax.get_xlabel(), ax.get_ylabel()):
            assert label and UNIT.search(label), f"axis label without a unit: {label!r} in {ax.get_title()!r}"


# ---------------------------------------------------------------- AMP plan and memory
PROFILE = {
    "version": 1,
    "modalities": {
        "rna": {"prob_model": "NB", "n_features": 200, "n_cells": 100},
        "hic": {
            "prob_model": "HiCZINB",
            "n_features": 250,
            "n_cells": 100,
            "n_strata": 4,
            "n_anchors": 64,
            "features_per_stratum": [64, 63, 62, 61],
            "attention": True,
            "window": 4,
            "heads": 2,
        },  # fmt: skip
    },
    "graph": {"n_nodes": 264, "n_edges": 2000},
    "model": {"latent_dim": 8, "hidden_dim": 16, "heads": 2, "window": 4},
    "train": {"batch_size": 8},
}


def metrics_rows(n_steps=3, world=2, per_rank=False):
    rows = []
    for s in range(1, n_steps + 1):
        marks = [100 + 10 * k + s for k in range(4)]
        if per_rank:
            for r in range(world):
                rows.append(
                    {"step": s, "rank": r, "stage": "pretrain", "loss": {"total": 1.0}, "peak_bytes": 200 + r + s, "stratum_bytes": [m + r for m in marks]}
                )
        else:
            rows.append({"step": s, "stage": "pretrain" if s < n_steps else "finetune", "epoch": 0, "seconds": 0.5, "cells_per_s": 64.0,
                         "loss": {"total": 3.0 / s, "rna_nll": 1.0 / s, "align": 0.1}, "peak_bytes": 300 + s,
                         "stratum_bytes": marks, "rank_peak_bytes": [300 + s, 290 + s][:world]})  # fmt: skip
    return rows


def summary_inputs(tmp_path, scores: dict) -> dict:
    """A plan, the given scores.json and two ranks' metrics per configuration, as the
    summary rule gets them: name -> {"plan", "scores", "metrics"} paths."""
    plan = diagnose(PROFILE, 2, 2**30, 0.9)
    cfgs = {}
    for name, score in scores.items():
        d = tmp_path / name
        d.mkdir()
        plan.write(d / "plan.json")
        (d / "scores.json").write_text(json.dumps(score))
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics_rows(world=2)))
        cfgs[name] = {"plan": d / "plan.json", "scores": d / "scores.json", "metrics": d / "metrics.jsonl"}
    return cfgs


def assert_names(msg: str, path, line=None, key=None, value=None) -> None:
    """The message names the file (and line), the key and the value."""
    where = str(path) if line is None else f"{path}:{line}"
    assert where in msg, f"{where!r} not in {msg!r}"
    if key is not None:
        assert key in msg, f"{key!r} not in {msg!r}"
    if value is not None:
        assert repr(value) in msg or str(value) in msg, f"{value!r} not in {msg!r}"


BIN = Path(sys.executable).parent


QUICK = ["--configfile", "config/demo.yaml", "config/quick.yaml"]


def snakemake(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run([str(BIN / "snakemake"), "--cores", "2", *QUICK, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def job_counts(output: str) -> dict[str, int]:
    """Rule -> job count from the "Job stats" table of Snakemake's output ({} when
    there is nothing to do)."""
    stats = [ln.split() for ln in output.splitlines()]
    return {w[0]: int(w[1]) for w in stats if len(w) == 2 and w[1].isdigit() and not w[0].endswith(":") and w[0] != "total"}


def independent_count(path, chromsizes, resolution):
    """Plain-Python pixel count: no pandas, no numpy, no code shared with ampflow."""
    names = list(chromsizes)
    first = {}
    acc = 0
    for c in names:
        first[c] = acc
        acc += -(-chromsizes[c] // resolution)
    counts = Counter()
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as fh:
        for line in fh:
            if line.startswith("#"):
                continue
            f = line.rstrip("\n").split("\t")
            c1, p1, c2, p2 = f[1], int(f[2]), f[3], int(f[4])
            if c1 not in first or c2 not in first:
                continue
            a = first[c1] + (p1 - 1) // resolution
            b = first[c2] + (p2 - 1) // resolution
            counts[(min(a, b), max(a, b))] += 1
    return counts


N_ANCHORS, N_STRATA = 12, 3


def batched_paired_data(n_cells=64, batch_fold=6.0, seed=0, batches=True) -> PairedData:
    """Hi-C-only cells of two kinds (their own rates) in two batches; batch b1 has a
    random half of the features ``batch_fold`` times as frequent, kind-independent."""
    g = torch.Generator().manual_seed(seed)
    anchor, stratum = synthetic_features(N_ANCHORS, N_STRATA, 1.0, 0, g)
    F = len(anchor)
    kind = torch.arange(n_cells) % 2
    batch = (torch.arange(n_cells) // 2) % 2
    rates = torch.rand(2, F, generator=g) * 3 + 0.5
    boosted = torch.rand(F, generator=g) < 0.5
    effect = torch.where(boosted, batch_fold, 1.0)  # (F,)
    lam = rates[kind] * torch.where(batch.unsqueeze(1) == 1, effect, torch.ones(F))
    hic = torch.poisson(lam, generator=g).numpy()
    obs = pd.DataFrame(
        {"kind": [f"k{k}" for k in kind.tolist()], **({"batch": [f"b{b}" for b in batch.tolist()]} if batches else {})},
        index=[f"c{i}" for i in range(n_cells)],
    )
    return PairedData(
        obs=obs, rna=sp.csr_matrix((n_cells, 0), dtype=np.float32), hic=sp.csr_matrix(hic, dtype=np.float32),
        feature_anchor=anchor, feature_stratum=stratum, n_strata=N_STRATA, graph=synthetic_graph(0, N_ANCHORS, g), meta=SYNTHETIC_META,
    )  # fmt: skip


def mm10_profile(n: int = 2700, L: int = 10, window: int = 8) -> dict:
    """The issue's real shape: mm10 at 1 Mb (about 2,700 anchors on 22 chromosomes), 10
    strata, window 8, with 2,000 RNA features."""
    fps = [n - 22 * k for k in range(L)]
    return {
        "version": 1,
        "modalities": {
            "rna": {"prob_model": "NB", "n_features": 2000, "n_cells": 5000},
            "hic": {
                "prob_model": "HiCZINB",
                "n_features": sum(fps),
                "n_cells": 5000,
                "n_strata": L,
                "n_anchors": n,
                "features_per_stratum": fps,
                "attention": True,
                "window": window,
            },  # fmt: skip
        },
        "graph": {"n_nodes": n + 2000, "n_edges": 60000},
        "model": {"window": window},
        "train": {"batch_size": 32},
    }


@dataclass
class Est:
    total: float
    base: float
    per_stratum: float
    components: dict = field(default_factory=dict)


GIB = 2**30


RNA_FEATURES = 100  # float32: 400 bytes per cell of the data batch


def profile(batch_size: int = 64) -> dict:
    """An RNA-only profile: no signal is raised, so the mesh is dp = devices, tp 1."""
    mods = {"rna": {"prob_model": "NB", "n_features": RNA_FEATURES, "n_cells": 1000}}
    return {"version": 1, "modalities": mods, "graph": {"n_nodes": 100, "n_edges": 1000}, "model": {}, "train": {"batch_size": batch_size}}


def linear_estimate(p, names, dp, tp, chunk):
    """Predicted peak 1000 + 10 x batch bytes per process, plus the process's data batch
    (ceil(batch / dp) cells x 400 bytes), which the memory model's peak counts."""
    b = as_profile(p).train.batch_size
    total = 1000 + 10 * b + -(-b // dp) * RNA_FEATURES * 4
    return Est(total, total, 0)


def host(cores: int | None = 16, available: int | None = 64 * GIB, gpus: int = 0) -> dict:
    """A devices.json as `ampflow devices` writes it, with ``cores`` and ``available``."""
    return {
        "host": "node",
        "cpu": {"affinity_cores": cores, "cores": cores, "memory_total_bytes": 2 * (available or GIB), "memory_available_bytes": available},
        "devices": [{"index": i, "name": "GPU", "memory_total": 80 * GIB, "memory_free": 80 * GIB} for i in range(gpus)],
    }


def plan_for(processes: int, train: dict | None = None, devices: dict | None = None, batch_size: int = 64, fraction: float = 1.0) -> Plan:
    return diagnose(profile(batch_size), processes, 80 * GIB, fraction, estimate=linear_estimate,
                    train=TrainConfig.from_dict(train or {}), host=devices if devices is not None else host())  # fmt: skip


MODEL = ModelConfig(latent_dim=8, hidden_dim=32, heads=2, window=2)


SETTINGS = {
    "seed": 0,
    "batch_size": 8,
    "checkpoint_every": 3,
    "keep_checkpoints": 3,
    "threads": 1,
    "device": "cpu",
    "pretrain": {"epochs": 3},
    "finetune": {"epochs": 2},
    # a fixed schedule: every epoch runs and no cell is set aside (tests count steps)
    "early_stopping": {"patience": 0},
}


def prepare(paths: dict, work: Path, rna=None, genes=None, holdout: float | None = None, folder: str = "data") -> Path:
    """Run the prepare commands on a demo's files; return the data folder. With
    ``holdout`` the cells are split first (qc/split.tsv) and the data folder built with
    the split, as the workflow does: split seed 1, under which six of a 24-cell demo's
    cells draw held out at 0.2 or 0.25 (seed 0 draws two or three)."""
    rna, genes, sheet, sizes = rna or paths["rna"], genes or paths["genes"], paths["sheet"], paths["chromsizes"]
    data, scool = work / folder, work / "binned" / "1000000.scool"
    steps = [
        ["bin-cells", "--sheet", sheet, "--chromsizes", sizes, "--resolutions", "1000000", "--out-scool", scool,
         "--stats", work / "qc" / "contacts.tsv", "--cache-dir", work / "cache", "--threads", "1"],
        ["load-rna", rna, "--out", work / "rna" / "counts.h5ad", "--stats", work / "qc" / "rna.tsv"],
        ["qc-cells", "--sheet", sheet, "--contacts", work / "qc" / "contacts.tsv", "--rna-stats", work / "qc" / "rna.tsv",
         "--min-contacts", "100", "--min-umis", "10", "--min-genes", "5", "--out", work / "qc" / "cells.tsv"],
        ["pseudobulk", "--scool", f"1000000={scool}", "--qc", work / "qc" / "cells.tsv", "--out", work / "binned" / "pseudobulk.mcool"],
        ["strata", "--scool", scool, "--qc", work / "qc" / "cells.tsv", "--chromsizes", sizes, "--strata", "4",
         "--min-cells", "2", "--min-count", "2", "--out", data / "hic.h5ad"],
        ["rna-data", "--counts", work / "rna" / "counts.h5ad", "--qc", work / "qc" / "cells.tsv", "--genes", genes,
         "--chromsizes", sizes, "--n-top-genes", "200", "--out", data / "rna.h5ad"],
        ["graph", "--rna", data / "rna.h5ad", "--hic", data / "hic.h5ad", "--mcool", work / "binned" / "pseudobulk.mcool",
         "--chromsizes", sizes, "--out", data / "graph"],
    ]  # fmt: skip
    if holdout is not None:
        split = work / "qc" / "split.tsv"
        steps.insert(3, ["split-cells", "--qc", work / "qc" / "cells.tsv", "--holdout", holdout, "--label-key", "cell_type",
                         "--seed", "1", "--out", split])  # fmt: skip
        for step in steps:
            if step[0] in ("strata", "rna-data"):
                step += ["--split", split]
    for step in steps:
        assert main([str(x) for x in step]) == 0, step[0]
    return data


def load_model(out: Path) -> dict:
    return torch.load(out / "model.pt", map_location="cpu", weights_only=True)


def assert_same_model(a: Path, b: Path) -> None:
    sa, sb = load_model(a)["state_dict"], load_model(b)["state_dict"]
    assert list(sa) == list(sb)
    differ = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not differ, f"tensors differ between {a} and {b}: {differ}"


def metrics(out: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(ln) for ln in (out / name).read_text().splitlines()]


class SyncCount(TorchDispatchMode):
    """Host syncs as dispatched ops: ``_local_scalar_dense`` and copies from a GPU tensor
    to the CPU; each with where it came from (Adam's CPU step-count reads apart)."""

    def __init__(self):
        super().__init__()
        self.syncs: Counter = Counter()
        self.optimizer_reads = 0
        self.ops: Counter = Counter()  # every dispatched op by name: what the mode saw

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        sync = name == "_local_scalar_dense" and not args[0].is_cuda
        to_host = False
        if name in ("_to_copy", "copy_"):
            src = args[1] if name == "copy_" else args[0]
            dst_cpu = (args[0].device.type == "cpu") if name == "copy_" else (str(kwargs.get("device", "")).startswith("cpu"))
            to_host = torch.is_tensor(src) and src.is_cuda and dst_cpu
        if name == "_local_scalar_dense" or to_host:
            where = "".join(traceback.format_stack(limit=12))
            if sync and "torch/optim/" in where:
                self.optimizer_reads += 1
            else:
                self.syncs[f"{name}: {where}"] += 1
        return func(*args, **kwargs)
