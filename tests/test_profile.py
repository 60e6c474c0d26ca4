"""Profile: metadata-only reads of a data folder give the true sizes, never touch X.

Longer than 400 lines on purpose: the cases share one fixture-built folder whose true sizes
are counted independently from the matrices, and the many AnnData encodings it must read.
"""

from __future__ import annotations

import hashlib
import json
import sys

import anndata as ad
import h5py
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

from ampflow.amp import profile as prof
from ampflow.amp.profile import main_profile, profile_data
from ampflow.base.errors import InputError
from ampflow.contract import layout
from ampflow.contract.layout import feature_names
from ampflow.contract.profile import profile_hash
from ampflow.io.h5ad_meta import read_h5ad_meta
from ampflow.prepare.strata import candidate_index

N_CELLS = 12
N_STRATA = 4
N_GENES = 30
RES = 100_000
# two chromosomes of 9 and 6 bins: strata k >= 1 lose k bins per chromosome
CHROMS = {"chr1": 9, "chr2": 6}


def _bins() -> pd.DataFrame:
    rows = [(c, i * RES, (i + 1) * RES) for c, n in CHROMS.items() for i in range(n)]
    return pd.DataFrame(rows, columns=["chrom", "start", "end"])


def _hic_var() -> pd.DataFrame:
    _, var = candidate_index(_bins(), list(CHROMS), N_STRATA)
    var.index = pd.Index(feature_names(var), name="feature")
    return var


def _random_csr(rng, n_rows, n_cols, density=0.3) -> sp.csr_matrix:
    X = sp.random(n_rows, n_cols, density=density, format="csr", random_state=rng, dtype=np.float32)
    X.data = np.ceil(X.data * 5).astype(np.float32)
    return X


def write_hic(path, *, uns=True, stratum="int", anchor=True, dense=False, seed=0) -> dict:
    """A strata file like prepare/strata.py writes; returns the truth."""
    rng = np.random.default_rng(seed)
    var = _hic_var()
    fps = np.bincount(var["stratum"].to_numpy(), minlength=N_STRATA)
    X = _random_csr(rng, N_CELLS, len(var))
    if stratum == "categorical":
        var["stratum"] = var["stratum"].astype("category")
    elif stratum is None:
        var = var.drop(columns="stratum")
    if not anchor:
        var = var.drop(columns="anchor")
    a = ad.AnnData(X=X.toarray() if dense else X, obs=pd.DataFrame(index=[f"c{i}" for i in range(N_CELLS)]), var=var)
    if uns:
        a.uns["ampflow"] = {
            "modality": "hic",
            "prob_model": "HiCZINB",
            "resolution": RES,
            "n_strata": N_STRATA,
            "n_anchors": int(fps[0]),
            "features_per_stratum": fps.astype(np.int64),
            "chromosomes": list(CHROMS),
            "min_cells": 1,
            "min_count": 1,
        }
    a.write_h5ad(path)
    return {"n_cells": N_CELLS, "n_features": len(var), "nnz": int(X.nnz), "fps": fps.tolist(), "n_anchors": int(fps[0])}


def write_rna(path, *, uns=True, seed=1) -> dict:
    rng = np.random.default_rng(seed)
    X = _random_csr(rng, N_CELLS, N_GENES, density=0.5)
    obs = pd.DataFrame(index=[f"c{i}" for i in range(N_CELLS)])
    a = ad.AnnData(X=X, obs=obs, var=pd.DataFrame(index=[f"g{i}" for i in range(N_GENES)]))
    a.layers["counts"] = a.X.copy()
    if uns:
        hvg = {"flavor": "seurat", "n_top_genes": 30, "n_selected": 30}
        a.uns["ampflow"] = {"modality": "rna", "prob_model": "NB", "counts_layer": "counts", "hvg": hvg}
    a.write_h5ad(path)
    return {"n_cells": N_CELLS, "n_features": N_GENES, "nnz": int(X.nnz)}


def write_graph(folder, n_anchors: int) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    n = N_GENES + n_anchors
    kind = ["gene"] * N_GENES + ["anchor"] * n_anchors
    nodes = pd.DataFrame({"node_id": np.arange(n), "name": [f"n{i}" for i in range(n)], "kind": kind})
    src = np.concatenate([np.arange(n), np.arange(N_GENES), N_GENES + np.arange(N_GENES) % n_anchors])
    dst = np.concatenate([np.arange(n), N_GENES + np.arange(N_GENES) % n_anchors, np.arange(N_GENES)])
    edges = pd.DataFrame({"source": src, "target": dst, "weight": np.float32(1), "sign": np.int8(1)})
    nodes.to_parquet(folder / "nodes.parquet", index=False)
    edges.to_parquet(folder / "edges.parquet", index=False)
    (folder / "graph.json").write_text(json.dumps({"n_nodes": n, "n_edges": len(edges)}))
    return {"n_nodes": n, "n_edges": len(edges)}


@pytest.fixture
def data_dir(tmp_path):
    d = tmp_path / "data" / "cfg"
    d.mkdir(parents=True)
    truth = {"hic": write_hic(d / "hic.h5ad"), "rna": write_rna(d / "rna.h5ad")}
    truth["graph"] = write_graph(d / "graph", truth["hic"]["n_anchors"])
    return d, truth


MODEL = {"latent_dim": 16, "heads": 2, "window": 3, "attention": True}
TRAIN = {"batch_size": 8}


# ------------------------------------------------------------------ truth
def test_profile_numbers_equal_truth(data_dir):
    d, truth = data_dir
    p = profile_data(d, MODEL, TRAIN)
    hic, rna = p["modalities"]["hic"], p["modalities"]["rna"]
    assert hic["n_cells"] == rna["n_cells"] == N_CELLS
    assert hic["n_features"] == truth["hic"]["n_features"] == sum(hic["features_per_stratum"])
    assert hic["features_per_stratum"] == truth["hic"]["fps"] == [15, 13, 11, 9]
    assert hic["n_anchors"] == truth["hic"]["n_anchors"] == 15
    assert hic["n_strata"] == N_STRATA
    assert hic["nnz"] == truth["hic"]["nnz"]
    assert hic["resolution"] == RES
    assert hic["prob_model"] == "HiCZINB"
    assert (hic["attention"], hic["window"], hic["heads"]) == (True, 3, 2)
    assert hic["sources"] == {"n_anchors": "uns", "prob_model": "uns", "resolution": "uns", "strata": "uns"}
    assert rna["n_features"] == N_GENES and rna["nnz"] == truth["rna"]["nnz"] and rna["prob_model"] == "NB"
    assert p["graph"] == truth["graph"]
    assert p["model"]["latent_dim"] == 16 and p["model"]["decoder_dim"] is None
    assert p["train"] == {"batch_size": 8, "dtype": "float32", "optimizer": "adam", "cross_reconstruction": False, "hic_encoder_copy": True}
    assert set(p["inputs"]) == {"hic.h5ad", "rna.h5ad", "graph/nodes.parquet", "graph/edges.parquet", "graph/graph.json"}
    assert p["inputs"]["hic.h5ad"]["bytes"] == (d / "hic.h5ad").stat().st_size
    assert "signals" not in p and "memory" not in p
    assert p["batches"] == {"key": "batch", "n_batches": 0}  # no batch column
    json.dumps(p, allow_nan=False)  # JSON-serialisable as is


def test_profile_counts_the_batches_the_trainer_conditions_on(tmp_path):
    """The profile's batch count is the trainer's (:meth:`PairedData.use_batches` on
    the same file), and the memory model plans for those batches."""
    import scipy.sparse as sp
    import torch
    from synthetic_shapes import synthetic_graph

    from ampflow.amp.memory.predict import spec_from_profile
    from ampflow.train.data import PairedData

    d = tmp_path / "cfg"
    d.mkdir()
    truth = write_hic(d / "hic.h5ad")
    write_graph(d / "graph", truth["n_anchors"])
    a = ad.read_h5ad(d / "hic.h5ad")
    for values, key in ((["run1", "run2", "run3"], "batch"), (["x"], "batch"), (["a", "b"], "donor")):
        a.obs[key] = pd.Categorical([values[i % len(values)] for i in range(N_CELLS)])
        a.write_h5ad(d / "hic.h5ad")
        p = profile_data(d, {**MODEL, "batch_key": key}, TRAIN)
        trainer = PairedData(obs=a.obs, rna=sp.csr_matrix((N_CELLS, 0)), hic=sp.csr_matrix((N_CELLS, 1)), feature_anchor=torch.zeros(1),
                             feature_stratum=torch.zeros(1), n_strata=1, graph=synthetic_graph(0, 1, torch.Generator()), meta={})  # fmt: skip
        trainer.use_batches(key)
        assert p["batches"] == {"key": key, "n_batches": trainer.n_batches} and spec_from_profile(p).n_batches == trainer.n_batches
    assert profile_data(d, {**MODEL, "batch_key": None}, TRAIN)["batches"]["n_batches"] == 0


def test_fingerprint_is_head_hash_plus_size(tmp_path):
    f = tmp_path / "big.bin"
    payload = np.random.default_rng(0).bytes(prof.HEAD_BYTES + 1000)
    f.write_bytes(payload)
    want = hashlib.sha256(payload[: prof.HEAD_BYTES] + str(len(payload)).encode()).hexdigest()
    assert prof.file_fingerprint(f) == {"bytes": len(payload), "sha256_head": want}


def test_dense_x(tmp_path):
    truth = write_hic(tmp_path / "hic.h5ad", dense=True)
    m = read_h5ad_meta(tmp_path / "hic.h5ad")
    assert (m["n_obs"], m["n_vars"], m["nnz"], m["x_encoding"]) == (N_CELLS, truth["n_features"], None, "array")


def test_rna_uns_read_as_plain_dict(data_dir):
    d, _ = data_dir
    m = read_h5ad_meta(d / "rna.h5ad")
    assert m["uns"]["hvg"] == {"flavor": "seurat", "n_selected": 30, "n_top_genes": 30}
    assert m["modality"] == "rna" and m["sources"] == {"prob_model": "uns"}


# ------------------------------------------------------------------ inference
@pytest.mark.parametrize("stratum", ["int", "categorical"])
def test_infers_strata_from_var_without_uns(tmp_path, stratum):
    truth = write_hic(tmp_path / "hic.h5ad", uns=False, stratum=stratum)
    m = read_h5ad_meta(tmp_path / "hic.h5ad", modality="hic")
    assert m["features_per_stratum"] == truth["fps"]
    assert m["n_strata"] == N_STRATA and m["n_anchors"] == truth["n_anchors"]
    assert m["resolution"] == RES
    assert m["prob_model"] == "HiCZINB"
    assert m["sources"] == {"n_anchors": "var", "prob_model": "default", "resolution": "var", "strata": "var"}


def test_infers_strata_when_uns_lacks_them(tmp_path):
    truth = write_hic(tmp_path / "hic.h5ad")
    with h5py.File(tmp_path / "hic.h5ad", "r+") as f:
        del f["uns/ampflow/n_strata"], f["uns/ampflow/features_per_stratum"], f["uns/ampflow/n_anchors"]
    m = read_h5ad_meta(tmp_path / "hic.h5ad")
    assert m["features_per_stratum"] == truth["fps"] and m["n_anchors"] == truth["n_anchors"]
    assert m["sources"]["strata"] == "var" and m["sources"]["prob_model"] == "uns"


def test_infers_strata_from_names(tmp_path):
    truth = write_hic(tmp_path / "hic.h5ad", uns=False, stratum=None, anchor=False)
    m = read_h5ad_meta(tmp_path / "hic.h5ad", modality="hic")
    assert m["features_per_stratum"] == truth["fps"]
    assert m["n_anchors"] == truth["n_anchors"] and m["resolution"] == RES
    assert m["sources"] == {"n_anchors": "features_per_stratum", "prob_model": "default", "resolution": "names", "strata": "names"}


PARSERS = [layout.strata_from_names, layout.strata_from_names_loop]
if layout.NP_STRINGS:
    PARSERS.append(layout.strata_from_names_vectorised)


@pytest.mark.parametrize("parse", PARSERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("kind", ["str", "bytes"])
def test_names_parse_chromosomes_with_separators(parse, kind):
    names = ["HLA-A:0-100", "chrUn:gl-1:200-300-2", "x:5-10-11"]
    arr = np.array([n.encode() if kind == "bytes" else n for n in names], dtype=object)
    if parse is layout.strata_from_names_vectorised:
        arr = arr.astype("S" if kind == "bytes" else "U")
    strata, width = parse(arr, "f", "var/feature")
    assert strata.tolist() == [0, 2, 11] and width == 100  # the largest stratum-0 width


@pytest.mark.parametrize("parse", PARSERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("bad", ["chr1-0-100", "chr1:0", "chr1:0-100-2-3", "chr1:a-100", "chr1:0-100-", "chr1:-100"])
def test_names_parse_rejects(parse, bad):
    arr = np.array(["chr1:0-100", bad], dtype=object)
    if parse is layout.strata_from_names_vectorised:
        arr = arr.astype("U")
    with pytest.raises(InputError) as e:
        parse(arr, "f", "var/feature")
    assert e.value.value == bad and e.value.key == "var/feature"


def test_unparseable_names(tmp_path):
    write_hic(tmp_path / "hic.h5ad", uns=False, stratum=None)
    with h5py.File(tmp_path / "hic.h5ad", "r+") as f:
        names = f["var/feature"].asstr()[()]
        names[3] = "not-a-feature"
        del f["var/feature"]
        f["var"].create_dataset("feature", data=names.astype(object), dtype=h5py.string_dtype())
    with pytest.raises(InputError) as e:
        read_h5ad_meta(tmp_path / "hic.h5ad", modality="hic")
    assert e.value.key == "var/feature" and e.value.value == "not-a-feature"


def test_unknown_modality_without_prob_model(tmp_path):
    write_rna(tmp_path / "x.h5ad", uns=False)
    with pytest.raises(InputError) as e:
        read_h5ad_meta(tmp_path / "x.h5ad")
    assert e.value.key == "uns/ampflow/prob_model" and e.value.path == str(tmp_path / "x.h5ad")
    assert read_h5ad_meta(tmp_path / "x.h5ad", modality="rna")["sources"] == {"prob_model": "default"}


# ------------------------------------------------------------------ never reads X
@pytest.fixture
def forbid_matrix_reads(monkeypatch):
    """Make any element read from X or layers fail (metadata stays readable)."""
    touched = []

    def guard(method):
        def wrapped(self, *args, **kwargs):
            name = self.name or ""
            if name.startswith(("/X", "/layers")):
                touched.append(name)
                raise AssertionError(f"profile read {name}")
            return method(self, *args, **kwargs)

        return wrapped

    for m in ("__getitem__", "read_direct", "__array__", "iter_chunks"):
        monkeypatch.setattr(h5py.Dataset, m, guard(getattr(h5py.Dataset, m)))
    return touched


@pytest.mark.parametrize("variant", ["uns", "var", "names"])
def test_never_reads_x(tmp_path, forbid_matrix_reads, variant):
    d = tmp_path
    kw = {"uns": {}, "var": {"uns": False}, "names": {"uns": False, "stratum": None, "anchor": False}}[variant]
    truth = write_hic(d / "hic.h5ad", **kw)
    write_rna(d / "rna.h5ad")
    write_graph(d / "graph", truth["n_anchors"])
    # the guard works: a direct read of X/data fails
    with h5py.File(d / "hic.h5ad") as f, pytest.raises(AssertionError):
        f["X/data"][:5]
    forbid_matrix_reads.clear()
    p = profile_data(d, MODEL, TRAIN)
    assert forbid_matrix_reads == []
    assert p["modalities"]["hic"]["nnz"] == truth["nnz"]
    assert p["modalities"]["hic"]["features_per_stratum"] == truth["fps"]


def test_complete_uns_reads_no_var_column(data_dir, monkeypatch):
    """With the strata summary in uns, var is not read at all (its size is a shape)."""
    d, truth = data_dir
    read = []
    original = h5py.Dataset.__getitem__

    def spy(self, *args, **kwargs):
        read.append(self.name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(h5py.Dataset, "__getitem__", spy)
    p = profile_data(d, MODEL, TRAIN)
    assert p["modalities"]["hic"]["features_per_stratum"] == truth["hic"]["fps"]
    assert read and all(name.startswith("/uns/ampflow/") for name in read), read


# ------------------------------------------------------------------ errors
def test_missing_file(tmp_path):
    with pytest.raises(InputError) as e:
        read_h5ad_meta(tmp_path / "nope.h5ad")
    assert e.value.path == str(tmp_path / "nope.h5ad") and "does not exist" in str(e.value)


def test_corrupt_file(tmp_path):
    bad = tmp_path / "hic.h5ad"
    bad.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(InputError) as e:
        read_h5ad_meta(bad)
    assert e.value.path == str(bad) and "HDF5" in str(e.value)


def test_truncated_file(tmp_path, data_dir):
    d, _ = data_dir
    whole = (d / "hic.h5ad").read_bytes()
    cut = tmp_path / "hic.h5ad"
    cut.write_bytes(whole[: len(whole) // 3])
    with pytest.raises(InputError) as e:
        read_h5ad_meta(cut)
    assert e.value.path == str(cut)


def test_missing_x(tmp_path):
    write_hic(tmp_path / "hic.h5ad")
    with h5py.File(tmp_path / "hic.h5ad", "r+") as f:
        del f["X"]
    with pytest.raises(InputError) as e:
        read_h5ad_meta(tmp_path / "hic.h5ad")
    assert (e.value.path, e.value.key) == (str(tmp_path / "hic.h5ad"), "X")


@pytest.mark.parametrize(
    "edit, key",
    [
        (lambda f: f["X"].attrs.__setitem__("encoding-type", "awkward-array"), "X"),
        (lambda f: f["X"].attrs.__delitem__("shape"), "X/shape"),
        (lambda f: f["X"].__delitem__("indices"), "X/indices"),
        (lambda f: f["uns/ampflow/features_per_stratum"].__setitem__(0, 99), "uns/ampflow/features_per_stratum"),
        (lambda f: f["uns/ampflow/modality"].__setitem__((), "rna"), "uns/ampflow/modality"),
    ],
    ids=["unknown-encoding", "no-shape", "no-indices", "bad-strata-sum", "wrong-modality"],
)
def test_bad_layout_names_file_and_key(tmp_path, edit, key):
    path = tmp_path / "hic.h5ad"
    write_hic(path)
    with h5py.File(path, "r+") as f:
        edit(f)
    with pytest.raises(InputError) as e:
        read_h5ad_meta(path, modality="hic")
    assert (e.value.path, e.value.key) == (str(path), key)
    assert str(path) in str(e.value) and key in str(e.value)


def test_unknown_stratum_column_encoding(tmp_path):
    path = tmp_path / "hic.h5ad"
    write_hic(path, uns=False)
    with h5py.File(path, "r+") as f:
        values = f["var/stratum"][()]
        del f["var/stratum"]
        g = f["var"].create_group("stratum")
        g.attrs["encoding-type"] = "mystery"
        g["v"] = values
    with pytest.raises(InputError) as e:
        read_h5ad_meta(path, modality="hic")
    assert (e.value.path, e.value.key) == (str(path), "var/stratum")


def test_folder_errors(tmp_path, data_dir):
    d, _ = data_dir
    with pytest.raises(InputError, match="data folder does not exist"):
        profile_data(tmp_path / "none", {}, {})
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match="neither"):
        profile_data(empty, {}, {})
    (d / "graph/edges.parquet").unlink()
    with pytest.raises(InputError) as e:
        profile_data(d, {}, {})
    assert e.value.path == str(d / "graph/edges.parquet")
    (d / "graph/edges.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(InputError, match="parquet"):
        profile_data(d, {}, {})


def test_cell_count_mismatch(data_dir):
    d, _ = data_dir
    a = ad.read_h5ad(d / "rna.h5ad")
    a[:5].copy().write_h5ad(d / "rna.h5ad")
    with pytest.raises(InputError) as e:
        profile_data(d, {}, {})
    assert e.value.key == "n_cells"


def test_config_errors(data_dir):
    d, _ = data_dir
    with pytest.raises(InputError) as e:
        profile_data(d, {"heads": 0}, {})
    assert e.value.key == "model.heads"
    with pytest.raises(InputError) as e:
        profile_data(d, {}, {"batch_size": 1})
    assert e.value.key == "train.batch_size"


def test_profile_keeps_the_runs_dtype_and_cross_reconstruction(data_dir):
    """The memory model plans what the run trains: a float64 run, a stage with a cross
    weight (both were once planned as float32 without the cross pass), an encoder that
    reads its own thinned copy of the Hi-C batch (only where thinning is on)."""
    d, _ = data_dir
    assert profile_data(d, None, None)["train"] == {"batch_size": 32, "dtype": "float32", "optimizer": "adam", "cross_reconstruction": False,
                                                    "hic_encoder_copy": True}  # fmt: skip
    train = profile_data(d, None, {"dtype": "float64", "finetune": {"epochs": 1, "weights": {"cross": 0.5}}})["train"]
    assert train["dtype"] == "float64" and train["cross_reconstruction"] is True
    assert profile_data(d, None, {"hic_thinned": "both"})["train"]["hic_encoder_copy"] is False
    assert profile_data(d, None, {"hic_thinned": "encoder", "hic_keep_min": 1})["train"]["hic_encoder_copy"] is False
    with pytest.raises(InputError) as e:
        profile_data(d, None, {"dtype": "float16"})
    assert e.value.key == "train.dtype"


# ------------------------------------------------------------------ determinism, output
def test_deterministic_json_and_hash(data_dir, tmp_path):
    d, _ = data_dir
    a = main_profile(d, MODEL, TRAIN, tmp_path / "a.json")
    b = main_profile(d, MODEL, TRAIN, tmp_path / "b.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert json.loads((tmp_path / "a.json").read_text()) == a
    assert profile_hash(a) == profile_hash(b)
    canonical = json.dumps(a, sort_keys=True, separators=(",", ":"))
    assert profile_hash(a) == hashlib.sha256(canonical.encode()).hexdigest()
    # key order of the dict does not matter, content does
    assert profile_hash(dict(reversed(list(a.items())))) == profile_hash(a)
    assert profile_hash({**a, "train": {**a["train"], "batch_size": 9}}) != profile_hash(a)


def test_main_profile_adds_optional_parts_when_present(data_dir, tmp_path, monkeypatch):
    d, _ = data_dir
    fake = type(sys)("ampflow.amp.memory.predict")
    fake.profile_memory = lambda p: {"M_base": 1, "n_strata": p["modalities"]["hic"]["n_strata"]}
    monkeypatch.setitem(sys.modules, "ampflow.amp.memory.predict", fake)
    p = main_profile(d, MODEL, TRAIN, tmp_path / "p.json")
    assert p["memory"] == {"M_base": 1, "n_strata": N_STRATA}
    assert "HIGH_INPUT_DIMENSIONALITY" in p["signals"]
    assert json.loads((tmp_path / "p.json").read_text())["memory"]["M_base"] == 1


def test_main_profile_without_optional_parts(data_dir, tmp_path, monkeypatch):
    d, _ = data_dir
    # None in sys.modules makes the import fail as if the module did not exist
    monkeypatch.setitem(sys.modules, "ampflow.amp.memory.predict", None)
    monkeypatch.setitem(sys.modules, "ampflow.amp.decide.signals", None)
    p = main_profile(d, MODEL, TRAIN, tmp_path / "p.json")
    assert "memory" not in p and "signals" not in p
    assert p == profile_data(d, MODEL, TRAIN)


def test_main_profile_propagates_broken_optional_module(data_dir, tmp_path, monkeypatch):
    d, _ = data_dir

    class Broken:
        def __getattr__(self, name):
            raise ImportError("No module named 'somedep'", name="somedep")

    monkeypatch.setitem(sys.modules, "ampflow.amp.memory.predict", Broken())
    with pytest.raises(ImportError, match="somedep"):
        main_profile(d, MODEL, TRAIN, tmp_path / "p.json")
    assert not (tmp_path / "p.json").exists()
