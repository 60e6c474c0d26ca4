"""``ampflow embed``: cells encoded with a trained model.pt, mapped onto its genes and features.

The referees: the trainer's own ``embeddings.h5ad`` (the training data folder embeds to
exactly its vectors), and the original files (a permuted copy embeds to the same
vectors; a copy that lacks some genes embeds like the original with those genes zeroed).
"""

from __future__ import annotations

from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import torch
from helpers import MODEL, SETTINGS, prepare

from ampflow.base.errors import InputError
from ampflow.cli import main
from ampflow.contract.config import TrainConfig
from ampflow.demo import write_demo
from ampflow.evaluate.embed import embed_cells, map_columns
from ampflow.train.data import counts_matrix, load_paired
from ampflow.train.trainer import Trainer

KEYS = ("X_rna", "X_hic", "X_joint")
TRAIN = TrainConfig.from_dict({**SETTINGS, "pretrain": {"epochs": 1}, "finetune": {"epochs": 1}})


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("embed-data")
    return prepare(write_demo(root / "demo", n_cells=24, seed=0, n_genes=300), root / "work")


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("embed-train") / "run"
    assert Trainer(load_paired(data_dir), MODEL, TRAIN, out).fit() is True
    return out


def embed(model: Path, out: Path, *args) -> ad.AnnData:
    assert main(["embed", "--model", str(model), "--out", str(out), *map(str, args)]) == 0
    return ad.read_h5ad(out)


def assert_same_vectors(a: ad.AnnData, b: ad.AnnData) -> None:
    assert list(a.obs_names) == list(b.obs_names)
    for key in KEYS:
        assert a.obsm[key].dtype == b.obsm[key].dtype == np.float32, key
        assert np.array_equal(a.obsm[key], b.obsm[key]), key


def rewrite(src: Path, dst: Path, columns, extra: list[str] = (), rows=None, zero=()) -> Path:
    """A copy of a data-folder file with the counts of ``columns`` (in that order), then
    ``extra`` unknown columns of random counts; cells in ``rows`` order; the original
    columns ``zero`` set to zero first."""
    a = ad.read_h5ad(src)
    x = counts_matrix(a).toarray()
    x[:, list(zero)] = 0
    rows = np.arange(a.n_obs) if rows is None else np.asarray(rows)
    rng = np.random.default_rng(0)
    m = np.hstack([x[:, columns], rng.poisson(2.0, (a.n_obs, len(extra))).astype(np.float32)])[rows]
    names = [str(a.var_names[c]) for c in columns] + list(extra)
    out = ad.AnnData(X=sp.csr_matrix(m), obs=a.obs.iloc[rows].copy(), var=pd.DataFrame(index=names))
    out.layers["counts"] = sp.csr_matrix(m)
    out.uns["ampflow"] = {"counts_layer": "counts"}
    dst.parent.mkdir(parents=True, exist_ok=True)
    out.write_h5ad(dst)
    return dst


def test_model_records_its_columns(data_dir, trained):
    m = torch.load(trained / "model.pt", map_location="cpu", weights_only=True)
    rna, hic = ad.read_h5ad(data_dir / "rna.h5ad"), ad.read_h5ad(data_dir / "hic.h5ad")
    assert m["genes"] == list(rna.var_names) and m["features"] == list(hic.var_names)
    assert m["n_strata"] == hic.uns["ampflow"]["n_strata"]
    assert m["feature_stratum"] == hic.var["stratum"].tolist()


def test_training_folder_gives_the_trainers_vectors(data_dir, trained, tmp_path):
    emb = embed(trained / "model.pt", tmp_path / "emb.h5ad", "--data", data_dir)
    assert_same_vectors(emb, ad.read_h5ad(trained / "embeddings.h5ad"))
    assert emb.uns["ampflow"]["genes"]["missing"] == emb.uns["ampflow"]["features"]["extra"] == 0
    assert not list(tmp_path.glob(".tmp-*"))


def test_permuted_columns_and_cells_give_the_same_vectors(data_dir, trained, tmp_path):
    reference = ad.read_h5ad(trained / "embeddings.h5ad")
    rng = np.random.default_rng(1)
    n_genes, n_features = (ad.read_h5ad(data_dir / f, backed="r").n_vars for f in ("rna.h5ad", "hic.h5ad"))
    rna = rewrite(data_dir / "rna.h5ad", tmp_path / "rna.h5ad", rng.permutation(n_genes))
    hic = rewrite(data_dir / "hic.h5ad", tmp_path / "hic.h5ad", rng.permutation(n_features), rows=rng.permutation(reference.n_obs))
    emb = embed(trained / "model.pt", tmp_path / "emb.h5ad", "--rna", rna, "--hic", hic)
    assert_same_vectors(emb, reference)


@pytest.mark.parametrize("rows", [slice(None, None, 3), [5], slice(1, 20)])
def test_a_subset_of_the_cells_gives_their_training_vectors(data_dir, trained, tmp_path, rows):
    """A cell's vector does not depend on the cells it is embedded with (every forward
    pass has the same row count): a subset embeds to its rows of training's file, bit for bit."""
    reference = ad.read_h5ad(trained / "embeddings.h5ad")
    rows = np.arange(reference.n_obs)[rows]
    files = {}
    for name in ("rna.h5ad", "hic.h5ad"):
        n_vars = ad.read_h5ad(data_dir / name, backed="r").n_vars
        files[name] = rewrite(data_dir / name, tmp_path / name, np.arange(n_vars), rows=rows)
    emb = embed(trained / "model.pt", tmp_path / "emb.h5ad", "--rna", files["rna.h5ad"], "--hic", files["hic.h5ad"])
    assert_same_vectors(emb, reference[rows])


def test_missing_and_extra_columns_are_counted_and_kept_ones_land_right(data_dir, trained, tmp_path):
    rng = np.random.default_rng(2)
    n_genes, n_features = (ad.read_h5ad(data_dir / f, backed="r").n_vars for f in ("rna.h5ad", "hic.h5ad"))
    gone_genes, gone_features = rng.choice(n_genes, 7, replace=False), rng.choice(n_features, 5, replace=False)
    kept_genes = rng.permutation(np.setdiff1d(np.arange(n_genes), gone_genes))
    kept_features = rng.permutation(np.setdiff1d(np.arange(n_features), gone_features))
    rna = rewrite(data_dir / "rna.h5ad", tmp_path / "new" / "rna.h5ad", kept_genes, extra=["NewGeneA", "NewGeneB", "NewGeneC"])
    hic = rewrite(data_dir / "hic.h5ad", tmp_path / "new" / "hic.h5ad", kept_features, extra=["chrZ:0-1000000", "chrZ:0-1000000-1"])
    report = embed_cells(trained / "model.pt", rna, hic, tmp_path / "new.h5ad", device="cpu")
    assert report["genes"] == {"trained": n_genes, "given": n_genes - 7 + 3, "kept": n_genes - 7, "missing": 7, "extra": 3}
    assert report["features"] == {"trained": n_features, "given": n_features - 5 + 2, "kept": n_features - 5, "missing": 5, "extra": 2}
    new = ad.read_h5ad(tmp_path / "new.h5ad")
    assert new.uns["ampflow"]["genes"]["missing"] == 7 and new.uns["ampflow"]["features"]["extra"] == 2
    # referee: the original files, in their own order, with the dropped columns zeroed
    zr = rewrite(data_dir / "rna.h5ad", tmp_path / "zero" / "rna.h5ad", np.arange(n_genes), zero=gone_genes)
    zh = rewrite(data_dir / "hic.h5ad", tmp_path / "zero" / "hic.h5ad", np.arange(n_features), zero=gone_features)
    embed_cells(trained / "model.pt", zr, zh, tmp_path / "zero.h5ad", device="cpu")
    assert_same_vectors(new, ad.read_h5ad(tmp_path / "zero.h5ad"))
    assert not np.array_equal(new.obsm["X_rna"], ad.read_h5ad(trained / "embeddings.h5ad").obsm["X_rna"])


def test_map_columns():
    m = map_columns(["a", "b", "c"], ["c", "x", "a"], "f.h5ad", "var_names")
    assert m.counts() == {"trained": 3, "given": 3, "kept": 2, "missing": 1, "extra": 1}
    np.testing.assert_array_equal(m.dense(sp.csr_matrix(np.array([[1.0, 2.0, 3.0]]))), [[3.0, 0.0, 1.0]])
    with pytest.raises(InputError, match="f.h5ad: var_names: none of the 2 names"):
        map_columns(["a"], ["x", "y"], "f.h5ad", "var_names")
    with pytest.raises(InputError, match="unique"):
        map_columns(["a"], ["a", "a"], "f.h5ad", "var_names")


# ------------------------------------------------------------------ bad input
def run_error(capsys, *args) -> str:
    assert main(["embed", *map(str, args)]) == 2
    return capsys.readouterr().err


def test_model_without_names(data_dir, trained, tmp_path, capsys):
    m = torch.load(trained / "model.pt", map_location="cpu", weights_only=True)
    del m["genes"]
    old = tmp_path / "old.pt"
    torch.save(m, old)
    err = run_error(capsys, "--model", old, "--data", data_dir, "--out", tmp_path / "e.h5ad")
    assert f"{old}: genes: the model file lacks this key" in err
    assert not (tmp_path / "e.h5ad").exists()


def test_a_model_from_before_the_weighed_hic_input_is_refused_not_misread(data_dir, trained, tmp_path, capsys):
    """Its encoder learnt another input transform: embedding with today's would give
    other vectors without a word, so it is refused, naming the key and what to do."""
    m = torch.load(trained / "model.pt", map_location="cpu", weights_only=True)
    del m["state_dict"]["hic_input.band_mean"]
    old = tmp_path / "old.pt"
    torch.save(m, old)
    err = run_error(capsys, "--model", old, "--data", data_dir, "--out", tmp_path / "e.h5ad")
    assert f"{old}: state_dict.hic_input.band_mean: the model predates" in err and "train it again" in err
    assert not (tmp_path / "e.h5ad").exists()


@pytest.mark.parametrize("transform", ["log1p", "linear"])
def test_the_hic_transform_comes_from_the_model_file(data_dir, tmp_path, transform):
    """Referee: the trainer's own vectors of a model trained with each
    ``model.hic_transform``. Its file embeds the training folder to them; with the key
    taken out of its settings (a model.pt from before the key existed, which read its
    input through log1p), a log1p model still does and a linear one no longer does."""
    from dataclasses import replace

    out = tmp_path / "run"
    assert Trainer(load_paired(data_dir), replace(MODEL, hic_transform=transform), TRAIN, out).fit() is True
    reference = ad.read_h5ad(out / "embeddings.h5ad")
    assert_same_vectors(embed(out / "model.pt", tmp_path / "emb.h5ad", "--data", data_dir), reference)
    m = torch.load(out / "model.pt", map_location="cpu", weights_only=True)
    del m["model_config"]["hic_transform"]
    torch.save(m, tmp_path / "old.pt")
    old = embed(tmp_path / "old.pt", tmp_path / "old.h5ad", "--data", data_dir)
    assert np.array_equal(old.obsm["X_hic"], reference.obsm["X_hic"]) == (transform == "log1p")


def test_a_model_file_from_before_the_hic_input_settings_embeds_as_it_trained(data_dir, tmp_path):
    """A model.pt written before ``hic_transform``, ``hic_diagonal``, ``hic_max_stratum``,
    ``hic_max_distance`` and ``hic_pcs`` existed read every stratum, the diagonal
    included, through log1p, unprojected: it embeds with those settings, not today's
    defaults. Referee: the trainer's own vectors of a model trained with them, its file
    stripped of the five keys."""
    from dataclasses import replace

    out = tmp_path / "run"
    before = replace(MODEL, hic_transform="log1p", hic_diagonal=True, hic_max_stratum=None, hic_max_distance=None, hic_pcs=0)
    assert Trainer(load_paired(data_dir), before, TRAIN, out).fit() is True
    reference = ad.read_h5ad(out / "embeddings.h5ad")
    m = torch.load(out / "model.pt", map_location="cpu", weights_only=True)
    for key in ("hic_transform", "hic_diagonal", "hic_max_stratum", "hic_max_distance", "hic_pcs"):
        del m["model_config"][key]
    torch.save(m, tmp_path / "old.pt")
    assert_same_vectors(embed(tmp_path / "old.pt", tmp_path / "old.h5ad", "--data", data_dir), reference)


def test_the_projection_and_the_farthest_stratum_come_from_the_model_file(data_dir, tmp_path, caplog):
    """Referee: the trainer's own vectors of a model whose Hi-C input reads strata 0-2
    projected on 3 principal axes. Its file embeds the training folder to them; the same
    file with the axes zeroed does not (the axes are read from the file, not refitted)."""
    from dataclasses import replace

    out = tmp_path / "run"
    with caplog.at_level("INFO", logger="ampflow.train.trainer"):
        assert Trainer(load_paired(data_dir), replace(MODEL, hic_max_stratum=2, hic_pcs=3), TRAIN, out).fit() is True
    # the fit reports no progress of its own: the log says what it fits and how long it took
    assert "Hi-C input: fitting 3 principal axes on" in caplog.text and "principal axes fitted in" in caplog.text
    reference = ad.read_h5ad(out / "embeddings.h5ad")
    assert_same_vectors(embed(out / "model.pt", tmp_path / "emb.h5ad", "--data", data_dir), reference)
    m = torch.load(out / "model.pt", map_location="cpu", weights_only=True)
    assert m["state_dict"]["hic_input.pca_axes"].shape[0] == 3 and m["state_dict"]["hic_input.pca_axes"].abs().sum() > 0
    m["state_dict"]["hic_input.pca_axes"].zero_()
    torch.save(m, tmp_path / "zeroed.pt")
    zeroed = embed(tmp_path / "zeroed.pt", tmp_path / "zeroed.h5ad", "--data", data_dir)
    assert not np.allclose(zeroed.obsm["X_hic"], reference.obsm["X_hic"])


def test_a_reach_in_base_pairs_trains_as_the_stratum_within_it(data_dir, tmp_path, caplog):
    """``model.hic_max_distance``: a reach of 2.5 bins of the data's resolution trains the
    model that ``hic_max_stratum: 2`` trains (referee: that run, its vectors to the bit),
    its file keeps the stratum, and it embeds to its own vectors; data whose resolution is
    unknown are refused by key."""
    from dataclasses import replace

    resolution = int(ad.read_h5ad(data_dir / "hic.h5ad").uns["ampflow"]["resolution"])
    assert Trainer(load_paired(data_dir), replace(MODEL, hic_max_stratum=2), TRAIN, tmp_path / "stratum").fit() is True
    with caplog.at_level("INFO", logger="ampflow.train.trainer"):
        reach = replace(MODEL, hic_max_distance=2 * resolution + resolution // 2)
        assert Trainer(load_paired(data_dir), reach, TRAIN, tmp_path / "bp").fit() is True
    assert f"Hi-C encoder reach: strata 0-2 (model.hic_max_distance over the data's {resolution} bp bins)" in caplog.text
    reference = ad.read_h5ad(tmp_path / "stratum" / "embeddings.h5ad")
    assert_same_vectors(ad.read_h5ad(tmp_path / "bp" / "embeddings.h5ad"), reference)
    kept = torch.load(tmp_path / "bp" / "model.pt", map_location="cpu", weights_only=True)["model_config"]
    assert kept["hic_max_stratum"] == 2 and kept["hic_max_distance"] is None
    assert_same_vectors(embed(tmp_path / "bp" / "model.pt", tmp_path / "emb.h5ad", "--data", data_dir), reference)
    data = load_paired(data_dir)
    del data.meta["hic"]["resolution"]
    with pytest.raises(InputError, match="model.hic_max_distance: .*resolution is not known"):
        Trainer(data, reach, TRAIN, tmp_path / "unknown")


def test_no_overlap(data_dir, trained, tmp_path, capsys):
    a = ad.read_h5ad(data_dir / "rna.h5ad")
    a.var_names = [f"other{i}" for i in range(a.n_vars)]
    a.write_h5ad(tmp_path / "rna.h5ad")
    err = run_error(capsys, "--model", trained / "model.pt", "--rna", tmp_path / "rna.h5ad", "--hic", data_dir / "hic.h5ad", "--out", tmp_path / "e.h5ad")
    assert f"{tmp_path / 'rna.h5ad'}: var_names: none of the" in err
    assert not (tmp_path / "e.h5ad").exists()


def test_cells_in_one_file_only(data_dir, trained, tmp_path, capsys):
    a = ad.read_h5ad(data_dir / "hic.h5ad")
    a[1:].copy().write_h5ad(tmp_path / "hic.h5ad")
    err = run_error(capsys, "--model", trained / "model.pt", "--data", data_dir, "--hic", tmp_path / "hic.h5ad", "--out", tmp_path / "e.h5ad")
    assert "1 cell(s) only in" in err and "obs_names" in err


@pytest.mark.parametrize(
    "args, says",
    [
        (["--model", "{tmp}/none.pt", "--data", "{data}"], "none.pt: model file does not exist"),
        (["--model", "{model}", "--rna", "{data}/rna.h5ad"], "give a data folder (--data) or both --rna and --hic"),
        (["--model", "{model}", "--data", "{tmp}"], "rna.h5ad: RNA file does not exist"),
        (["--model", "{data}/rna.h5ad", "--data", "{data}"], "cannot read the model file"),
        (["--model", "{model}", "--data", "{data}", "--batch-size", "0"], "--batch-size: must be at least 1"),
    ],
)
def test_bad_paths(data_dir, trained, tmp_path, capsys, args, says):
    fill = {"tmp": tmp_path, "data": data_dir, "model": trained / "model.pt"}
    err = run_error(capsys, *[x.format(**fill) for x in args], "--out", tmp_path / "e.h5ad")
    assert says in err
