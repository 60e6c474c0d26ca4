"""The science benchmark's figure: what it draws is the rows' numbers, per dataset, with
the shuffled-label percentiles as the chance band."""

from __future__ import annotations

from conftest import REPO, load_script
from PIL import Image

ROWS = [
    {"dataset": "lee", "split": 0, "method": "bandnorm", "heldout_ari": 0.5, "all_ari": 0.6, "heldout_shuffled_p95": 0.05, "all_shuffled_p95": 0.02},
    {"dataset": "lee", "split": 1, "method": "bandnorm", "heldout_ari": 0.7, "all_ari": 0.4, "heldout_shuffled_p95": 0.07, "all_shuffled_p95": 0.03},
    {
        "dataset": "lee",
        "split": 0,
        "method": "bandnorm_shuffled_labels",
        "heldout_ari": 0.0,
        "all_ari": 0.0,
        "heldout_shuffled_p95": 0.05,
        "all_shuffled_p95": 0.02,
    },
    {
        "dataset": "lee",
        "split": 0,
        "train_seed": 0,
        "method": "model",
        "heldout_ari": 0.8,
        "all_ari": 0.5,
        "heldout_shuffled_p95": 0.06,
        "all_shuffled_p95": 0.02,
    },
    {"dataset": "lobo", "batch": "b1", "ari": 0.6, "shuffled_p95": 0.05, "bandnorm_on_batch": 0.5},
    # a later run's row, with a baseline the first run's row lacks
    {"dataset": "lobo", "batch": "b2", "ari": 0.7, "shuffled_p95": 0.05, "bandnorm_on_batch": 0.4, "bandnorm_trained": 0.8},
    {"dataset": "hires", "group": "heldout", "method": "rna_latent", "ari": 0.7, "shuffled_p95": 0.04, "leiden_ari": 0.7},
    {"dataset": "hires", "group": "train", "method": "rna_latent", "ari": 0.9, "shuffled_p95": 0.03, "leiden_ari": 0.9},
    {"dataset": "hires", "method": "negative_control", "passed": True},
]


def test_figure_draws_each_datasets_runs_and_chance(tmp_path):
    bench = load_script("bench_science")
    panels = {title: (dict(bars), chance) for title, bars, chance in bench.figure_bars(ROWS)}
    assert list(panels) == ["Lee 2019, held-out cells", "Lee 2019, all cells", "Lee 2019, each batch new to the model", "HiRES brain RNA, held-out cells"]
    bars, chance = panels["Lee 2019, held-out cells"]
    assert bars == {"bandnorm": [0.5, 0.7], "model": [0.8]} and max(chance) == 0.07
    assert panels["Lee 2019, all cells"][0]["bandnorm"] == [0.6, 0.4]
    assert panels["HiRES brain RNA, held-out cells"][0] == {"rna_latent": [0.7]}  # training cells are not drawn
    # a bar over the runs that have its baseline, not a NaN from the run that lacks it
    assert panels["Lee 2019, each batch new to the model"][0] == {
        "model (embed)": [0.6, 0.7],
        "bandnorm on the batch": [0.5, 0.4],
        "bandnorm, fitted on the training batches": [0.8],
    }
    bench.write_figure(ROWS, tmp_path / "f.png")
    assert Image.open(tmp_path / "f.png").size[0] > 4 * Image.open(tmp_path / "f.png").size[1] / 2


def test_baselines_of_a_new_batch_read_its_features_by_name():
    """The simple baselines fitted on the training batches and applied to a new one: the
    new cells' features are found by name, whatever their order, and a training feature
    they lack counts zero. Referee: the same baselines over one file whose new rows were
    written in the training order by hand."""
    import anndata as ad
    import numpy as np
    import pandas as pd
    import scipy.sparse as sp

    from ampflow.evaluate.baselines import bandnorm_baseline

    bench = load_script("bench_science")
    rng = np.random.default_rng(0)
    strata = np.repeat(np.arange(5), 30)
    names = [f"f{i}" for i in range(strata.size)]
    var = pd.DataFrame({"stratum": strata}, index=names)
    trained = ad.AnnData(X=sp.csr_matrix(rng.poisson(1.0, (40, strata.size)).astype(np.float32)), var=var)
    new_x = rng.poisson(1.0, (12, strata.size)).astype(np.float32)
    new_x[:, 37] = 0.0  # the feature the new file lacks
    order = rng.permutation([i for i in range(strata.size) if i != 37])
    new = ad.AnnData(X=sp.csr_matrix(new_x[:, order]), var=var.iloc[order])
    got, training = bench.baselines_on_new_batch(trained, new)
    both = ad.AnnData(X=sp.vstack([trained.X, sp.csr_matrix(new_x)]).tocsr(), var=var)
    fit = np.arange(52) < 40
    want, _ = bandnorm_baseline(both, fit, log1p=False, max_stratum=3)
    np.testing.assert_allclose(got["bandnorm_near_trained"], want[~fit], rtol=1e-5, atol=1e-6)
    full, _ = bandnorm_baseline(both, fit)
    np.testing.assert_allclose(got["bandnorm_trained"], full[~fit], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(training["bandnorm_near_trained"], want[fit], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(training["bandnorm_trained"], full[fit], rtol=1e-5, atol=1e-6)
    on_batch, _ = bandnorm_baseline(new, np.ones(12, dtype=bool), log1p=False, max_stratum=3)
    np.testing.assert_array_equal(got["bandnorm_near_on_batch"], on_batch)


def test_latent_spread_counts_validation_cells_as_never_trained_on():
    """The three groups of the new-batch benchmark's latent spread: early stopping's
    validation rows count with the held-out cells (never trained on), not with the cells
    trained on. Referee: the variances of rows picked by hand, one group per scale."""
    import numpy as np

    bench = load_script("bench_science")
    rng = np.random.default_rng(0)
    split = np.array(["train"] * 8 + ["heldout"] * 4)
    validation = np.array([1, 6])  # train rows set aside by early stopping
    z = rng.normal(0.0, 0.1, (12, 3))
    z[[0, 2, 3, 4, 5, 7]] *= 30.0  # only the rows trained on are wide
    z_new = rng.normal(0.0, 0.5, (5, 3))
    got = bench.latent_spread(z, split, validation, z_new)
    assert got["spread_trained"] == np.var(z[[0, 2, 3, 4, 5, 7]], axis=0).mean()
    assert got["spread_unseen"] == np.var(z[[1, 6, 8, 9, 10, 11]], axis=0).mean()
    assert got["spread_new"] == np.var(z_new, axis=0).mean()
    assert got["spread_trained"] > 100 * got["spread_unseen"]  # the validation rows' narrowness is not lost among the wide ones


def test_latent_spread_counts_effective_dims_per_group():
    """The new-batch benchmark's effective dimensions per group. Referee: the cube's
    corners in 3 of 12 dimensions (three equal eigenvalues), turned by a random rotation
    for the new batch."""
    import numpy as np

    bench = load_script("bench_science")
    corners = np.array([[a, b, c] for a in (-1, 1) for b in (-1, 1) for c in (-1, 1)], dtype=float)
    z = np.hstack([corners, np.zeros((8, 9))])
    rotation, _ = np.linalg.qr(np.random.default_rng(0).normal(size=(12, 12)))
    spread = bench.latent_spread(np.vstack([z, z]), np.array(["train"] * 8 + ["heldout"] * 8), np.array([], dtype=int), z @ rotation)
    assert abs(spread["dims_trained"] - 3.0) < 1e-9 and abs(spread["dims_new"] - 3.0) < 1e-9


def test_training_ablations_merge_into_the_templates_train_section():
    """Referee: the sections written out by hand. A section merges (the template's other
    keys kept), a value is set (``thin30``: ``hic_keep_min``, a float, not a section), a
    weight goes into both stages; TrainConfig accepts the result."""
    from ampflow.contract.config import TrainConfig

    bench = load_script("bench_science")
    template = {"seed": 1, "early_stopping": {"patience": 30, "validation": 0.1}, "pretrain": {"epochs": 600, "lr": 0.005}}
    got = bench.ablated_train(template, {"model", "patience10", "thin30", "hic_kl20"})
    assert got == {
        "seed": 1,
        "early_stopping": {"patience": 10, "validation": 0.1},
        "hic_keep_min": 0.3,
        "hic_thinned": "both",
        "pretrain": {"epochs": 600, "lr": 0.005, "weights": {"hic_kl": 20.0}},
        "finetune": {"weights": {"hic_kl": 20.0}},
    }
    assert template["early_stopping"]["patience"] == 30  # the template itself untouched
    cfg = TrainConfig.from_dict(got)
    assert cfg.hic_keep_min == 0.3 and not cfg.encoder_copy and cfg.pretrain.weights.hic_kl == 20.0 and cfg.early_stopping.patience == 10


def test_input_pca_reads_the_strata_the_encoder_reads():
    """The PCA of the encoder's own input with the settings of ablation ``near_pcs``
    (strata 1-3, no log, BandNorm's band weight) is BandNorm without its log over strata
    1-3: the same input, so the same principal coordinates up to each axis's sign.
    Referee: ``bandnorm_baseline``, written apart from the encoder's input. The same
    reach given as 3 Mb of 1 Mb bins is the same input; reading every stratum instead
    (the setting ignored) gives other coordinates."""
    import types

    import anndata as ad
    import numpy as np
    import pandas as pd
    import scipy.sparse as sp
    import torch

    from ampflow.evaluate.baselines import bandnorm_baseline

    bench = load_script("bench_science")
    rng = np.random.default_rng(1)
    strata = np.repeat(np.arange(6), 25)
    x = sp.csr_matrix(rng.poisson(rng.uniform(0.3, 3.0, (60, 1)) * np.exp(-0.4 * strata), (60, strata.size)).astype(np.float64))
    onehot = sp.csr_matrix((np.ones(strata.size), (np.arange(strata.size), strata)))
    data = types.SimpleNamespace(hic=x, feature_stratum=torch.as_tensor(strata), n_strata=6, meta={"hic": {"resolution": 1_000_000}},
                                 stratum_totals=lambda idx: torch.as_tensor((x[idx] @ onehot).toarray()))  # fmt: skip
    fit = np.arange(60) < 45
    near = bench.CONFIG_ABLATIONS["near_pcs"]
    got = bench.input_pca(data, fit, near)
    want, _ = bandnorm_baseline(ad.AnnData(X=x, var=pd.DataFrame({"stratum": strata}, index=[f"f{i}" for i in range(strata.size)])), fit,
                                log1p=False, max_stratum=3)  # fmt: skip
    assert got.shape == want.shape
    signs = np.sign((got * want).sum(0))
    np.testing.assert_allclose(got * signs, want, rtol=1e-6, atol=1e-8)
    # a config's reach in base pairs (model.hic_max_distance): 3 Mb is strata 1-3 of these 1 Mb bins
    reach = bench.input_pca(data, fit, {**near, "hic_max_stratum": None, "hic_max_distance": 3_000_000})
    np.testing.assert_allclose(np.abs(reach), np.abs(got), rtol=1e-9, atol=1e-12)
    every = bench.input_pca(data, fit, {**near, "hic_max_stratum": None, "hic_max_distance": None})
    assert not np.allclose(np.abs(every), np.abs(want), atol=1e-3)


def test_combined_variants_apply_each_of_their_ablations():
    """``near_thin`` is ``near_pcs`` and ``thin30`` at once, ``log1p_all_unthinned``
    ``log1p_all`` and ``unthinned``, ``old`` the decoder's five;
    a single name is itself, ``model`` none. Referee: the settings written out by hand
    (the encoder's input of BandNorm without its log over strata 1-3, projected on 20
    axes; thinning from 0.3); ModelConfig and TrainConfig accept them."""
    from ampflow.contract.config import ModelConfig, TrainConfig

    bench = load_script("bench_science")
    assert bench.ablation_names("model") == set() and bench.ablation_names("thin30") == {"thin30"}
    assert bench.ablation_names("old") == {"sampled_keys", "decay_head", "no_loadings", "full_key_scale", "latent32"}
    names = bench.ablation_names("near_thin")
    template = {"latent_dim": 12, "hic_transform": "log1p", "hic_pcs": 0}
    model = bench.ablated_model(template, names)
    assert model == {"latent_dim": 12, "hic_transform": "linear", "hic_diagonal": False, "hic_max_stratum": 3, "hic_pcs": 20}
    assert template["hic_pcs"] == 0  # the template itself untouched
    assert bench.ablated_train({"seed": 0}, names) == {"seed": 0, "hic_keep_min": 0.3, "hic_thinned": "both"}
    assert ModelConfig.from_dict(model).hic_pcs == 20 and TrainConfig.from_dict({"hic_keep_min": 0.3}).hic_keep_min == 0.3
    # the template's Hi-C settings before near_thin: every stratum through log1p, unprojected, unthinned
    before = bench.ablation_names("log1p_all_unthinned")
    template = {"hic_diagonal": False, "hic_transform": "linear", "hic_max_distance": 3_000_000, "hic_pcs": 20}
    model = ModelConfig.from_dict(bench.ablated_model(template, before))
    assert (model.hic_transform, model.hic_diagonal, model.hic_max_stratum, model.hic_max_distance, model.hic_pcs) == ("log1p", True, None, None, 0)
    assert TrainConfig.from_dict(bench.ablated_train({"hic_keep_min": 0.3}, before)).hic_keep_min == 1.0
    assert set(bench.COMBINED) <= set(bench.ABLATIONS)


def test_a_held_back_batch_trains_on_every_cell_of_the_others(tmp_path):
    """The new batch is what ``lobo`` scores, and its baselines fit on every cell of the
    training batches: the model must train on those same cells, not on four fifths of
    them. Referees: the workflow's own schema accepts the configuration, and the
    workflow's split (``split_cells``) with its ``evaluate`` settings holds out no cell of
    a sheet where the template's settings hold out about a fifth."""
    import pandas as pd
    import yaml
    from snakemake.utils import validate

    from ampflow.prepare.split import split_cells

    bench = load_script("bench_science")
    template = yaml.safe_load((REPO / "config/config.yaml").read_text())
    cfg = bench.lobo_config(template, tmp_path, tmp_path / "chrom.sizes", threads=2, seed=1)
    validate(cfg, str(REPO / "workflow/schemas/config.schema.yaml"), set_default=True)
    assert cfg["train"]["seed"] == 1 and cfg["embed"]["new"]["cells"] == str(tmp_path / "new_cells.tsv")
    qc = pd.DataFrame({"pass": True, "cell_type": ["a", "b"] * 100}, index=pd.Index([f"cell{i}" for i in range(200)], name="cell_id"))
    ev = cfg["evaluate"]
    assert (split_cells(qc, ev["holdout"], ev["seed"], "cell_type") == "train").all()
    template_held = (split_cells(qc, template["evaluate"]["holdout"], template["evaluate"]["seed"], "cell_type") == "heldout").sum()
    assert 20 <= template_held <= 60
    assert template["evaluate"]["holdout"] == 0.2  # the template itself untouched


def test_label_transfer_scores_types_by_their_nearest_training_cells():
    """Balanced accuracy of the types voted from the nearest training cells. Referees: a
    new cell placed inside its type's cluster gets it (1.0); three types in 3:1:1 whose
    new cells all sit in the big type's cluster get 1/3, chance for three types,
    whatever their sizes (plain accuracy would say 0.6); and with the training types
    permuted, the chance percentile stays far below a perfect transfer."""
    import numpy as np

    bench = load_script("bench_science")
    rng = np.random.default_rng(0)
    centres = np.array([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    y_train = np.repeat(["a", "b", "c"], 30)
    z_train = centres[np.repeat([0, 1, 2], 30)] + rng.normal(0, 1, (90, 2))
    y_new = np.repeat(["a", "b", "c"], [30, 10, 10])
    z_new = centres[np.repeat([0, 1, 2], [30, 10, 10])] + rng.normal(0, 1, (50, 2))
    acc, p95 = bench.transfer_accuracy(z_train, y_train, z_new, y_new)
    assert acc == 1.0 and p95 < 0.7
    lumped, _ = bench.transfer_accuracy(z_train, y_train, np.zeros((50, 2)) + rng.normal(0, 0.1, (50, 2)), y_new)
    assert abs(lumped - 1 / 3) < 1e-12


def test_held_out_cells_take_their_types_from_labelled_training_cells_only():
    """``score``'s label transfer votes each held-out cell's type from the training
    cells alone, and from the labelled ones: unlabelled training cells sitting on the
    held-out cells of type b would outvote its labelled ones if they counted (as type
    None). Referee: the type each held-out cell was drawn from."""
    import numpy as np

    bench = load_script("bench_science")
    rng = np.random.default_rng(2)
    types = np.array(["a"] * 30 + ["b"] * 30 + [None] * 20 + ["a"] * 10 + ["b"] * 10, dtype=object)
    centre = np.where(np.array([t == "b" for t in types])[:, None], 10.0, 0.0)
    centre[60:80] = 10.0  # the unlabelled cells, on type b
    z = centre + rng.normal(0, 1, (100, 3))
    held = np.arange(100) >= 80
    out = bench.score(z, types, None, held)
    assert out["heldout"]["transfer"] == 1.0


def test_tuned_transfer_keeps_the_axes_the_training_batches_vote_best_on():
    """The count of leading principal axes is the one on which the training batches,
    each voted from the other, agree best, and the new cells are voted on those axes.
    Referees: the principal axes from numpy's SVD of the centred training cells (not
    scikit-learn's PCA), every count tried by hand; and the new cells choose nothing
    (their labels permuted, the same axes are kept)."""
    import numpy as np

    bench = load_script("bench_science")
    rng = np.random.default_rng(3)
    centres = rng.normal(0, 4.0, (12, 11))  # subgroups of both types, wider than the noise

    def cells(n):
        y = rng.choice(["a", "b"], n)
        return np.hstack([np.where(y == "a", -5.0, 5.0)[:, None], centres[rng.integers(12, size=n)]]) + rng.normal(0, 0.5, (n, 12)), y

    z_train, y_train = cells(120)
    batch = np.repeat(["b1", "b2"], 60)
    z_new, y_new = cells(60)
    tuned, axes = bench.tuned_transfer(z_train, y_train, batch, z_new, y_new)
    mean = z_train.mean(0)
    _, _, vt = np.linalg.svd(z_train - mean, full_matrices=False)
    p_train, p_new = (z_train - mean) @ vt.T, (z_new - mean) @ vt.T

    # an axis's sign (SVD's or scikit-learn's) changes no distance
    within = {k: np.mean([bench.transfer_accuracy(p_train[batch != b, :k], y_train[batch != b], p_train[batch == b, :k], y_train[batch == b],
                                                  permutations=0)[0] for b in ("b1", "b2")]) for k in (2, 3, 5, 10, 12)}  # fmt: skip
    best = max(within.values())
    assert axes == min(k for k, v in within.items() if v == best)
    assert abs(tuned - bench.transfer_accuracy(p_train[:, :axes], y_train, p_new[:, :axes], y_new, permutations=0)[0]) < 1e-12
    assert len(set(within.values())) > 1  # the counts differ here: the choice is a real one
    _, again = bench.tuned_transfer(z_train, y_train, batch, z_new, rng.permutation(y_new))
    assert again == axes
