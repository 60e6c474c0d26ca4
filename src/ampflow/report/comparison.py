"""The summary's second table: the joint latent against each modality's latent, the
single-modality baselines and the shuffled-pairing control, held-out and training cells side by side.

``scores.json`` nests these under ``groups`` (see :mod:`ampflow.evaluate.run`).
:func:`comparison_columns` flattens them into columns of the summary's one row per
configuration (``heldout_rna_baseline_ari``, ``heldout_shuffled_foscttm`` ...), so
that ``summary.tsv`` keeps one line per configuration and everything shown here can
be rebuilt from it: :func:`comparison_table` turns those columns back into rows (one
per configuration and method), :func:`plot_comparison` draws the ARI panel of
``scores.png``, and :func:`headline_control` gives the control's FOSCTTM beside the
headline FOSCTTM.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .common import colour

#: Groups of cells, in column order, and how the page names them.
GROUPS = {"heldout": "held-out", "train": "training", "all": "all cells"}

#: Methods of ``scores.json``, in row order, and how the page names them.
METHODS = {
    "joint": "joint latent (X_joint)",
    "rna_latent": "RNA latent (X_rna)",
    "hic_latent": "Hi-C latent (X_hic)",
    "rna_baseline": "RNA-only baseline (PCA)",
    "hic_baseline": "Hi-C-only baseline (PCA)",
    "bandnorm_baseline": "Hi-C BandNorm baseline (PCA)",
}

#: Per method and group: the score's column suffix -> where it is in ``scores.json``
#: (the Leiden entry, or its ``kmeans`` entry) and which key.
SCORES = {
    "ari": (None, "ari"),
    "ari_p95": (None, "ari_shuffled_p95"),
    "nmi": (None, "nmi"),
    "nmi_p95": (None, "nmi_shuffled_p95"),
    "kmeans_ari": ("kmeans", "ari"),
    "kmeans_ari_p95": ("kmeans", "ari_shuffled_p95"),
    "kmeans_ari_batch": ("kmeans", "ari_batch"),
}

#: How the page heads those columns (after the group's name).
SCORE_NAMES = {
    "ari": "ARI", "ari_p95": "ARI chance", "nmi": "NMI", "nmi_p95": "NMI chance",
    "kmeans_ari": "k-means ARI", "kmeans_ari_p95": "k-means chance", "kmeans_ari_batch": "k-means ARI vs batch",
}  # fmt: skip
PAIRED = "paired latents (X_rna vs X_hic)"
SHUFFLED = "shuffled pairing (control)"


def comparison_columns(scores: dict) -> dict:
    """Flat columns of one ``scores.json``'s ``groups`` section (empty for files without it).

    Returns
    -------
    dict
        Per group ``g`` present: ``g_n_cells``; ``g_<method>_<score>`` for every
        method of :data:`METHODS` and score of :data:`SCORES` (Leiden ARI and NMI,
        k-means ARI, each with its shuffled-label 95th percentile, and the k-means
        clusters' ARI against the batch; None when not scored); where computed, ``g_foscttm``, ``g_shuffled_foscttm`` and
        ``g_shuffled_tolerance``.
    """
    cols = {}
    for g, entry in (scores.get("groups") or {}).items():
        cols[f"{g}_n_cells"] = entry.get("n_cells")
        methods = entry.get("methods") or {}
        for m in METHODS:
            found = methods.get(m) or {}
            for col, (inner, key) in SCORES.items():
                cols[f"{g}_{m}_{col}"] = ((found.get(inner) or {}) if inner else found).get(key)
        if "foscttm" in entry:
            cols[f"{g}_foscttm"] = (entry["foscttm"] or {}).get("foscttm")
        if "shuffled_control" in entry:
            control = entry["shuffled_control"] or {}
            cols[f"{g}_shuffled_foscttm"] = control.get("foscttm")
            cols[f"{g}_shuffled_tolerance"] = control.get("tolerance")
    return cols


def headline_control(scores: dict) -> float | None:
    """The shuffled-pairing control's FOSCTTM on the cells of the headline scores, or None."""
    entry = (scores.get("groups") or {}).get(scores.get("headline_group"), {})
    return (entry.get("shuffled_control") or {}).get("foscttm")


def groups_in(table: pd.DataFrame) -> list[str]:
    """The groups any configuration of ``table`` was scored in, in :data:`GROUPS` order."""
    return [g for g in GROUPS if f"{g}_n_cells" in table.columns and table[f"{g}_n_cells"].notna().any()]


def _value(row: pd.Series, col: str):
    v = row.get(col)
    return None if v is None or (isinstance(v, float) and np.isnan(v)) else float(v)


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def comparison_table(table: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration and method, one column per group and score, as shown.

    Rows: the methods of :data:`METHODS` (Leiden ARI and NMI, k-means ARI, each beside
    the 95th percentile of the same clusters against shuffled labels, and the k-means
    clusters against the batch: "-" without batches), then the paired latents'
    FOSCTTM and the shuffled-pairing control's FOSCTTM with its chance band. Empty
    when no configuration has per-method scores.
    """
    groups = groups_in(table)
    if not groups:
        return pd.DataFrame()
    with_foscttm = [g for g in groups if f"{g}_foscttm" in table.columns and table[f"{g}_foscttm"].notna().any()]
    rows = []
    for _, r in table.iterrows():

        def line(method: str, cells: dict, config=r["configuration"]) -> dict:
            out = {"configuration": config, "method": method}
            for g in groups:
                for col, name in SCORE_NAMES.items():
                    out[f"{GROUPS[g]} {name}"] = cells.get((g, col), "-")
                if g in with_foscttm:
                    out[f"{GROUPS[g]} FOSCTTM"] = cells.get((g, "foscttm"), "-")
            return out

        for m, name in METHODS.items():
            rows.append(line(name, {(g, s): _fmt(_value(r, f"{g}_{m}_{s}")) for g in groups for s in SCORES}))
        rows.append(line(PAIRED, {(g, "foscttm"): _fmt(_value(r, f"{g}_foscttm")) for g in with_foscttm}))
        tol = next((t for g in with_foscttm if (t := _value(r, f"{g}_shuffled_tolerance")) is not None), None)
        label = SHUFFLED if tol is None else f"{SHUFFLED[:-1]}; chance 0.5 +/- {tol:.3f})"
        rows.append(line(label, {(g, "foscttm"): _fmt(_value(r, f"{g}_shuffled_foscttm")) for g in with_foscttm}))
    return pd.DataFrame(rows)


def cells_note(table: pd.DataFrame) -> str:
    """Cells scored per configuration and group, e.g. ``500kb_s10: held-out 30, training 88``."""
    groups = groups_in(table)
    parts = []
    for _, r in table.iterrows():
        counts = [f"{GROUPS[g]} {int(v)}" for g in groups if (v := _value(r, f"{g}_n_cells")) is not None]
        if counts:
            parts.append(f"{r['configuration']}: {', '.join(counts)}")
    return "; ".join(parts)


def plot_comparison(ax, table: pd.DataFrame) -> None:
    """ARI of every method per configuration on ``ax``: one colour per method, the
    held-out (or all-cell) bar solid and, with a split, the training bar hatched beside it."""
    from matplotlib.patches import Patch

    groups = groups_in(table)
    # held-out and all-cell scores share the solid slot: a configuration has one or the other
    slots = (["scored"] if set(groups) - {"train"} else []) + (["train"] if "train" in groups else [])
    x = np.arange(len(table))
    width = 0.85 / (len(METHODS) * len(slots))

    def ari(m: str, slot: str) -> np.ndarray:
        out = np.full(len(table), np.nan)
        for g in ("heldout", "all") if slot == "scored" else (slot,):
            col = f"{g}_{m}_ari"
            if col in table.columns:
                vals = pd.to_numeric(table[col], errors="coerce").to_numpy(dtype=float)
                out = np.where(np.isnan(out), vals, out)
        return out

    for i, m in enumerate(METHODS):
        for j, slot in enumerate(slots):
            vals = ari(m, slot)
            pos = x + (i * len(slots) + j - (len(METHODS) * len(slots) - 1) / 2) * width
            ax.bar(
                pos, np.nan_to_num(vals), width, color=colour(i), alpha=0.45 if slot == "train" else 1.0,
                hatch="//" if slot == "train" else None, edgecolor="white", linewidth=0.3,
            )  # fmt: skip
            for p, v in zip(pos, vals, strict=True):
                if np.isnan(v):  # not scored (e.g. no data folder for the baselines): say so
                    ax.annotate("n/a", (p, 0), ha="center", va="bottom", fontsize=7, rotation=90, xytext=(0, 2), textcoords="offset points")
    handles = [Patch(color=colour(i), label=name) for i, name in enumerate(METHODS.values())]
    if "train" in slots:
        handles += [
            Patch(facecolor="#777777", label="held-out cells (solid)" if "heldout" in groups else "scored cells (solid)"),
            Patch(facecolor="#777777", alpha=0.45, hatch="//", edgecolor="white", label="training cells (hatched)"),
        ]
    ax.set_xticks(x, table["configuration"])
    ax.set_xlabel("training configuration (bin size and strata, e.g. 500kb_s10)")
    ax.set_ylabel("ARI of Leiden clusters (dimensionless, 0 to 1)")
    ax.set_ylim(min(0.0, ax.get_ylim()[0]), 1.05)
    ax.axhline(0.0, color="#999999", linewidth=0.8)
    # beside the panel: the entries over the bars would hide them
    ax.legend(handles=handles, frameon=False, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("ARI by method: the model's latents against single-modality baselines")
