"""Every configuration in one table and one figure: scores, plan, measured memory, training time.

:func:`summary_table` collects, per configuration, ARI, NMI and FOSCTTM
(``eval/{cfg}/scores.json``), the plan's strategies, mesh, chunk size, predicted
peak, budget and fit (``amp/{cfg}/plan.json``), and the measured peak, steps and
training seconds (``train/{cfg}/metrics.jsonl``). :func:`summary_report` writes it as
TSV, as an HTML page, as the plain-text table printed at the end of a run, and as a
bar chart of the scores.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pandas as pd

from ..io.atomic import atomic_path, write_text_atomic
from ..progress import human_bytes
from ..spec.plan import Plan
from .common import colour, html_table, new_figure, read_json, read_jsonl, save_png, write_html
from .plan import measured_memory, mesh_text, strategy_ids

log = logging.getLogger(__name__)

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
    }


def summary_table(configs: dict[str, dict]) -> pd.DataFrame:
    """``configs``: name -> ``{"plan": path, "scores": path, "metrics": path}``."""
    rows = [
        summary_row(name, Plan.read(p["plan"]), read_json(p["scores"], "scores"), read_jsonl(p["metrics"], "metrics file"))
        for name, p in configs.items()
    ]
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


def text_table(table: pd.DataFrame) -> str:
    """Fixed-width text of :func:`display_table`, for the end of a run's log."""
    shown = display_table(table)
    cols = list(shown.columns)
    widths = [max(len(c), *(len(str(v)) for v in shown[c])) for c in cols]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()
    rule = "  ".join("-" * w for w in widths)
    body = ["  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip() for row in shown.itertuples(index=False)]
    return "\n".join([line, rule, *body]) + "\n"


def plot_scores(table: pd.DataFrame, path, title: str = "") -> Path:
    """Grouped bars: ARI, NMI and FOSCTTM per configuration, values written on the bars."""
    fig, axes = new_figure(1, 1, size=(max(8.0, 2.2 * len(table) + 3), 4.8))
    ax = axes[0][0]
    x = np.arange(len(table))
    width = 0.8 / len(SCORES)
    for i, (key, label) in enumerate(SCORES):
        vals = pd.to_numeric(table[key], errors="coerce").to_numpy(dtype=float)
        bars = ax.bar(x + (i - 1) * width, np.nan_to_num(vals), width, color=colour(i), label=label)
        for b, v in zip(bars, vals):
            ax.annotate("n/a" if np.isnan(v) else f"{v:.2f}", (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")  # fmt: skip
    ax.set_xticks(x, table["configuration"])
    ax.set_xlabel("training configuration (bin size and strata, e.g. 500kb_s10)")
    ax.set_ylabel("score (dimensionless, 0 to 1)")
    ax.set_ylim(0, 1.25)
    ax.axhline(0.5, color="#999999", linestyle=":", linewidth=1, label="FOSCTTM of unrelated embeddings")
    ax.legend(frameon=False, fontsize=9, ncols=2, loc="upper center")
    ax.set_title(f"{title}Evaluation scores per configuration")
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
        "<p>ARI and NMI: Leiden clusters of the joint embedding against the cell labels (the resolution with the best NMI). "
        "FOSCTTM: fraction of cells closer than the true partner between the RNA and Hi-C embeddings (0 perfect, about 0.5 random). "
        "Predicted peak: the memory model for the plan, per device; measured peak: the largest step peak of any process.</p>",
    ]
    paths = {
        "tsv": out / "summary.tsv",
        "txt": out / "summary.txt",
        "html": write_html(out / "summary.html", f"{prefix}Summary of {len(table)} configuration(s)", parts),
        "scores": plot_scores(table, out / "scores.png", prefix),
    }
    log.info("summary:\n%s", text)
    return paths
