"""The strata file: every entry equals an independent reading of the binned contacts.

The referees never share code with ``ampflow.prepare.strata``: for real ``.scool`` files
they read cooler's dense matrix of each chromosome and take its diagonals; for a
synthetic ``.scool`` they count the pixel lists the file was written from, in plain Python.
"""

from __future__ import annotations

from collections import defaultdict

import anndata as ad
import cooler
import h5py
import numpy as np
import pandas as pd
import pytest

from ampflow.base.errors import InputError
from ampflow.cli import main
from ampflow.evaluate.baselines import counts_matrix as baseline_counts
from ampflow.io.h5ad_meta import read_h5ad_meta
from ampflow.prepare.strata import build_strata, write_strata
from ampflow.train.data import counts_matrix as train_counts

RES = 100_000
SIZES = {"chr1": 1_050_000, "chr2": 730_000, "chrM": 16_000}  # 11, 8 and 1 bins
KEPT = ["chr1", "chr2"]  # chrM's bins are no anchors
N_STRATA = 4
N_CELLS = 10
HELDOUT = {1, 4, 7}  # rows held out of the feature filter
ONLY_HELDOUT = (2, 5)  # chr1 bins 2 and 5 (stratum 3): a contact of held-out cells only


def _bins() -> pd.DataFrame:
    rows = [(c, s, min(s + RES, n)) for c, n in SIZES.items() for s in range(0, n, RES)]
    return pd.DataFrame(rows, columns=["chrom", "start", "end"])


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """A .scool of 10 cells (cis near and far, trans, chrM, a contact across the chr1/chr2
    boundary) and the pixel lists it holds."""
    rng = np.random.default_rng(7)
    n_bins = len(_bins())
    pairs = [(a, b) for a in range(n_bins) for b in range(a, n_bins) if (a, b) != ONLY_HELDOUT]
    cells, pixels = [f"c{i:02d}" for i in range(N_CELLS)], {}
    for i, cell in enumerate(cells):
        pick = sorted(rng.choice(len(pairs), size=40 + 9 * i, replace=False).tolist())
        px = {pairs[p]: int(rng.integers(1, 6)) for p in pick}
        px[(10, 11)] = 2  # chr1's last bin and chr2's first: one apart, yet trans
        if i in HELDOUT:
            px[ONLY_HELDOUT] = 4
        pixels[cell] = dict(sorted(px.items()))
    path = tmp_path_factory.mktemp("strata") / "cells.scool"
    frames = {c: pd.DataFrame([(a, b, n) for (a, b), n in px.items()], columns=["bin1_id", "bin2_id", "count"]) for c, px in pixels.items()}
    cooler.create_scool(str(path), _bins(), frames, ordered=True, symmetric_upper=True, dtypes={"count": np.int64})
    return path, cells, pixels


def _split(cells):
    return ["heldout" if i in HELDOUT else "train" for i in range(len(cells))]


def _pixel_reference(pixels: dict, cells, split, min_cells, min_count):
    """Kept features in file order and their dense counts, from the pixel lists alone."""
    bins = _bins()
    chrom, start = bins["chrom"].tolist(), bins["start"].tolist()
    counts = defaultdict(lambda: [0] * len(cells))
    for i, cell in enumerate(cells):
        for (a, b), n in pixels[cell].items():
            if chrom[a] == chrom[b] and chrom[a] in KEPT and b - a < N_STRATA:
                counts[(chrom[a], start[a], b - a)][i] += n
    fit = [i for i in range(len(cells)) if split is None or split[i] == "train"]
    features = []
    for k in range(N_STRATA):  # stratum-major, then genome order
        for a in range(len(bins) - k):
            if chrom[a] not in KEPT or chrom[a + k] != chrom[a]:
                continue
            row = counts.get((chrom[a], start[a], k), [0] * len(cells))
            seen = sum(1 for i in fit if row[i] > 0)
            total = sum(row[i] for i in fit)
            if k == 0 or (seen >= min_cells and total >= min_count):
                features.append((chrom[a], start[a], k))
    dense = np.array([[counts.get(f, [0] * len(cells))[i] for f in features] for i in range(len(cells))], dtype=np.float64)
    return features, dense


def _features(adata) -> list[tuple]:
    v = adata.var
    return list(zip(v["chrom"].astype(str), v["start"].astype(int), v["stratum"].astype(int)))


def _raw_x(path) -> dict:
    with h5py.File(path, "r") as f:
        return {k: f["X"][k][:] for k in ("data", "indices", "indptr")} | {"shape": tuple(f["X"].attrs["shape"])}


@pytest.mark.parametrize("with_split", [True, False])
def test_streamed_file_equals_pixel_count(synthetic, tmp_path, with_split):
    path, cells, pixels = synthetic
    split = _split(cells) if with_split else None
    out = tmp_path / "hic.h5ad"
    write_strata(str(path), cells, KEPT, N_STRATA, out, min_cells=2, min_count=3, split=split)
    got = ad.read_h5ad(out)
    features, dense = _pixel_reference(pixels, cells, split, min_cells=2, min_count=3)
    assert _features(got) == features
    assert got.X.dtype == np.float32 and got.X.has_canonical_format
    np.testing.assert_array_equal(got.X.toarray(), dense)
    # the counts are stored once: in X, with no layer and no pointer to one
    assert len(got.layers) == 0 and "counts_layer" not in got.uns["ampflow"]
    assert list(got.obs_names) == cells
    meta = got.uns["ampflow"]
    assert meta["n_strata"] == N_STRATA and meta["resolution"] == RES and meta["n_anchors"] == 11 + 8
    assert meta["features_per_stratum"].tolist() == np.bincount([k for *_, k in features], minlength=N_STRATA).tolist()
    assert got.var_names[0] == "chr1:0-100000" and got.var_names[-1].endswith(f"-{N_STRATA - 1}")
    # the contact of held-out cells only is a feature only when the filter counts every cell
    assert (("chr1", ONLY_HELDOUT[0] * RES, 3) in features) == (not with_split)
    if with_split:
        assert meta["filter_cells"] == N_CELLS - len(HELDOUT)
        assert got.obs["split"].tolist() == split
        # held-out cells keep every kept feature they have, not only training ones
        assert dense[sorted(HELDOUT)].sum() > 0


def test_blocks_and_chunks_change_no_bit(synthetic, tmp_path):
    """3 cells per opening of the .scool and 7-element chunks (chunk ends inside rows)
    write the same X, var, obs and uns as one block and one chunk."""
    path, cells, _ = synthetic
    split = _split(cells)
    small, big = tmp_path / "small.h5ad", tmp_path / "big.h5ad"
    write_strata(str(path), cells, KEPT, N_STRATA, small, min_cells=2, min_count=3, split=split, block=3, chunk=7)
    write_strata(str(path), cells, KEPT, N_STRATA, big, min_cells=2, min_count=3, split=split, block=N_CELLS, chunk=1 << 20)
    a, b = _raw_x(small), _raw_x(big)
    assert a["shape"] == b["shape"] and len(a["data"]) > 7 * N_CELLS
    for k in ("data", "indices", "indptr"):
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k
    with h5py.File(small, "r") as f:
        assert f["X/data"].chunks == (7,)
    x, y = ad.read_h5ad(small), ad.read_h5ad(big)
    pd.testing.assert_frame_equal(x.var, y.var)
    pd.testing.assert_frame_equal(x.obs, y.obs)
    assert x.uns["ampflow"].keys() == y.uns["ampflow"].keys()
    for key, value in x.uns["ampflow"].items():
        assert np.array_equal(value, y.uns["ampflow"][key]), key
    # the in-memory build holds the same matrix
    mem = build_strata(str(path), cells, KEPT, N_STRATA, min_cells=2, min_count=3, split=split, block=4)
    assert np.array_equal(mem.X.toarray(), x.X.toarray()) and list(mem.var_names) == list(x.var_names)


def test_cli_file_is_what_every_reader_reads(synthetic, tmp_path):
    """``ampflow strata``: the readers of hic.h5ad (training, baselines, the profile's
    metadata reader) find the counts in X."""
    path, cells, pixels = synthetic
    qc = pd.DataFrame({"cell_id": cells, "pass": True, "depth": np.arange(N_CELLS)})
    qc.to_csv(tmp_path / "cells.tsv", sep="\t", index=False)
    pd.DataFrame({"cell_id": cells, "split": _split(cells)}).to_csv(tmp_path / "split.tsv", sep="\t", index=False)
    (tmp_path / "chrom.sizes").write_text("".join(f"{c}\t{n}\n" for c, n in SIZES.items()))
    out = tmp_path / "data" / "hic.h5ad"
    args = ["strata", "--scool", path, "--qc", tmp_path / "cells.tsv", "--chromsizes", tmp_path / "chrom.sizes", "--chromosomes", ",".join(KEPT),
            "--strata", N_STRATA, "--min-cells", 2, "--min-count", 3, "--split", tmp_path / "split.tsv", "--out", out]  # fmt: skip
    assert main([str(x) for x in args]) == 0
    assert sorted(p.name for p in out.parent.iterdir()) == ["hic.h5ad"]  # no temporary left
    features, dense = _pixel_reference(pixels, cells, _split(cells), min_cells=2, min_count=3)
    hic = ad.read_h5ad(out)
    assert hic.obs["depth"].tolist() == list(range(N_CELLS))
    for reader in (train_counts, baseline_counts):
        np.testing.assert_array_equal(reader(hic).toarray(), dense)
    meta = read_h5ad_meta(out, "hic")
    assert (meta["n_obs"], meta["n_vars"], meta["nnz"]) == (N_CELLS, len(features), int((dense != 0).sum()))


def test_bad_input(synthetic, tmp_path):
    path, cells, _ = synthetic
    with pytest.raises(InputError, match="not in the .scool"):
        write_strata(str(path), [*cells, "nobody"], KEPT, N_STRATA, tmp_path / "x.h5ad")
    with pytest.raises(InputError, match="must be >= 1"):
        write_strata(str(path), cells, KEPT, N_STRATA, tmp_path / "x.h5ad", block=0)
    with pytest.raises(InputError, match="no cells"):
        write_strata(str(path), [], KEPT, N_STRATA, tmp_path / "x.h5ad")


def _diagonal_reference(scool: str, cells, chroms, n_strata):
    """{(chrom, start, k): counts per cell} from the diagonals of cooler's dense matrices."""
    out = defaultdict(lambda: np.zeros(len(cells)))
    for i, cell in enumerate(cells):
        clr = cooler.Cooler(f"{scool}::/cells/{cell}")
        for chrom in chroms:
            m = clr.matrix(balance=False).fetch(chrom)
            starts = clr.bins().fetch(chrom)["start"].to_numpy()
            for k in range(min(n_strata, len(m))):
                d = np.diagonal(m, k)
                for j in np.flatnonzero(d):
                    out[(chrom, int(starts[j]), k)][i] = d[j]
    return out


@pytest.mark.parametrize(
    "name, n_strata, chroms",
    [
        ("cooler_5cells_100kb.scool", 30, None),  # 100 kb x 30 strata, every chromosome
        ("nagano2017_20cells_1mb.scool", 6, ["chr1", "chr2", "chr13", "chrX"]),  # no *_random contigs
    ],
)
def test_real_scool_every_entry(shared_data, tmp_path, name, n_strata, chroms):
    """Real .scool files written by other tools: every entry equals cooler's own matrix."""
    scool = str(shared_data / "schic" / name)
    cells = [c.rsplit("/", 1)[-1] for c in cooler.fileops.list_scool_cells(scool)]
    chroms = chroms or cooler.Cooler(f"{scool}::/cells/{cells[0]}").chromnames
    split = ["heldout" if i % 3 == 1 else "train" for i in range(len(cells))]
    out = tmp_path / "hic.h5ad"
    write_strata(scool, cells, chroms, n_strata, out, min_cells=2, min_count=2, split=split, block=2)
    got = ad.read_h5ad(out)
    ref = _diagonal_reference(scool, cells, chroms, n_strata)
    train = np.array(split) == "train"
    kept = {f for f, v in ref.items() if f[2] == 0 or ((v[train] > 0).sum() >= 2 and v[train].sum() >= 2)}
    features = _features(got)
    assert len(features) == len(set(features))
    stratum0 = {f for f in features if f[2] == 0}
    # every bin of the chosen chromosomes is an anchor; k >= 1 features are exactly the kept ones
    assert len(stratum0) == sum(len(cooler.Cooler(f"{scool}::/cells/{cells[0]}").bins().fetch(c)) for c in chroms)
    assert {f for f in features if f[2] > 0} == {f for f in kept if f[2] > 0}
    x = got.X.toarray()
    expected = np.stack([ref[f] if f in ref else np.zeros(len(cells)) for f in features], axis=1)
    np.testing.assert_array_equal(x, expected)
    assert x.sum() > 0 and got.uns["ampflow"]["filter_cells"] == int(train.sum())
