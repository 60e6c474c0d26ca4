"""Quality-control figures and the failed-cells page, from ``qc/cells.tsv`` and a ``.scool``.

* :func:`plot_contacts`: kept contacts per cell and the cis fraction, against the thresholds;
* :func:`distance_decay` / :func:`plot_distance_decay`: contact probability against
  genomic distance, P(s), per cell type;
* :func:`plot_rna`: RNA UMIs and detected genes per cell, against the thresholds;
* :func:`failed_cells_page`: every cell that failed, why, and how many failed for each reason.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.ticker import MaxNLocator

from ..base.errors import InputError, require_file
from ..prepare.qc import QCThresholds, read_qc
from .common import FAIL_COLOUR, LIMIT_COLOUR, PASS_COLOUR, colour, esc, html_table, new_figure, note, save_png, write_html

log = logging.getLogger(__name__)

QC_COLUMNS = ("total", "cis", "trans", "rna_umis", "rna_genes", "in_pairs", "in_rna", "matched", "pass", "reason")


def load_qc(path) -> pd.DataFrame:
    """``qc/cells.tsv`` with numeric columns as floats (NaN where a modality is missing)
    and ``pass``/``in_pairs``/``in_rna`` as booleans."""
    path = require_file(path, "QC table")
    qc = read_qc(path)
    missing = [c for c in QC_COLUMNS if c not in qc.columns]
    if missing:
        raise InputError(f"QC table lacks columns {missing}", path=path)
    for c in ("total", "cis", "trans", "rna_umis", "rna_genes"):
        qc[c] = pd.to_numeric(qc[c].replace("", np.nan), errors="coerce")
    for c in ("pass", "in_pairs", "in_rna", "matched"):
        if qc[c].dtype != bool:
            qc[c] = qc[c].astype(str).str.lower().isin(["true", "1"])
    qc["reason"] = qc["reason"].astype(str)
    return qc


def _log_bins(values: np.ndarray, n: int = 40) -> np.ndarray:
    pos = values[values > 0]
    if not len(pos):
        return np.array([0.5, 1.5])
    lo, hi = pos.min(), pos.max()
    if lo == hi:
        lo, hi = lo / 1.5, hi * 1.5
    return np.geomspace(lo / 1.05, hi * 1.05, n)


def _split_hist(ax, values: pd.Series, passed: pd.Series, bins, log_x: bool) -> None:
    """Stacked histogram of passing and failing cells."""
    ok = values[passed].dropna().to_numpy()
    bad = values[~passed].dropna().to_numpy()
    ax.hist([ok, bad], bins=bins, stacked=True, color=[PASS_COLOUR, FAIL_COLOUR],
            label=[f"pass ({len(ok)})", f"fail ({len(bad)})"])  # fmt: skip
    if log_x:
        ax.set_xscale("log")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("cells (count)")


def _limit(ax, x: float, text: str, vertical: bool = True) -> None:
    if vertical:
        ax.axvline(x, color=LIMIT_COLOUR, linestyle="--", linewidth=1.2, label=text)
    else:
        ax.axhline(x, color=LIMIT_COLOUR, linestyle=":", linewidth=1.2, label=text)


def plot_contacts(qc: pd.DataFrame, path, thresholds: QCThresholds, title: str = "") -> Path:
    """Two panels: kept contacts (cis + trans) per cell on a log axis, and the cis fraction
    in percent; passing and failing cells stacked, the QC thresholds as dashed lines.
    Cells without pairs are left out (and counted in the title)."""
    cells = qc[qc["in_pairs"]]
    kept = cells["cis"] + cells["trans"]
    frac = 100.0 * cells["cis"] / kept.where(kept > 0)
    fig, axes = new_figure(1, 2, size=(12, 4.6))
    ax1, ax2 = axes[0]
    _split_hist(ax1, kept, cells["pass"], _log_bins(kept.to_numpy(dtype=float)), log_x=True)
    _limit(ax1, max(thresholds.min_contacts, 1), f"qc.min_contacts = {thresholds.min_contacts:,}")
    ax1.set_xlabel("kept contacts per cell, cis + trans (count, log scale)")
    ax1.set_title(f"Contacts per cell (median {np.nanmedian(kept):,.0f})" if len(kept) else "Contacts per cell")
    ax1.legend(frameon=False, fontsize=9)

    _split_hist(ax2, frac, cells["pass"], np.linspace(0, 100, 51), log_x=False)
    _limit(ax2, 100 * thresholds.min_cis_fraction, f"qc.min_cis_fraction = {thresholds.min_cis_fraction:g}")
    ratio = (cells["cis"] / cells["trans"].where(cells["trans"] > 0)).median()
    ax2.set_xlabel("cis contacts / kept contacts (%)")
    ax2.set_xlim(0, 100)
    ax2.set_title(f"Cis fraction (median cis:trans ratio {ratio:.1f} : 1)" if pd.notna(ratio) else "Cis fraction")
    ax2.legend(frameon=False, fontsize=9, loc="upper left")
    no_pairs = int((~qc["in_pairs"]).sum())
    extra = f"; {no_pairs} cell(s) without pairs not shown" if no_pairs else ""
    fig.suptitle(f"{title}Hi-C contacts of {len(cells)} cells{extra}")
    return save_png(fig, path)


def plot_rna(qc: pd.DataFrame, path, thresholds: QCThresholds, title: str = "") -> Path:
    """Two panels: RNA UMIs per cell (histogram, log axis) and detected genes against
    UMIs (log-log scatter), passing and failing cells coloured, thresholds dashed."""
    cells = qc[qc["in_rna"]]
    fig, axes = new_figure(1, 2, size=(12, 4.6))
    ax1, ax2 = axes[0]
    umis = cells["rna_umis"]
    _split_hist(ax1, umis, cells["pass"], _log_bins(umis.to_numpy(dtype=float)), log_x=True)
    _limit(ax1, max(thresholds.min_umis, 1), f"qc.min_umis = {thresholds.min_umis:,}")
    ax1.set_xlabel("RNA UMIs per cell (count, log scale)")
    ax1.set_title(f"UMIs per cell (median {np.nanmedian(umis):,.0f})" if len(umis) else "UMIs per cell")
    ax1.legend(frameon=False, fontsize=9)

    for passed, col, name in ((True, PASS_COLOUR, "pass"), (False, FAIL_COLOUR, "fail")):
        sel = cells[cells["pass"] == passed]
        ax2.scatter(sel["rna_umis"].clip(lower=0.5), sel["rna_genes"].clip(lower=0.5), s=14, color=col,
                    alpha=0.8, linewidths=0, label=f"{name} ({len(sel)})")  # fmt: skip
    _limit(ax2, max(thresholds.min_umis, 1), f"qc.min_umis = {thresholds.min_umis:,}")
    _limit(ax2, max(thresholds.min_genes, 1), f"qc.min_genes = {thresholds.min_genes:,}", vertical=False)
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("RNA UMIs per cell (count, log scale)")
    ax2.set_ylabel("detected genes per cell (count, log scale)")
    ax2.set_title(f"Genes against UMIs (median {np.nanmedian(cells['rna_genes']):,.0f} genes)" if len(cells) else "Genes against UMIs")
    ax2.legend(frameon=False, fontsize=9, loc="upper left")
    no_rna = int((~qc["in_rna"]).sum())
    extra = f"; {no_rna} cell(s) without RNA not shown" if no_rna else ""
    fig.suptitle(f"{title}RNA of {len(cells)} cells{extra}")
    return save_png(fig, path)


# ---------------------------------------------------------------- P(s)
@dataclass
class DistanceDecay:
    """Contact probability P(s) per cell on log-spaced distance bins.

    Attributes
    ----------
    distance : numpy.ndarray
        ``(n_bins,)`` geometric centre of each distance bin, in bp.
    curves : pandas.DataFrame
        ``cells x n_bins``: for each cell, cis contacts at distances in the bin divided
        by the number of same-chromosome bin pairs at those distances and by the cell's
        cis contacts (so cells of any depth compare); NaN where there are no bin pairs.
    resolution : int
        Bin size of the ``.scool`` the curves come from, in bp.
    """

    distance: np.ndarray
    curves: pd.DataFrame
    resolution: int


def distance_decay(scool, cells, n_bins: int = 30) -> DistanceDecay:
    """P(s) of ``cells`` from a single-cell cooler file, bin distance k >= 1 (s = k x resolution).

    Parameters
    ----------
    scool
        ``binned/{res}.scool``.
    cells
        Cell names in the file to use.
    n_bins
        Log-spaced distance bins (fewer when there are fewer distinct distances).
    """
    from ..io.cool import cell_bins, cell_pixels, scool_cells

    scool = str(require_file(scool, ".scool file"))
    cells = list(cells)
    if not cells:
        raise InputError("no cells to compute P(s) from", path=scool)
    have = set(scool_cells(scool))
    absent = [c for c in cells if c not in have]
    if absent:
        raise InputError(f"{len(absent)} cell(s) not in the file, e.g. {absent[:3]}", path=scool)
    bins, res = cell_bins(scool, cells[0])
    chrom_id = bins["chrom"].cat.codes.to_numpy() if hasattr(bins["chrom"], "cat") else pd.factorize(bins["chrom"])[0]
    per_chrom = np.bincount(chrom_id)
    kmax = int(per_chrom.max()) - 1
    if kmax < 1:
        raise InputError("every chromosome is a single bin: no distances to show", path=scool)
    ks = np.arange(kmax + 1)
    pairs = np.array([np.clip(per_chrom - k, 0, None).sum() for k in ks], dtype=np.float64)
    edges = np.unique(np.round(np.geomspace(1, kmax + 1, n_bins + 1)).astype(int))
    pairs_binned = np.add.reduceat(pairs, edges[:-1])[: len(edges) - 1]
    # geometric centre of [k_lo, k_hi) in bp
    centre = np.sqrt(edges[:-1] * np.maximum(edges[1:] - 1, edges[:-1])) * res

    rows = np.full((len(cells), len(edges) - 1), np.nan)
    for i, cell in enumerate(cells):
        px = cell_pixels(scool, cell, len(bins))
        b1, b2, n = px["bin1_id"].to_numpy(), px["bin2_id"].to_numpy(), px["count"].to_numpy(dtype=np.float64)
        cis = chrom_id[b1] == chrom_id[b2]
        total = n[cis].sum()
        if total <= 0:
            continue
        by_k = np.bincount((b2 - b1)[cis], weights=n[cis], minlength=kmax + 1)
        binned = np.add.reduceat(by_k, edges[:-1])[: len(edges) - 1]
        with np.errstate(invalid="ignore", divide="ignore"):
            rows[i] = np.where(pairs_binned > 0, binned / pairs_binned / total, np.nan)
    return DistanceDecay(centre, pd.DataFrame(rows, index=cells), res)


def plot_distance_decay(decay: DistanceDecay, groups: pd.Series | None, path, title: str = "", group_name: str = "cell type") -> Path:
    """P(s) per group (e.g. cell type) on log-log axes: the mean of the cells' curves and
    the band between their 25th and 75th percentiles; zero values are left out of the log plot."""
    fig, axes = new_figure(1, 1, size=(8, 5.2))
    ax = axes[0][0]
    curves = decay.curves
    if groups is None:
        groups = pd.Series("all cells", index=curves.index)
    groups = groups.reindex(curves.index).replace("", np.nan).fillna("(no label)").astype(str)
    names = sorted(groups.unique(), key=lambda g: (g == "(no label)", g))
    drawn = 0
    for i, g in enumerate(names):
        sub = curves[groups == g].to_numpy()
        sub = sub[~np.isnan(sub).all(axis=1)]
        if not len(sub):
            continue
        with np.errstate(invalid="ignore"):
            mean = np.nanmean(sub, axis=0)
            lo, hi = np.nanpercentile(sub, 25, axis=0), np.nanpercentile(sub, 75, axis=0)
        ok = mean > 0
        ax.plot(decay.distance[ok], mean[ok], color=colour(i), linewidth=2, marker="o", markersize=3, label=f"{g} ({len(sub)} cells)")
        band = ok & (lo > 0)
        ax.fill_between(decay.distance[band], lo[band], hi[band], color=colour(i), alpha=0.15, linewidth=0)
        drawn += 1
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"genomic distance s (bp, log scale; {decay.resolution:,} bp bins)")
    ax.set_ylabel("P(s): contacts per bin pair / cell's cis contacts (log scale)")
    if drawn:
        ax.legend(frameon=False, fontsize=9, title=group_name)
    else:
        note(ax, "no cell with cis contacts")
    ax.grid(True, which="major", alpha=0.3)
    ax.set_title(f"{title}Contact-distance decay P(s) by {group_name} (mean, band: 25-75th percentile)")
    return save_png(fig, path)


# ---------------------------------------------------------------- failed cells
_NUMBERS = re.compile(r"\s+-?[\d.,]+\s*<\s*-?[\d.,]+$")


def failure_kinds(reason: str) -> list[str]:
    """``"contacts 400 < 1000; RNA UMIs 49 < 500"`` -> ``["contacts", "RNA UMIs"]``."""
    return [_NUMBERS.sub("", part.strip()) for part in reason.split(";") if part.strip()]


def failed_cells_page(qc: pd.DataFrame, path, thresholds: QCThresholds, label_key: str | None = None, title: str = "") -> Path:
    """An HTML page: failures per reason, then every failing cell with its numbers and reason."""
    failed = qc[~qc["pass"]]
    counts: dict[str, int] = {}
    for reason in failed["reason"]:
        for kind in failure_kinds(reason):
            counts[kind] = counts.get(kind, 0) + 1
    summary = pd.DataFrame({"reason": list(counts), "cells": list(counts.values())}).sort_values(["cells", "reason"], ascending=[False, True])
    th = (f"Thresholds: contacts >= {thresholds.min_contacts:,}, cis fraction >= {thresholds.min_cis_fraction:g}, "
          f"RNA UMIs >= {thresholds.min_umis:,}, detected genes >= {thresholds.min_genes:,} (config section qc).")  # fmt: skip
    kept = failed["cis"] + failed["trans"]
    table = pd.DataFrame(
        {
            "cell": failed.index,
            **({label_key: failed[label_key].to_numpy()} if label_key and label_key in failed.columns else {}),
            "contacts": [f"{v:,.0f}" if pd.notna(v) else "-" for v in kept],
            "cis fraction": [f"{c / k:.2f}" if pd.notna(k) and k > 0 else "-" for c, k in zip(failed["cis"], kept)],
            "RNA UMIs": [f"{v:,.0f}" if pd.notna(v) else "-" for v in failed["rna_umis"]],
            "genes": [f"{v:,.0f}" if pd.notna(v) else "-" for v in failed["rna_genes"]],
            "reason": failed["reason"].to_numpy(),
        }
    )
    parts = [
        f"<p>{esc(th)}</p>",
        "<h2>Failures by reason</h2>",
        html_table(summary, numeric=["cells"]) if len(summary) else "<p>No cell failed.</p>",
        "<p>A cell can fail for several reasons, so the counts may add up to more than the failing cells.</p>",
    ]
    if len(table):
        parts += ["<h2>Failing cells</h2>", html_table(table, numeric=["contacts", "cis fraction", "RNA UMIs", "genes"])]
    lead = f"{len(failed)} of {len(qc)} cells failed QC; {int(qc['pass'].sum())} pass and are used for training."
    return write_html(path, f"{title}Cells failing QC", parts, lead=lead)


def qc_report(qc_path, scool, out_dir, thresholds: QCThresholds, label_key: str | None = "cell_type", dataset: str = "") -> dict[str, Path]:
    """Every QC figure and the failed-cells page into ``out_dir``: ``contacts.png``,
    ``distance_decay.png``, ``rna.png`` and ``failed_cells.html``."""
    out = Path(out_dir)
    qc = load_qc(qc_path)
    prefix = f"{dataset}: " if dataset else ""
    paths = {
        "contacts": plot_contacts(qc, out / "contacts.png", thresholds, prefix),
        "rna": plot_rna(qc, out / "rna.png", thresholds, prefix),
        "failed_cells": failed_cells_page(qc, out / "failed_cells.html", thresholds, label_key, prefix),
    }
    cells = list(qc.index[qc["pass"]])
    if not cells:  # fall back to every cell with pairs, so the figure still says something
        cells = list(qc.index[qc["in_pairs"]])
    decay = distance_decay(scool, cells)
    groups = qc[label_key] if label_key and label_key in qc.columns else None
    paths["distance_decay"] = plot_distance_decay(decay, groups, out / "distance_decay.png", prefix, label_key if groups is not None else "cell type")
    log.info("QC report: %s", {k: str(v) for k, v in paths.items()})
    return paths
