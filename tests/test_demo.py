"""Demo data: deterministic by seed; each modality alone recovers its own groups of cell
types and cannot tell apart the types that differ only in the other modality."""

from __future__ import annotations

import hashlib

import numpy as np
import pandas as pd
import pytest
from sklearn.cluster import KMeans
from sklearn.decomposition import PCA
from sklearn.metrics import adjusted_rand_score

from ampflow.demo import CELL_TYPES, HIC_GROUP, RNA_GROUP, write_demo
from ampflow.io.genome import read_chromsizes
from ampflow.io.rna import read_rna, round_counts
from ampflow.io.sheet import read_sheet
from ampflow.prepare.cells import ParseOptions, bin_cells, write_scool
from ampflow.prepare.strata import build_strata


def digest(folder):
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(folder).as_posix().encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def test_same_seed_same_bytes(tmp_path):
    write_demo(tmp_path / "a", n_cells=8, seed=7, n_genes=300)
    write_demo(tmp_path / "b", n_cells=8, seed=7, n_genes=300)
    write_demo(tmp_path / "c", n_cells=8, seed=8, n_genes=300)
    # sheets hold their own folder's paths; compare everything else
    for d in "abc":
        (tmp_path / d / "cells.tsv").unlink()
    assert digest(tmp_path / "a") == digest(tmp_path / "b")
    assert digest(tmp_path / "a") != digest(tmp_path / "c")


def cluster_ari(features: np.ndarray, truth, standardize: bool) -> float:
    """PCA (15) + k-means ARI; ``standardize`` z-scores features first (not for
    log-normalised RNA, where it would blow up thousands of noise genes)."""
    z = (features - features.mean(0)) / (features.std(0) + 1e-6) if standardize else features
    pcs = PCA(n_components=15, random_state=0).fit_transform(z)
    labels = KMeans(n_clusters=len(set(truth)), n_init=10, random_state=0).fit_predict(pcs)
    return adjusted_rand_score(truth, labels)


def groups(types, group_of) -> np.ndarray:
    """The group of each cell type name, as the demo defines them."""
    return np.array([group_of[CELL_TYPES.index(t)] for t in types])


@pytest.fixture(scope="module")
def demo40(tmp_path_factory):
    d = tmp_path_factory.mktemp("demo40")
    write_demo(d, n_cells=40, seed=1)
    truth = pd.read_csv(d / "truth.tsv", sep="\t", index_col="cell_id")["cell_type"]
    return d, truth


def test_expression_groups_from_rna_alone(demo40):
    d, truth = demo40
    a = read_rna(d / "rna.tsv.gz")
    X, _ = round_counts(a.X)
    X = X.toarray()
    keep = X.sum(1) >= 500  # the demo's deliberately poor cell is excluded, as QC would
    X = np.log1p(X[keep] / X[keep].sum(1, keepdims=True) * 1e4)
    X = X[:, X.var(0) > 0]
    types = truth.loc[a.obs_names[keep]].to_numpy()
    # the expression groups (astrocytes and oligodendrocytes share one) come out whole...
    assert cluster_ari(X, groups(types, RNA_GROUP), standardize=False) >= 0.9
    # ...and the four types cannot: a perfect split of the groups scores 5/7 against them
    assert cluster_ari(X, types, standardize=False) <= 0.8


def test_chromatin_groups_from_hic_alone(demo40, tmp_path):
    d, truth = demo40
    sheet = read_sheet(d / "cells.tsv")
    sizes = read_chromsizes(d / "chrom.sizes")
    opts = ParseOptions(tuple(sizes.items()), None, "", "auto", None, (1_000_000,))
    stats = bin_cells(sheet, opts, tmp_path / "cache")
    cells = [c for c in sheet["cell_id"] if stats.loc[c, "total"] >= 1000]
    write_scool(tmp_path / "x.scool", list(sheet["cell_id"]), tmp_path / "cache", opts, 1_000_000)
    hic = build_strata(str(tmp_path / "x.scool"), cells, list(sizes), n_strata=5, min_cells=3, min_count=3)
    X = hic.X.toarray()
    k = hic.var["stratum"].to_numpy()
    for s in np.unique(k):  # per-stratum depth normalisation removes each cell's decay
        m = k == s
        X[:, m] = X[:, m] / np.maximum(X[:, m].sum(1, keepdims=True), 1) * m.sum()
    types = truth.loc[cells].to_numpy()
    # the chromatin groups (the two neuron types share one) come out whole, the types cannot
    assert cluster_ari(np.log1p(X), groups(types, HIC_GROUP), standardize=True) >= 0.9
    assert cluster_ari(np.log1p(X), types, standardize=True) <= 0.8
