"""Every configuration in one table and one figure: scores, plan, measured memory, training time.

:func:`summary_table` collects, per configuration, ARI, NMI and FOSCTTM
(``eval/{cfg}/scores.json``: the joint latent on held-out cells, or on all cells
without a split), the plan's strategies, mesh, chunk size, predicted peak, budget
and fit (``amp/{cfg}/plan.json``), the measured peak, steps and training seconds
(``train/{cfg}/metrics.jsonl``), and the per-method scores of every group of cells
(:mod:`.comparison`). :func:`summary_report` writes it as TSV, as an HTML page, as
the plain-text tables printed at the end of a run, and as a bar chart of the scores.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pandas as pd

from ..base.atomic import atomic_path, write_text_atomic
from ..base.errors import read_json
from ..base.progress import human_bytes
from ..contract.plan import Plan
from .common import colour, esc, html_table, new_figure, read_jsonl, save_png, write_html
from .comparison import cells_note, comparison_columns, comparison_table, groups_in, headline_control, plot_comparison
from .plan import measured_memory, mesh_text, strategy_ids

log = logging.getLogger(__name__)

#: The cells the headline scores are on, by ``scores.json``'s ``headline_group``.
_CELLS = {"heldout": "held-out cells", "all": "all cells", "train": "training cells"}

SCORES = (("ari", "ARI (higher is better)"), ("nmi", "NMI (higher is better)"), ("foscttm", "FOSCTTM (lower is better)"))


def summary_row(name: str, plan: Plan, scores: dict, metrics: list[dict]) -> dict:
    """One configuration's line of the summary (numbers raw; see :func:`text_table` for display)."""
    mem = measured_memory(metrics)
    rank0 = [r for r in metrics if int(r.get("rank", 0)) == 0]
    return {
        "configuration": name,
        "ari": scores.get("ari"),
        "nmi": scores.get("nmi"),
        "foscttm": scores.get("foscttm"),
        "strategies": strategy_ids(plan),
        "mesh": mesh_text(plan),
        "chunk": plan.chunk,
        "predicted_peak_bytes": int(plan.predicted_peak_bytes),
        "budget_bytes": int(plan.inputs.budget_bytes),
        "fits": plan.fits,
        "recommended_devices": plan.recommended_devices,
        "measured_peak_bytes": max(mem.peak.values()) if mem.peak else None,
        "processes": mem.world if mem.world > 0 else None,
        "steps": len(rank0),
        "train_seconds": float(sum(r.get("seconds", 0.0) for r in rank0)),
        "scored_cells": scores.get("headline_group"),
        "control_foscttm": headline_control(scores),
        **comparison_columns(scores),
    }


def summary_table(configs: dict[str, dict]) -> pd.DataFrame:
    """``configs``: name -> ``{"plan": path, "scores": path, "metrics": path}``."""
    rows = [summary_row(name, Plan.read(p["plan"]), read_json(p["scores"], "scores"), read_jsonl(p["metrics"], "metrics file")) for name, p in configs.items()]
    return pd.DataFrame(rows)


def _fmt(v, spec: str = ".3f") -> str:
    if v is None or (isinstance(v, float) and np.isnan(v)):
        return "-"
    return format(v, spec)


def display_table(table: pd.DataFrame) -> pd.DataFrame:
    """The summary with readable units (what the page and the log show)."""
    return pd.DataFrame(
        {
            "configuration": table["configuration"],
            "ARI": [_fmt(v) for v in table["ari"]],
            "NMI": [_fmt(v) for v in table["nmi"]],
            "FOSCTTM": [_fmt(v) for v in table["foscttm"]],
            "strategies": table["strategies"],
            "mesh": table["mesh"],
            "chunk": [str(int(c)) if c else "-" for c in table["chunk"]],
            "predicted peak": [human_bytes(v) for v in table["predicted_peak_bytes"]],
            "budget": [human_bytes(v) for v in table["budget_bytes"]],
            "fits": ["yes" if f else "NO" for f in table["fits"]],
            "measured peak": [human_bytes(v) if v is not None and not pd.isna(v) else "-" for v in table["measured_peak_bytes"]],
            "processes": [str(int(v)) if v is not None and not pd.isna(v) else "-" for v in table["processes"]],
            "steps": table["steps"].astype(int).astype(str),
            "train time": [f"{v:,.0f} s" for v in table["train_seconds"]],
        }
    )


def _fixed_width(shown: pd.DataFrame) -> list[str]:
    cols = list(shown.columns)
    widths = [max(len(c), *(len(str(v)) for v in shown[c])) for c in cols]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()
    rule = "  ".join("-" * w for w in widths)
    body = ["  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip() for row in shown.itertuples(index=False)]
    return [line, rule, *body]


def text_table(table: pd.DataFrame) -> str:
    """Fixed-width text of :func:`display_table`, for the end of a run's log, followed
    (when the scores have them) by the per-method scores of :func:`.comparison.comparison_table`."""
    lines = _fixed_width(display_table(table))
    compared = comparison_table(table)
    if len(compared):
        lines += ["", f"Scores by method (cells scored: {cells_note(table)})", *_fixed_width(compared)]
    return "\n".join(lines) + "\n"


def plot_scores(table: pd.DataFrame, path, title: str = "") -> Path:
    """Grouped bars: ARI, NMI and FOSCTTM per configuration, values written on the bars;
    below, when the scores have them, the ARI of every method (:func:`.comparison.plot_comparison`)."""
    compare = bool(groups_in(table))
    width = max(8.0, 2.2 * len(table) + 3) + (3.5 if compare else 0.0)
    fig, axes = new_figure(2 if compare else 1, 1, size=(width, 9.6 if compare else 4.8))
    ax = axes[0][0]
    x = np.arange(len(table))
    shown = list(SCORES)
    if "control_foscttm" in table.columns and table["control_foscttm"].notna().any():
        shown.append(("control_foscttm", "FOSCTTM, shuffled pairing (control: 0.5)"))
    width = 0.8 / len(shown)
    for i, (key, label) in enumerate(shown):
        vals = pd.to_numeric(table[key], errors="coerce").to_numpy(dtype=float)
        offset = (i - (len(shown) - 1) / 2) * width
        tint = "#999999" if key == "control_foscttm" else colour(i)
        bars = ax.bar(x + offset, np.nan_to_num(vals), width, color=tint, label=label)
        for b, v in zip(bars, vals):
            ax.annotate("n/a" if np.isnan(v) else f"{v:.2f}", (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")  # fmt: skip
    ax.set_xticks(x, table["configuration"])
    ax.set_xlabel("training configuration (bin size and strata, e.g. 500kb_s10)")
    ax.set_ylabel("score (dimensionless, 0 to 1)")
    ax.set_ylim(0, 1.25)
    ax.axhline(0.5, color="#999999", linestyle=":", linewidth=1, label="FOSCTTM of unrelated embeddings")
    ax.legend(frameon=False, fontsize=9, ncols=2, loc="upper center")
    heads = {_CELLS.get(g, g) for g in table.get("scored_cells", pd.Series(dtype=object)).dropna()}
    on = f" (on {', '.join(sorted(heads))})" if heads else ""
    ax.set_title(f"{title}Evaluation scores of the joint latent per configuration{on}")
    if compare:
        plot_comparison(axes[1][0], table)
    return save_png(fig, path)


def summary_report(configs: dict[str, dict], out_dir, dataset: str = "") -> dict[str, Path]:
    """Write ``summary.tsv``, ``summary.txt``, ``summary.html`` and ``scores.png`` into ``out_dir``."""
    out = Path(out_dir)
    table = summary_table(configs)
    with atomic_path(out / "summary.tsv") as tmp:
        table.to_csv(tmp, sep="\t", index=False)
    text = text_table(table)
    write_text_atomic(out / "summary.txt", text)
    prefix = f"{dataset}: " if dataset else ""
    # one column per configuration: the page stays narrow enough for the report's frame
    wide = display_table(table).set_index("configuration").T
    wide.index.name = "configuration"
    wide.columns = [str(c) for c in wide.columns]
    parts = [
        html_table(wide, numeric=wide.columns, index=True, row_class=lambda r: "bad" if (r == "NO").any() else ""),
        "<p>ARI and NMI: Leiden clusters of the joint embedding against the cell labels (the resolution with the best NMI), "
        "on held-out cells when training held cells out, else on all cells. "
        "FOSCTTM: fraction of cells closer than the true partner between the RNA and Hi-C embeddings (0 perfect, about 0.5 random). "
        "Predicted peak: the memory model for the plan, per device; measured peak: the largest step peak of any process.</p>",
    ]
    compared = comparison_table(table)
    if len(compared):
        parts += [
            "<h2>Scores by method</h2>",
            html_table(compared, numeric=[c for c in compared.columns if c not in ("configuration", "method")]),
            f"<p>Cells scored: {esc(cells_note(table))}. Each representation is clustered on that group's cells alone "
            "with the same Leiden resolution search, on a kNN graph of cosine distances for the latents (as GLUE builds it) "
            "and euclidean ones for the baselines' PCAs (scanpy's default). The baselines are plain PCA of one modality's counts (RNA: "
            "normalize_total, log1p, highly variable genes; Hi-C: per-cell normalised, log1p, per-stratum scaled strata "
            "features), learned from training cells only. The shuffled pairing gives every cell another cell's Hi-C "
            "latent: its FOSCTTM must read chance, 0.5 within the band shown; the paired latents' FOSCTTM should lie "
            "well below it. Training cells have no FOSCTTM: the alignment loss pulled exactly those pairs together.</p>",
        ]
    paths = {
        "tsv": out / "summary.tsv",
        "txt": out / "summary.txt",
        "html": write_html(out / "summary.html", f"{prefix}Summary of {len(table)} configuration(s)", parts),
        "scores": plot_scores(table, out / "scores.png", prefix),
    }
    log.info("summary:\n%s", text)
    return paths
