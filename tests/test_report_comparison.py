"""The summary's per-method table: joint vs each latent vs the baselines vs the shuffled
control, held-out and training cells side by side, in the TSV, the text, the page and the figure."""

from __future__ import annotations

import pandas as pd
import pytest
from helpers import assert_labelled, summary_inputs

from ampflow.report.comparison import comparison_columns
from ampflow.report.summary import summary_report, text_table

METHODS = ("joint", "rna_latent", "hic_latent", "rna_baseline", "hic_baseline")


def method_scores(base: float) -> dict:
    """ARI base + 0.01 i and NMI base + 0.02 i for the i-th method, so every cell of the table is distinct."""
    return {m: {"ari": base + 0.01 * i, "nmi": base + 0.02 * i, "leiden_resolution": 0.5, "n_clusters": 4, "representation": m} for i, m in enumerate(METHODS)}


def scores_with_split() -> dict:
    held = {
        "n_cells": 30, "n_labelled": 30, "methods": method_scores(0.5),
        "foscttm": {"foscttm": 0.12, "foscttm_rna_to_hic": 0.1, "foscttm_hic_to_rna": 0.14},
        "shuffled_control": {"foscttm": 0.497, "tolerance": 0.158, "chance": 0.5, "at_chance": True},
    }  # fmt: skip
    train = {"n_cells": 90, "n_labelled": 90, "methods": method_scores(0.7)}
    return {"ari": 0.5, "nmi": 0.5, "foscttm": 0.12, "headline_group": "heldout", "groups": {"heldout": held, "train": train}}


def scores_without_split() -> dict:
    every = {
        "n_cells": 118, "n_labelled": 118, "methods": {**method_scores(0.6), "rna_baseline": None, "hic_baseline": None},
        "foscttm": {"foscttm": 0.2}, "shuffled_control": {"foscttm": 0.51, "tolerance": 0.08},
    }  # fmt: skip
    return {"ari": 0.6, "nmi": 0.6, "foscttm": 0.2, "headline_group": "all", "groups": {"all": every}}


def test_comparison_columns_flatten_every_group():
    cols = comparison_columns(scores_with_split())
    assert cols["heldout_n_cells"] == 30 and cols["train_n_cells"] == 90
    assert cols["heldout_hic_baseline_ari"] == pytest.approx(0.54) and cols["train_rna_latent_nmi"] == pytest.approx(0.72)
    assert cols["heldout_foscttm"] == 0.12 and cols["heldout_shuffled_foscttm"] == 0.497
    assert "train_foscttm" not in cols and "train_shuffled_foscttm" not in cols
    assert comparison_columns({"ari": 0.9}) == {}  # a scores.json without groups


def test_summary_shows_methods_and_groups_side_by_side(tmp_path, figures):
    cfgs = summary_inputs(tmp_path, {"500kb_s10": scores_with_split(), "250kb_s12": scores_without_split()})
    paths = summary_report(cfgs, tmp_path / "out", dataset="toy")
    table = pd.read_csv(paths["tsv"], sep="\t")
    assert len(table) == 2 and table.loc[0, "heldout_shuffled_foscttm"] == 0.497
    text = paths["txt"].read_text()
    assert text_table(table) == text
    lines = text.splitlines()
    # the headline table first, unchanged
    assert lines[0].split()[:4] == ["configuration", "ARI", "NMI", "FOSCTTM"] and lines[2].split()[:4] == ["500kb_s10", "0.500", "0.500", "0.120"]
    start = lines.index("Scores by method (cells scored: 500kb_s10: held-out 30, training 90; 250kb_s12: all cells 118)")
    header = lines[start + 1]
    for col in ("held-out ARI", "held-out NMI", "held-out FOSCTTM", "training ARI", "training NMI", "all cells ARI", "all cells FOSCTTM"):
        assert col in header
    assert "training FOSCTTM" not in header
    body = lines[start + 3 :]
    assert len(body) == 2 * 8  # six methods, the paired latents, the control; per configuration
    hic_baseline = next(ln for ln in body if ln.startswith("500kb_s10") and "Hi-C-only baseline" in ln)
    # per group: ARI, its chance, NMI, its chance, k-means ARI, its chance, k-means ARI
    # vs batch (none in these scores), then FOSCTTM where computed (held-out and all
    # cells): side by side
    held, train, every = ["0.540", "-", "0.580", "-", "-", "-", "-", "-"], ["0.740", "-", "0.780", "-", "-", "-", "-"], ["-"] * 8
    assert hic_baseline.split()[-23:] == held + train + every
    control = next(ln for ln in body if ln.startswith("500kb_s10") and "shuffled pairing" in ln)
    assert "chance 0.5 +/- 0.158" in control and control.split()[-23:] == ["-"] * 7 + ["0.497"] + ["-"] * 15
    paired = next(ln for ln in body if ln.startswith("250kb_s12") and "paired latents" in ln)
    assert paired.split()[-1] == "0.200"
    no_baseline = next(ln for ln in body if ln.startswith("250kb_s12") and "RNA-only baseline" in ln)
    assert no_baseline.split()[-3:] == ["-", "-", "-"]
    assert all(ln == ln.rstrip() for ln in lines)
    page = paths["html"].read_text()
    assert "Scores by method" in page and "shuffled pairing" in page and "held-out FOSCTTM" in page
    fig = figures[-1]
    assert_labelled(fig)
    assert [ax.get_title().startswith("ARI by method") for ax in fig.axes] == [False, True]
    assert "held-out cells" in fig.axes[0].get_title() and "all cells" in fig.axes[0].get_title()
