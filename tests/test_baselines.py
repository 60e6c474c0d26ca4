"""Controls and baselines of the evaluation: the shuffled-pairing control against the known
answers, the RNA-only and Hi-C-only baselines on planted clusters, and held-out and
training cells scored apart."""

from __future__ import annotations

import json
import math

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

pytest.importorskip("igraph")

from ampflow.base.errors import InputError  # noqa: E402
from ampflow.evaluate.baselines import bandnorm_baseline, hic_baseline, load_baselines, rna_baseline  # noqa: E402
from ampflow.evaluate.clusters import leiden_search  # noqa: E402
from ampflow.evaluate.controls import chance_tolerance, derangement, shuffled_foscttm  # noqa: E402
from ampflow.evaluate.foscttm import foscttm  # noqa: E402
from ampflow.evaluate.groups import cell_groups, fit_mask, split_labels  # noqa: E402
from ampflow.evaluate.run import main_evaluate  # noqa: E402
from ampflow.evaluate.scores import METHODS, group_scores, headline_scores, score_group  # noqa: E402


def planted(n=240, k=4, n_genes=300, n_anchors=40, n_strata=4, seed=0, heldout=0.0):
    """A paired data folder's two files with ``k`` planted cell types, and the types.

    RNA: Poisson counts whose gene profile differs by type (40 marker genes 6x up).
    Hi-C: strata features (distance decay 1/(k+1)) with an eighth of them 4x up per type.
    ``heldout`` > 0 adds ``obs["split"]`` with about that fraction held out.
    """
    rng = np.random.default_rng(seed)
    types = rng.integers(0, k, n)
    ids = pd.Index([f"cell{i:04d}" for i in range(n)], name="cell_id")
    obs = pd.DataFrame({"cell_type": [f"type_{t}" for t in types]}, index=ids)
    if heldout:
        obs["split"] = np.where(rng.random(n) < heldout, "heldout", "train")

    def model_file(profile, lib, var, modality):
        profile = profile / profile.sum(axis=1, keepdims=True)
        x = sp.csr_matrix(rng.poisson(profile[types] * lib[:, None]).astype(np.float32))
        a = ad.AnnData(X=x, obs=obs.copy(), var=var)
        a.layers["counts"] = x.copy()
        a.uns["ampflow"] = {"modality": modality, "counts_layer": "counts"}
        return a

    genes = np.tile(rng.gamma(2.0, 1.0, n_genes), (k, 1))
    for t in range(k):
        genes[t, rng.choice(n_genes, 40, replace=False)] *= 6
    rna = model_file(genes, rng.integers(2000, 6000, n), pd.DataFrame(index=[f"Gene{i}" for i in range(n_genes)]), "rna")

    strata = np.concatenate([np.full(n_anchors - s, s) for s in range(n_strata)])
    anchor = np.concatenate([np.arange(n_anchors - s) for s in range(n_strata)])
    names = [f"chr1:{a * 500000}-{(a + 1) * 500000}" + (f"-{s}" if s else "") for a, s in zip(anchor, strata, strict=True)]
    contacts = np.tile(10.0 / (strata + 1), (k, 1))
    for t in range(k):
        contacts[t, rng.choice(len(strata), len(strata) // 8, replace=False)] *= 4
    hic = model_file(contacts, rng.integers(1500, 4000, n), pd.DataFrame({"stratum": strata}, index=names), "hic")
    return rna, hic, types


def embeddings_for(rna: ad.AnnData, types, seed=0, d=8, noise=0.5) -> ad.AnnData:
    """Latents of the data folder's cells: type centres plus noise, Hi-C a noisy copy of RNA."""
    rng = np.random.default_rng(seed)
    z = rng.normal(scale=8.0, size=(types.max() + 1, d))[types] + rng.normal(size=(len(types), d))
    a = ad.AnnData(obs=rna.obs.copy())
    a.obsm["X_rna"] = (z + rng.normal(scale=noise, size=z.shape)).astype(np.float32)
    a.obsm["X_hic"] = (z + rng.normal(scale=noise, size=z.shape)).astype(np.float32)
    a.obsm["X_joint"] = ((a.obsm["X_rna"] + a.obsm["X_hic"]) / 2).astype(np.float32)
    return a


def ari_of(emb, types, seed=0):
    return leiden_search(emb, pd.Series([str(t) for t in types]), seed)["ari"]


# ---------------------------------------------------------------- the shuffled-pairing control
def test_derangement_moves_every_row_and_is_seeded():
    for n in (2, 3, 10, 501):
        p = derangement(n, seed=n)
        assert sorted(p) == list(range(n)) and (p != np.arange(n)).all()
    assert (derangement(50, seed=1) == derangement(50, seed=1)).all()
    assert (derangement(50, seed=1) != derangement(50, seed=2)).any()


@pytest.mark.parametrize("n", [60, 400, 1500])
def test_shuffled_control_at_chance_on_random_data(n):
    rng = np.random.default_rng(n)
    x, y = rng.normal(size=(n, 6)), rng.normal(size=(n, 6))
    c = shuffled_foscttm(x, y, seed=0)
    # the known answer: unrelated pairs score 0.5, within 3 sd of the mean of n uniforms
    assert c["tolerance"] == pytest.approx(3 / math.sqrt(12 * n))
    assert abs(c["foscttm"] - 0.5) <= 3 / math.sqrt(12 * n)
    assert c["at_chance"] and c["chance"] == 0.5 and c["n_cells"] == n


def test_perfect_pairing_scores_zero_and_its_shuffle_chance():
    """Identical latents (perfect pairing, strong cluster structure): FOSCTTM 0, while
    breaking the pairing brings it to chance whatever the structure."""
    rna, _, types = planted(n=600)
    a = embeddings_for(rna, types, noise=0.0)
    x, y = a.obsm["X_rna"], a.obsm["X_hic"]
    assert foscttm(x, y) == 0.0
    for seed in (0, 1, 2):
        c = shuffled_foscttm(x, y, seed=seed)
        assert abs(c["foscttm"] - 0.5) <= chance_tolerance(600), c


# ---------------------------------------------------------------- baselines
def test_rna_baseline_recovers_planted_clusters():
    rna, _, types = planted()
    emb, info = rna_baseline(rna, np.ones(rna.n_obs, dtype=bool))
    assert emb.shape == (rna.n_obs, 50) and info["n_hvg"] == 300
    assert ari_of(emb, types) > 0.95
    # the same embedding against shuffled labels: chance
    assert abs(ari_of(emb, np.random.default_rng(1).permutation(types))) < 0.05


def test_rna_baseline_on_label_shuffled_counts_scores_near_zero():
    """Counts without any type structure (every cell drawn from one profile): no cluster
    the labels could agree with."""
    rna, _, types = planted()
    rng = np.random.default_rng(3)
    rna.layers["counts"] = sp.csr_matrix(rna.layers["counts"].toarray()[rng.permutation(rna.n_obs)])
    emb, _ = rna_baseline(rna, np.ones(rna.n_obs, dtype=bool))
    assert abs(ari_of(emb, types)) < 0.05


def test_hic_baseline_recovers_planted_clusters():
    _, hic, types = planted()
    emb, info = hic_baseline(hic, np.ones(hic.n_obs, dtype=bool))
    assert info["n_strata"] == 4 and info["n_features"] == hic.n_vars
    assert ari_of(emb, types) > 0.9
    # the strata can be read from the feature names alone, with the same result
    del hic.var["stratum"]
    assert np.allclose(hic_baseline(hic, np.ones(hic.n_obs, dtype=bool))[0], emb, atol=1e-4)


@pytest.mark.parametrize("build", [rna_baseline, hic_baseline])
def test_baselines_learn_from_training_cells_only(build):
    """Whatever the held-out cells hold, the training cells' embedding does not move."""
    rna, hic, _ = planted(heldout=0.25)
    data = rna if build is rna_baseline else hic
    fit = (data.obs["split"] == "train").to_numpy()
    before, _ = build(data, fit)
    noisy = data.layers["counts"].toarray()
    noisy[~fit] = np.random.default_rng(5).poisson(20.0, size=noisy[~fit].shape)
    data.layers["counts"] = sp.csr_matrix(noisy)
    after, _ = build(data, fit)
    assert np.allclose(np.abs(after[fit]), np.abs(before[fit]), atol=1e-4)  # PCA axes up to sign
    assert not np.allclose(np.abs(after[~fit]), np.abs(before[~fit]), atol=1e-2)


def test_load_baselines_aligns_rows_and_checks_the_split(tmp_path):
    rna, hic, _ = planted(n=120, heldout=0.25)
    rna.write_h5ad(tmp_path / "rna.h5ad")
    hic.write_h5ad(tmp_path / "hic.h5ad")
    cells = rna.obs_names[::-1][:100]  # another order, and not every cell
    split = split_labels(rna.obs).loc[cells]
    embs, info = load_baselines(tmp_path, cells, split=split)
    # learned from the embedded training cells only: a cell the model never saw is not one
    fit = ((rna.obs["split"] == "train") & rna.obs_names.isin(cells)).to_numpy()
    direct, _ = rna_baseline(rna, fit)
    assert np.allclose(embs["rna_baseline"], direct[rna.obs_names.get_indexer(cells)], atol=1e-4)
    assert info["rna"]["fit_on"] == "train" and info["rna"]["n_cells_fit"] == int(fit.sum())
    assert info["hic"]["n_cells_embedded"] == 120
    with pytest.raises(InputError, match="missing from this data file") as err:
        load_baselines(tmp_path, cells.append(pd.Index(["stranger"])), split=None)
    assert err.value.path == str(tmp_path / "rna.h5ad")
    flipped = split.copy()
    flipped.iloc[0] = "heldout" if flipped.iloc[0] == "train" else "train"
    with pytest.raises(InputError, match="different split"):
        load_baselines(tmp_path, cells, split=flipped)


# ---------------------------------------------------------------- groups
def test_groups_from_the_split_column():
    obs = pd.DataFrame({"split": ["train", "heldout", "train"]}, index=["a", "b", "c"])
    a = ad.AnnData(obs=obs.copy())
    groups = cell_groups(a)
    assert list(groups) == ["heldout", "train"]
    assert groups["heldout"].tolist() == [1] and groups["train"].tolist() == [0, 2]
    assert list(cell_groups(ad.AnnData(obs=obs.drop(columns="split")))) == ["all"]
    a.obs.loc["c", "split"] = "test"
    with pytest.raises(InputError, match="split other than") as err:
        cell_groups(a, path="emb.h5ad")
    assert err.value.key == "obs/split" and "c: test" in err.value.value
    # a data file's cells missing from the embeddings never steer a baseline
    assert fit_mask(pd.Index(["a", "b", "z"]), split_labels(obs), None).tolist() == [True, False, False]


def test_a_group_too_small_to_score_is_skipped_and_said_so():
    rna, _, types = planted(n=40)
    a = embeddings_for(rna, types)
    tiny = score_group(a, np.array([3, 7]), name="heldout")
    assert tiny == {"n_cells": 2, "n_labelled": 2, "skipped": "fewer than 3 cells"}
    head = headline_scores({"heldout": tiny}, "cell_type", seed=0)
    assert head["headline_group"] == "heldout" and head["ari"] is None and head["foscttm"] is None and head["n_cells"] == 2


@pytest.mark.slow
def test_heldout_scores_use_only_heldout_cells():
    """The held-out group's scores equal those of a hand-made AnnData of the held-out
    cells alone (no split column, so one group, "all")."""
    rna, hic, types = planted(n=150, heldout=0.3)
    a = embeddings_for(rna, types, noise=2.0)
    fit = (rna.obs["split"] == "train").to_numpy()
    baselines = {"rna_baseline": rna_baseline(rna, fit)[0], "hic_baseline": hic_baseline(hic, fit)[0],
                 "bandnorm_baseline": bandnorm_baseline(hic, fit)[0]}  # fmt: skip
    full = group_scores(a, baselines, seed=3)
    assert list(full) == ["heldout", "train"]
    held = (a.obs["split"] == "heldout").to_numpy()
    subset = a[held].copy()
    del subset.obs["split"]
    alone = group_scores(subset, {k: v[held] for k, v in baselines.items()}, seed=3)
    assert alone["all"] == full["heldout"]
    assert full["heldout"]["n_cells"] == held.sum() and full["train"]["n_cells"] == (~held).sum()
    # alignment only on held-out cells; clustering in both groups, for every method
    assert "foscttm" not in full["train"] and "shuffled_control" not in full["train"]
    assert set(full["train"]["methods"]) == set(METHODS) and all(full["train"]["methods"].values())
    # and the training group likewise equals its own subset
    train = a[~held].copy()
    del train.obs["split"]
    own = score_group(train, np.arange(train.n_obs), {k: v[~held] for k, v in baselines.items()}, seed=3, alignment=False)
    assert own == full["train"]


@pytest.mark.slow
def test_scores_json_layout_with_split_and_data(tmp_path):
    rna, hic, types = planted(n=160, heldout=0.25)
    data = tmp_path / "data"
    data.mkdir()
    rna.write_h5ad(data / "rna.h5ad")
    hic.write_h5ad(data / "hic.h5ad")
    a = embeddings_for(rna, types)
    a.write_h5ad(tmp_path / "embeddings.h5ad")
    scores = main_evaluate(tmp_path / "embeddings.h5ad", tmp_path / "eval", seed=0, data=data)
    assert json.loads((tmp_path / "eval" / "scores.json").read_text()) == scores
    assert scores["headline_group"] == "heldout"
    held = scores["groups"]["heldout"]
    assert scores["ari"] == held["methods"]["joint"]["ari"] and scores["foscttm"] == held["foscttm"]["foscttm"]
    assert scores["n_cells"] == held["n_cells"] == int((rna.obs["split"] == "heldout").sum())
    for group in ("heldout", "train"):
        for method in METHODS:
            assert scores["groups"][group]["methods"][method]["ari"] > 0.9, (group, method)
    assert held["shuffled_control"]["at_chance"] and held["foscttm"]["foscttm"] < 0.1
    assert scores["baselines"]["rna"]["fit_on"] == "train" and scores["baselines"]["hic"]["n_strata"] == 4


@pytest.mark.parametrize("log1p, max_stratum", [(True, None), (False, 2)])
def test_bandnorm_baseline_equals_a_dense_recomputation(log1p, max_stratum):
    """The referee: band normalisation written out densely here (the 20 lines a user
    would write) and a full-SVD PCA; coordinates equal up to each axis's sign. Without
    its log and up to stratum 2, likewise."""
    from sklearn.decomposition import PCA

    rng = np.random.default_rng(0)
    n, per = 60, 25
    stratum = np.repeat(np.arange(4), per)
    counts = rng.poisson(rng.gamma(2.0, 1.0, (n, 1)) * (30.0 / (1 + stratum)) * rng.gamma(5.0, 0.2, (1, 4 * per)))
    adata = ad.AnnData(sp.csr_matrix(counts.astype(np.float32)), var=pd.DataFrame({"stratum": stratum}, index=[f"f{i}" for i in range(4 * per)]))
    fit = np.arange(n) % 5 != 0
    got, info = bandnorm_baseline(adata, fit, n_comps=5, log1p=log1p, max_stratum=max_stratum)
    read = (stratum >= 1) & (stratum <= (max_stratum or 3))
    x = counts[:, read].astype(float)
    s = stratum[read]
    y = np.empty_like(x)
    for k in np.unique(s):
        band = x[:, s == k]
        cell_mean = band.mean(axis=1, keepdims=True)
        y[:, s == k] = band / cell_mean * cell_mean[fit].mean()
    y = np.log1p(y) if log1p else y
    want = PCA(5, svd_solver="full").fit(y[fit]).transform(y)
    signs = np.sign((got * want).sum(axis=0))
    np.testing.assert_allclose(got * signs, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert info["n_features"] == int(read.sum()) and info["n_comps"] == 5


def test_bandnorm_baseline_without_strata_to_read_names_them():
    stratum = np.repeat(np.arange(4), 5)
    adata = ad.AnnData(sp.csr_matrix(np.ones((6, 20), dtype=np.float32)), var=pd.DataFrame({"stratum": stratum}, index=[f"f{i}" for i in range(20)]))
    with pytest.raises(InputError, match=r"needs strata 1 <= k <= 0; the file has strata 0-3"):
        bandnorm_baseline(adata, np.ones(6, dtype=bool), max_stratum=0)
