"""Latent evaluation: FOSCTTM, Leiden ARI/NMI, the UMAP figure and scores.json."""

from __future__ import annotations

import json
import os

import anndata as ad
import numpy as np
import pandas as pd
import pytest

pytest.importorskip("igraph")

from ampflow.base.errors import InputError  # noqa: E402
from ampflow.evaluate.clusters import check_embeddings, cluster_scores  # noqa: E402
from ampflow.evaluate.foscttm import foscttm, foscttm_directions  # noqa: E402
from ampflow.evaluate.run import main_evaluate  # noqa: E402
from ampflow.evaluate.umap import _config_name  # noqa: E402

SCORE_KEYS = {
    "ari",
    "nmi",
    "ari_shuffled_p95",
    "nmi_shuffled_p95",
    "leiden_resolution",
    "n_clusters",
    "n_cells",
    "n_labelled",
    "foscttm",
    "foscttm_rna_to_hic",
    "foscttm_hic_to_rna",
    "use_rep",
    "label_key",
    "seed",
    "knn_metric",
}

#: The sections scores.json adds beside the headline keys: which group the headline
#: is from, every group's scores, and how the baselines were made.
SECTION_KEYS = {"headline_group", "groups", "baselines", "modalities"}


def naive_foscttm(x, y):
    """The definition, one pair at a time."""
    n = len(x)

    def direction(a, b):
        fracs = []
        for i in range(n):
            true = np.linalg.norm(a[i] - b[i])
            closer = sum(np.linalg.norm(a[i] - b[j]) < true for j in range(n) if j != i)
            fracs.append(closer / (n - 1))
        return float(np.mean(fracs))

    return direction(x, y), direction(y, x)


def blobs(n=300, k=5, d=8, seed=0, spread=10.0, noise=0.5):
    """Embeddings of ``k`` well-separated cell types, the Hi-C latent a noisy copy of RNA."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(scale=spread, size=(k, d))
    label = rng.integers(0, k, n)
    z = centres[label] + rng.normal(size=(n, d))
    a = ad.AnnData(obs=pd.DataFrame({"cell_type": [f"type_{i}" for i in label]}, index=[f"cell{i}" for i in range(n)]))
    a.obsm["X_rna"] = (z + rng.normal(scale=noise, size=z.shape)).astype(np.float32)
    a.obsm["X_hic"] = (z + rng.normal(scale=noise, size=z.shape)).astype(np.float32)
    a.obsm["X_joint"] = z.astype(np.float32)
    return a


# ---------------------------------------------------------------- FOSCTTM
def test_foscttm_zero_for_identical_embeddings():
    x = np.random.default_rng(0).normal(size=(50, 4))
    assert foscttm(x, x) == 0.0
    assert foscttm_directions(x, x) == (0.0, 0.0)


def test_foscttm_half_for_unrelated_embeddings():
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(400, 10)), rng.normal(size=(400, 10))
    assert foscttm(x, y) == pytest.approx(0.5, abs=0.05)


@pytest.mark.parametrize("block_size", [None, 1, 7, 1000])
def test_foscttm_matches_naive_definition(block_size):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(40, 3)).astype(np.float32)
    y = (x + rng.normal(scale=0.8, size=x.shape)).astype(np.float32)
    x_to_y, y_to_x = foscttm_directions(x, y, block_size=block_size)
    want = naive_foscttm(x.astype(np.float64), y.astype(np.float64))
    assert (x_to_y, y_to_x) == want
    # the two directions differ here, so a swapped direction would be caught
    assert want[0] != want[1]
    assert foscttm(x, y, block_size=block_size) == pytest.approx((want[0] + want[1]) / 2, abs=1e-15)


def test_foscttm_rejects_bad_shapes_and_nan():
    x = np.zeros((5, 2))
    with pytest.raises(ValueError, match="same shape"):
        foscttm(x, np.zeros((4, 2)))
    bad = np.ones((5, 2))
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="finite"):
        foscttm(bad, np.ones((5, 2)))


# ---------------------------------------------------------------- clustering
def test_cluster_scores_recover_separated_blobs():
    a = blobs()
    before = set(a.obsm.keys()), set(a.obs.columns)
    s = cluster_scores(a, seed=0)
    assert set(s) == SCORE_KEYS
    assert s["ari"] > 0.95 and s["nmi"] > 0.95
    assert s["n_clusters"] == 5
    assert s["n_cells"] == s["n_labelled"] == 300
    assert s["leiden_resolution"] in {round(0.1 * k, 1) for k in range(1, 21)}
    assert s["foscttm"] < 0.1
    assert s["foscttm"] == pytest.approx((s["foscttm_rna_to_hic"] + s["foscttm_hic_to_rna"]) / 2)
    # the caller's object is left as it was
    assert (set(a.obsm.keys()), set(a.obs.columns)) == before


def test_cluster_scores_random_labels_score_near_zero():
    a = blobs(seed=3)
    a.obs["cell_type"] = np.random.default_rng(4).choice(["a", "b", "c", "d", "e"], a.n_obs)
    s = cluster_scores(a, seed=0)
    assert abs(s["ari"]) < 0.05
    # the shuffled-label control reads these labels as chance: the score is inside its band
    assert s["ari"] <= s["ari_shuffled_p95"] and s["nmi"] <= s["nmi_shuffled_p95"] + 0.02


def test_kmeans_scores_with_their_shuffled_control():
    from ampflow.evaluate.clusters import kmeans_scores

    a = blobs()
    labels = a.obs["cell_type"]
    k = kmeans_scores(a.obsm["X_joint"], labels, seed=0)
    assert k["k"] == labels.nunique() and k["ari"] > 0.95 and k["ari_shuffled_p95"] < 0.05
    noise = pd.Series(np.random.default_rng(4).choice(list("abcde"), a.n_obs), index=labels.index)
    r = kmeans_scores(a.obsm["X_joint"], noise, seed=0)
    assert abs(r["ari"]) < 0.05 and r["ari"] <= r["ari_shuffled_p95"]
    assert kmeans_scores(a.obsm["X_joint"], None) is None
    # against the batch: the clusters are the types, so a batch that is the type reads
    # as high as the type, one drawn apart from it as chance; one batch: not scored
    assert kmeans_scores(a.obsm["X_joint"], labels, 0, labels.astype(str))["ari_batch"] == k["ari"]
    assert abs(kmeans_scores(a.obsm["X_joint"], labels, 0, noise)["ari_batch"]) < 0.05
    assert "ari_batch" not in kmeans_scores(a.obsm["X_joint"], labels, 0, pd.Series("b", index=labels.index))


@pytest.mark.parametrize(
    "n, n_labels, n_clusters",
    [(34, 4, 3), (163, 4, 4), (200, 7, 12), (7469, 20, 15), (10, 2, 1), (10, 1, 1), (50, 1, 3), (5, 5, 5)],
)
def test_shuffled_label_control_equals_scikit_learns_scores(n, n_labels, n_clusters):
    """The shuffled-label control scores each permutation from its contingency table;
    the referee is scikit-learn's ``adjusted_rand_score`` and
    ``normalized_mutual_info_score`` on the same permuted labels (the same seeded
    draws), single labels and single clusters among the cases: the same percentiles."""
    from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

    from ampflow.evaluate.controls import shuffled_labels

    rng = np.random.default_rng(n + n_labels + n_clusters)
    truth = np.array([f"type{i}" for i in rng.integers(0, n_labels, n)], dtype=object)
    clusters = rng.integers(0, n_clusters, n)
    draws = np.random.default_rng(3)
    perms = [draws.permutation(truth) for _ in range(50)]
    want = {
        "ari_shuffled_p95": np.percentile([adjusted_rand_score(p, clusters) for p in perms], 95),
        "nmi_shuffled_p95": np.percentile([normalized_mutual_info_score(p, clusters) for p in perms], 95),
    }
    got = shuffled_labels(truth, clusters, seed=3, n=50)
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_cluster_scores_deterministic_for_a_seed():
    a = blobs(n=250, k=6, spread=2.0, seed=5)  # overlapping blobs, so Leiden has choices to make
    assert cluster_scores(a, seed=7) == cluster_scores(a.copy(), seed=7)


def test_cluster_scores_without_labels():
    a = blobs(n=120)
    a.obs["cell_type"] = np.nan
    s = cluster_scores(a)
    assert s["ari"] is None and s["nmi"] is None and s["label_key"] is None
    assert s["leiden_resolution"] == 1.0 and s["n_labelled"] == 0
    del a.obs["cell_type"]
    assert cluster_scores(a)["ari"] is None


def test_cluster_scores_ignore_unlabelled_cells():
    a = blobs()
    a.obs["cell_type"] = a.obs["cell_type"].astype(object)
    a.obs.iloc[:30, a.obs.columns.get_loc("cell_type")] = None
    s = cluster_scores(a)
    assert s["n_labelled"] == 270 and s["ari"] > 0.95


# ---------------------------------------------------------------- files
def test_main_evaluate_writes_scores_and_figure(tmp_path):
    a = blobs(n=150, k=3)
    a.uns["ampflow"] = {"config": "tiny", "seed": 0}  # as the trainer records it
    src = tmp_path / "embeddings.h5ad"
    a.write_h5ad(src)
    assert _config_name(ad.read_h5ad(src)) == "tiny"  # the figure's title survives the h5ad round trip
    out = tmp_path / "eval"
    scores = main_evaluate(src, out, seed=0)

    written = json.loads((out / "scores.json").read_text())
    assert written == scores
    assert set(written) == SCORE_KEYS | SECTION_KEYS
    assert list(written) == sorted(written)
    # no split: one group of all cells, whose joint scores are the headline, the same
    # numbers cluster_scores gives on the whole file; no data folder, no baselines
    assert written["headline_group"] == "all" and list(written["groups"]) == ["all"]
    assert {k: written[k] for k in SCORE_KEYS} == cluster_scores(a, seed=0)
    assert written["baselines"] is None
    assert written["groups"]["all"]["methods"]["rna_baseline"] is None
    assert written["groups"]["all"]["shuffled_control"]["at_chance"]
    assert all(isinstance(written[k], float) for k in ("ari", "nmi", "foscttm", "leiden_resolution"))
    png = (out / "umap.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    # nothing but the two outputs (no temporaries left behind)
    assert sorted(p.name for p in out.iterdir()) == ["scores.json", "umap.png"]


def test_missing_obsm_key_names_file_and_key(tmp_path):
    a = blobs(n=20)
    del a.obsm["X_hic"]
    src = tmp_path / "embeddings.h5ad"
    a.write_h5ad(src)
    with pytest.raises(InputError, match="X_hic") as err:
        main_evaluate(src, tmp_path / "eval")
    assert err.value.key == "obsm/X_hic"
    assert err.value.path == str(src)
    assert not (tmp_path / "eval" / "scores.json").exists()


def test_nan_latent_is_an_input_error():
    a = blobs(n=20)
    a.obsm["X_joint"][3, 0] = np.nan
    with pytest.raises(InputError, match="1 cells have NaN"):
        check_embeddings(a)


def test_missing_embeddings_file(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        main_evaluate(tmp_path / "nope.h5ad", tmp_path / "eval")


def test_legend_order_is_natural_or_categorical():
    from ampflow.evaluate.umap import _category_order

    plain = pd.Series(["type_10", "type_2", "type_1"])
    assert _category_order(plain, set(plain)) == ["type_1", "type_2", "type_10"]
    cat = pd.Series(pd.Categorical(["b", "a"], categories=["b", "a", "unused"]))
    assert _category_order(cat, {"a", "b"}) == ["b", "a"]


def test_umap_kernels_compile_once_per_machine_not_per_process(tmp_path):
    """scanpy's kNN graph calls umap-learn kernels that umap-learn compiles without a disk
    cache; :func:`cache_umap_kernels` turns it on. Referee: numba's own cache counters in
    two fresh processes sharing an empty cache folder: the first compiles and saves, the
    second loads and compiles nothing."""
    import subprocess
    import sys

    code = (
        "import json, numpy as np\n"
        "from ampflow.evaluate.clusters import UMAP_KERNELS, _neighbors_adata\n"
        "import umap.umap_ as u\n"
        "_neighbors_adata(np.random.default_rng(0).normal(size=(30, 4)), 0)\n"
        "print(json.dumps({n: [len(u.__dict__[n.rsplit('.', 1)[1]].stats.cache_hits), "
        "len(u.__dict__[n.rsplit('.', 1)[1]].stats.cache_misses)] for n in UMAP_KERNELS}))\n"
    )
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    runs = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert set(first) == {"umap.umap_.smooth_knn_dist", "umap.umap_.compute_membership_strengths"}
    assert all(hits == 0 and misses >= 1 for hits, misses in first.values()), first
    assert all(hits >= 1 and misses == 0 for hits, misses in second.values()), second
    assert any(tmp_path.rglob("*.nbi")), "numba wrote no cache index"


def test_kmeans_scores_find_the_lowest_inertia_partition():
    """Referee: sklearn's k-means with 1000 starts (the best partition it finds, scored
    against the generating types). Data with a local optimum: one large type in two
    lobes beside three small ones. With 10 starts, half of the random states settle in
    it (another ARI); the scores' k-means must reach the referee's on every one."""
    from sklearn.cluster import KMeans
    from sklearn.metrics import adjusted_rand_score

    from ampflow.evaluate.clusters import kmeans_scores

    rng = np.random.default_rng(1)
    big = np.vstack([rng.normal([0, 0, 0], [1.5, 0.5, 0.5], (30, 3)), rng.normal([4, 0, 0], [1.5, 0.5, 0.5], (25, 3))])
    small = [rng.normal(c, 0.6, (n, 3)) for c, n in (([2, 5, 0], 8), ([2, -5, 0], 6), ([2, 0, 5], 6))]
    x = np.vstack([big, *small])
    labels = pd.Series(np.repeat(["big", "a", "b", "c"], [55, 8, 6, 6]))
    best = adjusted_rand_score(labels, KMeans(4, n_init=1000, random_state=0).fit_predict(x))
    few = [adjusted_rand_score(labels, KMeans(4, n_init=10, random_state=s).fit_predict(x)) for s in range(10)]
    assert sum(abs(a - best) > 1e-9 for a in few) >= 3  # the trap is real
    assert [round(kmeans_scores(x, labels, seed=s)["ari"], 12) for s in range(10)] == [round(best, 12)] * 10


def test_latents_take_cosine_neighbours_and_pcas_euclidean():
    """Referee: three cell types built as rays from the origin (the type is the
    direction, the norm spans 50-fold), so the right answer is known. The latents' kNN
    graph is cosine (GLUE's convention for its latents) and finds the types exactly; a
    baseline's PCA keeps scanpy's euclidean graph, which the same array misleads; the
    scores say which distance each used."""
    from ampflow.evaluate.scores import score_group

    rng = np.random.default_rng(0)
    n, k, d = 240, 3, 8
    directions = rng.normal(size=(k, d))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    label = rng.integers(0, k, n)
    norm = np.exp(rng.uniform(np.log(0.2), np.log(10.0), n))[:, None]
    rays = (directions[label] + rng.normal(scale=0.03, size=(n, d))) * norm
    a = ad.AnnData(obs=pd.DataFrame({"cell_type": [f"type_{i}" for i in label]}, index=[f"cell{i}" for i in range(n)]))
    for key in ("X_rna", "X_hic", "X_joint"):
        a.obsm[key] = rays.astype(np.float32)
    baselines = {"rna_baseline": rays, "hic_baseline": rays, "bandnorm_baseline": rays}
    methods = score_group(a, np.arange(n), baselines, alignment=False)["methods"]
    for name in ("joint", "rna_latent", "hic_latent"):
        assert methods[name]["knn_metric"] == "cosine" and methods[name]["ari"] == pytest.approx(1.0)
    for name in ("rna_baseline", "hic_baseline", "bandnorm_baseline"):
        assert methods[name]["knn_metric"] == "euclidean" and methods[name]["ari"] < 0.9
