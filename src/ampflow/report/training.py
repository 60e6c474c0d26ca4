"""Training curves from ``metrics.jsonl``: every loss term and the throughput, per step and stage."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from ..base.errors import InputError
from .common import colour, new_figure, read_jsonl, save_png

#: Loss terms in the order drawn, with what one unit of each is (the model's normalisation).
TERM_UNITS = {
    "total": "weighted sum of the terms",
    "rna_nll": "nats per gene and cell",
    "hic_nll": "nats per feature and cell",
    "rna_kl": "nats per gene, per cell",
    "hic_kl": "nats per feature, per cell",
    "graph_nll": "nats per sampled edge",
    "graph_kl": "nats per graph node",
    "align": "squared distance per latent dim",
    "cross": "nats per value",
}


def metrics_frame(rows: list[dict], path=None) -> pd.DataFrame:
    """One row per step of rank 0 (rows with another ``rank`` are left out): ``step``,
    ``stage``, ``epoch``, ``seconds``, ``cells_per_s`` and one column per loss term."""
    keep = [r for r in rows if int(r.get("rank", 0)) == 0]
    if not keep:
        raise InputError("no metrics rows", path=path)
    for n, r in enumerate(keep, 1):
        if "step" not in r or not isinstance(r.get("loss"), dict):
            raise InputError("metrics row without 'step' or 'loss'", path=path, line=n)
    frame = pd.DataFrame(
        [
            {
                "step": r["step"],
                "stage": r.get("stage", ""),
                "epoch": r.get("epoch"),
                "seconds": r.get("seconds"),
                "cells_per_s": r.get("cells_per_s"),
                **r["loss"],
            }
            for r in keep
        ]  # fmt: skip
    )
    return frame.sort_values("step", kind="stable").reset_index(drop=True)


def _smooth(y: pd.Series, n: int) -> pd.Series:
    """Rolling median over about 2% of the steps (at least 5), centred."""
    window = max(5, n // 50)
    return y.rolling(window, center=True, min_periods=1).median()


def _stages(ax, frame: pd.DataFrame, label: bool) -> None:
    """Shade each stage's steps and name it at the top of the panel."""
    for i, (stage, steps) in enumerate(frame.groupby("stage", sort=False)["step"]):
        lo, hi = steps.min() - 0.5, steps.max() + 0.5
        ax.axvspan(lo, hi, color=colour(i + 4), alpha=0.08, linewidth=0)
        if label:
            ax.text((lo + hi) / 2, 1.0, stage, transform=ax.get_xaxis_transform(), ha="center", va="bottom", fontsize=8, color="#555555")


def plot_training(frame: pd.DataFrame, path, name: str = "") -> Path:
    """A grid of small panels against the step: the total loss, each loss term (raw in
    light colour, rolling median dark; log scale when a term spans more than 50-fold),
    and cells/s; stages shaded and named."""
    terms = [t for t in TERM_UNITS if t in frame.columns] + sorted(
        c for c in frame.columns if c not in TERM_UNITS and c not in ("step", "stage", "epoch", "seconds", "cells_per_s")
    )
    panels = terms + ["cells_per_s"]
    ncols = 3
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = new_figure(nrows, ncols, size=(14, 3.3 * nrows + 0.6), sharex=True)
    flat = axes.ravel()
    steps = frame["step"].to_numpy()
    for i, (ax, col) in enumerate(zip(flat, panels)):
        y = pd.to_numeric(frame[col], errors="coerce")
        base = "#0072B2" if col != "cells_per_s" else "#009E73"
        ax.plot(steps, y, color=base, alpha=0.3, linewidth=0.8)
        ax.plot(steps, _smooth(y, len(y)), color=base, linewidth=1.8)
        pos = y[y > 0]
        if len(pos) == len(y.dropna()) and len(pos) and pos.max() / pos.min() > 50:
            ax.set_yscale("log")
        _stages(ax, frame, label=i < ncols)
        if col == "cells_per_s":
            ax.set_title(f"throughput (median {np.nanmedian(y):,.0f} cells/s)", fontsize=10, pad=12)
            ax.set_ylabel("cells/s (cells per second)")
        else:
            ax.set_title(col, fontsize=10, pad=12)
            ax.set_ylabel(f"loss ({TERM_UNITS.get(col, 'per value')})", fontsize=8.5)
        ax.grid(True, alpha=0.3)
        ax.set_xlabel("optimisation step (count)", fontsize=8.5)
        ax.xaxis.set_tick_params(labelbottom=True)
    for ax in flat[len(panels) :]:
        ax.set_visible(False)
    stages = ", ".join(f"{s} {int(g.size)} steps" for s, g in frame.groupby("stage", sort=False)["step"])
    fig.suptitle(f"{name + ': ' if name else ''}training, {len(frame)} steps ({stages}); light: per step, dark: rolling median")
    return save_png(fig, path)


def training_report(metrics_path, out, name: str = "") -> Path:
    """``ampflow report-training``: the training figure of one configuration."""
    return plot_training(metrics_frame(read_jsonl(metrics_path, "metrics file"), metrics_path), out, name)
