"""Held-out cells: each cell's split is its own (adding or removing cells moves no other),
deterministic, binomial in share per label with a training cell kept in each, and
the prepare steps that fit on cells (HVG choice, strata feature filter, the graph's
pseudobulk) ignore held-out ones.

Training on training cells only is tested in ``test_trainer.py`` (it shares that module's
trained reference); the split rule in the DAG in ``test_workflow.py``.
"""

from __future__ import annotations

from pathlib import Path

import anndata as ad
import cooler
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

from ampflow.base.errors import InputError
from ampflow.cli import main
from ampflow.contract.config import EvaluateConfig
from ampflow.contract.layout import training_rows
from ampflow.demo import write_demo
from ampflow.io.split import read_split, split_of
from ampflow.prepare.split import binomial_tolerance, heldout_draw, split_cells

SIZES = {"a": 1, "b": 2, "c": 3, "d": 7, "e": 10, "f": 25, "g": 40}


def qc_table(sizes=SIZES, failing: int = 5, seed: int = 0) -> pd.DataFrame:
    """A QC table with labelled passing cells (``sizes`` per label) and failing ones, rows shuffled."""
    labels = [lab for lab, n in sizes.items() for _ in range(n)] + ["a"] * failing
    passed = [True] * sum(sizes.values()) + [False] * failing
    ids = [f"cell{i:04d}" for i in range(len(labels))]
    order = np.random.default_rng(seed).permutation(len(ids))
    t = pd.DataFrame({"pass": np.array(passed)[order], "cell_type": np.array(labels)[order]}, index=pd.Index(np.array(ids)[order], name="cell_id"))
    return t


# ------------------------------------------------------------------ the split itself
def labelled(sizes: dict, prefix: str = "cell") -> pd.DataFrame:
    """A QC table of passing cells, ``sizes`` per label, ids ``{prefix}{label}-{i}``."""
    ids = [f"{prefix}{lab}-{i}" for lab, n in sizes.items() for i in range(n)]
    labels = [lab for lab, n in sizes.items() for _ in range(n)]
    return pd.DataFrame({"pass": True, "cell_type": labels}, index=pd.Index(ids, name="cell_id"))


def binomial_band(n: int, fraction: float) -> float:
    """Three standard deviations of a binomial share of ``n`` draws."""
    return 3 * (fraction * (1 - fraction) / n) ** 0.5


#: many small labels (the guard acts on some) and a few large ones
MIXED = {f"s{i}": 1 + i % 5 for i in range(60)} | {"big1": 300, "big2": 120}


def test_the_draw_is_the_documented_hash():
    """The draw is BLAKE2b(``seed:cell_id``), 53 bits: it must stay that across versions,
    or every results folder's split moves. Referee: hashlib, on the documented recipe."""
    import hashlib

    for cell, seed in [("cell0001", 0), ("AAACGAA-1", 7), ("lee2019_035", 12345), ("é", 3)]:
        digest = hashlib.blake2b(f"{seed}:{cell}".encode(), digest_size=8).digest()
        assert heldout_draw(cell, seed) == (int.from_bytes(digest, "big") >> 11) / 2**53


@pytest.mark.parametrize("fraction", [0.2, 0.5])
def test_added_cells_move_no_earlier_cell(fraction):
    """New cells in old labels, and a new label: every earlier cell keeps its split,
    apart from the one cell the guard kept in a label all of whose cells drew held out."""
    before = labelled(MIXED)
    more = {lab: 1 + i % 3 for i, lab in enumerate(MIXED)} | {"new": 80}
    after = pd.concat([before, labelled(more, prefix="added")]).sample(frac=1, random_state=0)
    a = split_cells(before, fraction, seed=5, label_key="cell_type")
    b = split_cells(after, fraction, seed=5, label_key="cell_type")
    assert len(b) == len(a) + sum(more.values()) and b.index.isin(a.index).sum() == len(a)
    guarded = {lab for lab, ids in before.groupby("cell_type").groups.items() if all(heldout_draw(c, 5) < fraction for c in ids)}
    moved = a.index[b[a.index].to_numpy() != a.to_numpy()]
    assert guarded and len(moved), "the guard acts and moves cells, so the exception is exercised"
    assert set(before.loc[moved, "cell_type"]) <= guarded
    for cell in moved:  # at most the kept cell of each guarded label, and train -> heldout
        assert a[cell] == "train" and b[cell] == "heldout"
    assert before.loc[moved, "cell_type"].is_unique


@pytest.mark.parametrize("fraction", [0.2, 0.5])
def test_removed_cells_move_no_remaining_cell(fraction):
    """Removing cells: every remaining cell keeps its split, except in a label whose
    remaining cells had all been held out: the guard then moves exactly one of them (the
    highest draw) to training. Referee: the split of the full table."""
    full = labelled(MIXED)
    a = split_cells(full, fraction, seed=2, label_key="cell_type")
    kept = full.sample(frac=0.5, random_state=1)
    b = split_cells(kept, fraction, seed=2, label_key="cell_type")
    acted = 0
    for label, ids in kept.groupby("cell_type").groups.items():
        old, new = a[ids], b[ids]
        if (old == "heldout").all():
            acted += 1
            (gained,) = new.index[new == "train"]
            assert gained == max(ids, key=lambda c: heldout_draw(c, 2))
            assert (new.drop(gained) == "heldout").all()
        else:
            assert new.equals(old), label
    assert acted > 0, "the guard acts somewhere, so the exception is exercised"
    assert len(kept) > 150


def test_passing_cells_only_in_table_order():
    qc = qc_table()
    split = split_cells(qc, 0.25, seed=3, label_key="cell_type")
    assert list(split.index) == list(qc.index[qc["pass"]]), "every passing cell, in table order"
    assert set(split) == {"train", "heldout"}
    assert not split.index.isin(qc.index[~qc["pass"]]).any(), "failing cells are not split"


def test_deterministic_for_a_seed_and_independent_of_row_order():
    a = split_cells(qc_table(seed=0), 0.2, seed=7, label_key="cell_type")
    b = split_cells(qc_table(seed=0), 0.2, seed=7, label_key="cell_type")
    shuffled = split_cells(qc_table(seed=1), 0.2, seed=7, label_key="cell_type")
    other = split_cells(qc_table(seed=0), 0.2, seed=8, label_key="cell_type")
    assert a.equals(b)
    assert list(shuffled.index) != list(a.index) and shuffled.sort_index().equals(a.sort_index())
    assert not other.sort_index().equals(a.sort_index())


@pytest.mark.parametrize("fraction", [0.1, 0.2, 0.5, 0.9])
def test_heldout_share_per_label_is_binomial(fraction):
    """10,000 cells in four labels: each label's held-out share, and the whole table's,
    within three binomial standard deviations of ``fraction``."""
    sizes = {"w": 1000, "x": 2000, "y": 3000, "z": 4000}
    qc = labelled(sizes)
    split = split_cells(qc, fraction, seed=0, label_key="cell_type")
    for label, n in sizes.items():
        share = (split[qc["cell_type"] == label] == "heldout").mean()
        assert abs(share - fraction) <= binomial_band(n, fraction), (label, share)
        assert abs(share - fraction) <= binomial_tolerance(n, fraction)
    assert abs((split == "heldout").mean() - fraction) <= binomial_band(len(qc), fraction)


def test_every_label_keeps_a_training_cell():
    """At 0.9, many labels of one to five cells draw all held out: each keeps exactly one
    training cell, its highest draw; the other labels are left as drawn."""
    qc = labelled({f"l{i}": 1 + i % 5 for i in range(300)})
    split = split_cells(qc, 0.9, seed=4, label_key="cell_type")
    guarded = 0
    for label, ids in qc.groupby("cell_type").groups.items():
        draws = {c: heldout_draw(c, 4) for c in ids}
        train = set(split[ids].index[split[ids] == "train"])
        assert train, label
        if all(d < 0.9 for d in draws.values()):
            guarded += 1
            assert train == {max(draws, key=draws.get)}
        else:
            assert train == {c for c, d in draws.items() if d >= 0.9}
    # 60 labels of each size n; a label is all held out with probability 0.9**n
    expected = sum(60 * 0.9**n for n in range(1, 6))
    assert abs(guarded - expected) <= 3 * sum(60 * 0.9**n * (1 - 0.9**n) for n in range(1, 6)) ** 0.5


def test_labels_do_not_enter_the_draw():
    """A relabelled cell keeps its draw: the same cells under other labels (or none) split
    alike wherever the guard does not act (labels of 300 cells: never at 0.2)."""
    qc = labelled({"p": 300, "q": 300})
    relabelled = qc.assign(cell_type=np.where(np.arange(len(qc)) % 2, "p", "q"))
    a = split_cells(qc, 0.2, seed=1, label_key="cell_type")
    assert a.equals(split_cells(relabelled, 0.2, seed=1, label_key="cell_type"))
    assert a.equals(split_cells(qc, 0.2, seed=1))


def test_random_without_a_label_column():
    qc = qc_table().drop(columns="cell_type")
    split = split_cells(qc, 0.2, seed=0)
    n = int(qc["pass"].sum())
    assert list(split.index) == list(qc.index[qc["pass"]]), "every passing cell, in table order"
    assert abs((split == "heldout").mean() - 0.2) <= binomial_band(n, 0.2)
    assert split.equals(split_cells(qc, 0.2, seed=0))


def test_holdout_zero_holds_out_none():
    split = split_cells(qc_table(), 0.0, seed=0, label_key="cell_type")
    assert (split == "train").all() and len(split) == sum(SIZES.values())


@pytest.mark.parametrize(
    "kwargs, key, value",
    [
        ({"fraction": 1.0}, "evaluate.holdout", "1.0"),
        ({"fraction": -0.1}, "evaluate.holdout", "-0.1"),
        ({"fraction": 0.2, "seed": -1}, "evaluate.seed", "-1"),
        ({"fraction": 0.2, "label_key": "celltype"}, "evaluate.label_key", "'celltype'"),
    ],
)
def test_bad_values_name_key_and_value(kwargs, key, value):
    with pytest.raises(InputError) as e:
        split_cells(qc_table(), **kwargs)
    assert e.value.key == key and f"(value: {value})" in str(e.value)


def test_too_few_training_cells_left():
    with pytest.raises(InputError, match="1 training cell\\(s\\) left of 1; training needs at least two") as e:
        split_cells(qc_table({"x": 1}), 0.5, seed=0)
    assert e.value.key == "evaluate.holdout"
    # three cells that all draw held out at 0.9: the guard keeps one, too few to train on
    ids = [c for c in (f"c{i}" for i in range(200)) if heldout_draw(c, 0) < 0.9][:3]
    qc = pd.DataFrame({"pass": True}, index=pd.Index(ids, name="cell_id"))
    with pytest.raises(InputError, match="1 training cell\\(s\\) left of 3"):
        split_cells(qc, 0.9, seed=0)


def test_evaluate_config_validates():
    assert EvaluateConfig.from_dict({"holdout": 0}) == EvaluateConfig(holdout=0)
    with pytest.raises(InputError, match="evaluate"):
        EvaluateConfig.from_dict({"hold_out": 0.1})


# ------------------------------------------------------------------ the command and the file
def write_qc(tmp_path: Path, qc: pd.DataFrame) -> Path:
    path = tmp_path / "qc" / "cells.tsv"
    path.parent.mkdir(parents=True, exist_ok=True)
    qc.to_csv(path, sep="\t")
    return path


def test_split_cells_command(tmp_path):
    qc = qc_table()
    path = write_qc(tmp_path, qc)
    out = tmp_path / "qc" / "split.tsv"
    args = ["split-cells", "--qc", str(path), "--holdout", "0.2", "--label-key", "cell_type", "--seed", "0", "--out", str(out)]
    assert main(args) == 0
    lines = out.read_text().splitlines()
    assert lines[0] == "cell_id\tsplit"
    assert all(len(ln.split("\t")) == 2 for ln in lines)
    split = read_split(out)
    assert split.equals(split_cells(qc, 0.2, seed=0, label_key="cell_type"))
    assert not list(out.parent.glob(".tmp-*"))
    first = out.read_bytes()
    assert main(args) == 0 and out.read_bytes() == first


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--holdout", "1"], ["evaluate.holdout", "1.0"]),
        (["--holdout", "0.2", "--label-key", "batch"], ["evaluate.label_key", "'batch'"]),
    ],
)
def test_split_cells_command_bad_values(tmp_path, capsys, args, expected):
    path = write_qc(tmp_path, qc_table())
    out = tmp_path / "split.tsv"
    assert main(["split-cells", "--qc", str(path), *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and all(text in err for text in expected), err
    assert not out.exists()


def test_read_split_names_the_bad_line(tmp_path):
    p = tmp_path / "split.tsv"
    p.write_text("cell_id\tsplit\nc1\ttrain\nc2\ttest\n")
    with pytest.raises(InputError) as e:
        read_split(p)
    assert e.value.line == 3 and e.value.value == "test"
    p.write_text("cell_id\tsplit\nc1\ttrain\nc2\theldout\n")
    with pytest.raises(InputError, match="1 missing, 0 extra"):
        split_of(["c1", "c2", "c3"], read_split(p), path=p)
    assert list(split_of(["c2", "c1"], read_split(p))) == ["heldout", "train"]


# ------------------------------------------------------------------ prepare ignores held-out cells
@pytest.fixture(scope="module")
def work(tmp_path_factory) -> dict:
    """A 24-cell demo binned, loaded, QC'd and split (each cell held out with chance 1/4;
    seed 1 draws six, enough for the changes below to show; seed 0 would draw three)."""
    root = tmp_path_factory.mktemp("split")
    paths = write_demo(root / "demo", n_cells=24, seed=0, n_genes=300)
    w = root / "work"
    scool = w / "binned" / "1000000.scool"
    steps = [
        ["bin-cells", "--sheet", paths["sheet"], "--chromsizes", paths["chromsizes"], "--resolutions", "1000000",
         "--out-scool", scool, "--stats", w / "qc/contacts.tsv", "--cache-dir", w / "cache", "--threads", "1"],
        ["load-rna", paths["rna"], "--out", w / "rna/counts.h5ad", "--stats", w / "qc/rna.tsv"],
        ["qc-cells", "--sheet", paths["sheet"], "--contacts", w / "qc/contacts.tsv", "--rna-stats", w / "qc/rna.tsv",
         "--min-contacts", "100", "--min-umis", "10", "--min-genes", "5", "--out", w / "qc/cells.tsv"],
        ["split-cells", "--qc", w / "qc/cells.tsv", "--holdout", "0.25", "--label-key", "cell_type", "--seed", "1",
         "--out", w / "qc/split.tsv"],
    ]  # fmt: skip
    for step in steps:
        assert main([str(x) for x in step]) == 0, step[0]
    split = read_split(w / "qc/split.tsv")
    assert (split == "heldout").sum() >= 4
    return {**paths, "work": w, "scool": scool, "split": split}


def rna_data(work: dict, counts: Path, out: Path, split: bool = True) -> ad.AnnData:
    w = work["work"]
    args = ["rna-data", "--counts", counts, "--qc", w / "qc/cells.tsv", "--genes", work["genes"],
            "--chromsizes", work["chromsizes"], "--n-top-genes", "60", "--out", out]  # fmt: skip
    if split:
        args += ["--split", w / "qc/split.tsv"]
    assert main([str(x) for x in args]) == 0
    return ad.read_h5ad(out)


@pytest.mark.slow
def test_hvgs_are_chosen_from_training_cells_only(work, tmp_path):
    w, split = work["work"], work["split"]
    base = rna_data(work, w / "rna/counts.h5ad", tmp_path / "a.h5ad")
    assert list(base.obs_names) == list(split.index), "held-out cells stay in the file"
    assert list(base.obs["split"].astype(str)) == list(split)
    assert base.uns["ampflow"]["hvg"]["fitted_cells"] == int((split == "train").sum())

    # held-out cells get loud, variable counts on genes the training cells barely show
    counts = ad.read_h5ad(w / "rna/counts.h5ad")
    X = counts.X.toarray()
    held = np.flatnonzero(counts.obs_names.isin(split.index[split == "heldout"]))
    quiet = np.argsort(X[~np.isin(np.arange(len(X)), held)].sum(0))[:80]
    rng = np.random.default_rng(0)
    X[np.ix_(held, quiet)] = rng.integers(0, 400, size=(len(held), len(quiet)))
    counts.X = sp.csr_matrix(X)
    counts.write_h5ad(tmp_path / "changed.h5ad")

    changed = rna_data(work, tmp_path / "changed.h5ad", tmp_path / "b.h5ad")
    assert list(changed.var_names) == list(base.var_names)
    pd.testing.assert_frame_equal(changed.var, base.var)
    train = (split == "train").to_numpy()
    assert (changed.X[train] != base.X[train]).nnz == 0
    assert (changed.X[~train] != base.X[~train]).nnz > 0
    # the change is one the gene choice would see if it fitted on every cell
    a = rna_data(work, w / "rna/counts.h5ad", tmp_path / "c.h5ad", split=False)
    b = rna_data(work, tmp_path / "changed.h5ad", tmp_path / "d.h5ad", split=False)
    assert list(a.var_names) != list(b.var_names)
    assert "split" not in a.obs.columns


def test_all_genes_rna_chooses_nothing(work, tmp_path, capsys):
    """``rna-data --all-genes`` (cells to embed): every gene, the counts ``rna-data``
    writes for the same cells, no split and no annotation needed."""
    w = work["work"]
    chosen = rna_data(work, w / "rna/counts.h5ad", tmp_path / "chosen.h5ad")
    args = ["rna-data", "--counts", w / "rna/counts.h5ad", "--qc", w / "qc/cells.tsv", "--all-genes", "--out", tmp_path / "all.h5ad"]
    assert main([str(x) for x in args]) == 0
    every = ad.read_h5ad(tmp_path / "all.h5ad")
    counts = ad.read_h5ad(w / "rna/counts.h5ad")
    assert list(every.obs_names) == list(chosen.obs_names) and list(every.var_names) == list(counts.var_names)
    assert (every[:, chosen.var_names].layers["counts"] != chosen.layers["counts"]).nnz == 0
    assert every.uns["ampflow"]["hvg"] == {"flavor": "none", "n_selected": counts.n_vars}
    assert every.uns["ampflow"]["rounding"] == chosen.uns["ampflow"]["rounding"] and "split" not in every.obs.columns
    assert every.obs.loc[chosen.obs_names, "cell_type"].tolist() == chosen.obs["cell_type"].tolist()
    assert main([str(x) for x in args if x != "--all-genes"]) == 2
    assert "--genes: required unless --all-genes" in capsys.readouterr().err


def strata(work: dict, scool: Path, out: Path, split: bool = True) -> ad.AnnData:
    w = work["work"]
    args = ["strata", "--scool", scool, "--qc", w / "qc/cells.tsv", "--chromsizes", work["chromsizes"],
            "--strata", "4", "--min-cells", "3", "--min-count", "3", "--out", out]  # fmt: skip
    if split:
        args += ["--split", w / "qc/split.tsv"]
    assert main([str(x) for x in args]) == 0
    return ad.read_h5ad(out)


def rewrite_scool(src: Path, dst: Path, heldout: set[str]) -> None:
    """A copy of ``src`` whose held-out cells gain 5 contacts at every bin distance 1-3."""
    first = cooler.Cooler(f"{src}::/cells/{cooler.fileops.list_scool_cells(str(src))[0].split('/')[-1]}")
    bins = first.bins()[:]
    chrom = bins["chrom"].astype(str).to_numpy()
    pixels = {}
    for path in cooler.fileops.list_scool_cells(str(src)):
        cell = path.split("/")[-1]
        px = cooler.Cooler(f"{src}::{path}").pixels()[:][["bin1_id", "bin2_id", "count"]]
        if cell in heldout:
            extra = []
            for k in (1, 2, 3):
                b1 = np.arange(len(bins) - k)
                b1 = b1[chrom[b1] == chrom[b1 + k]]
                extra.append(pd.DataFrame({"bin1_id": b1, "bin2_id": b1 + k, "count": 5}))
            px = pd.concat([px, *extra]).groupby(["bin1_id", "bin2_id"], as_index=False)["count"].sum()
        pixels[cell] = px.sort_values(["bin1_id", "bin2_id"]).reset_index(drop=True)
    cooler.create_scool(str(dst), bins[["chrom", "start", "end"]], pixels, ordered=True, symmetric_upper=True, dtypes={"count": np.int64})


@pytest.mark.slow
def test_strata_feature_filter_counts_training_cells_only(work, tmp_path):
    split = work["split"]
    base = strata(work, work["scool"], tmp_path / "a.h5ad")
    assert list(base.obs_names) == list(split.index)
    assert list(base.obs["split"].astype(str)) == list(split)
    assert base.uns["ampflow"]["filter_cells"] == int((split == "train").sum())

    changed_scool = tmp_path / "changed.scool"
    rewrite_scool(work["scool"], changed_scool, set(split.index[split == "heldout"]))
    changed = strata(work, changed_scool, tmp_path / "b.h5ad")
    pd.testing.assert_frame_equal(changed.var, base.var)
    train = (split == "train").to_numpy()
    assert (changed.X[train] != base.X[train]).nnz == 0
    assert (changed.X[~train] != base.X[~train]).nnz > 0
    # with every cell counted, the held-out contacts would add features
    a = strata(work, work["scool"], tmp_path / "c.h5ad", split=False)
    b = strata(work, changed_scool, tmp_path / "d.h5ad", split=False)
    assert b.n_vars > a.n_vars
    assert "split" not in a.obs.columns


@pytest.mark.slow
def test_training_rows_of_a_data_file(work, tmp_path):
    base = strata(work, work["scool"], tmp_path / "a.h5ad")
    rows = training_rows(base.obs)
    assert list(base.obs_names[rows]) == list(work["split"].index[work["split"] == "train"])
    assert list(training_rows(base.obs.drop(columns="split"))) == list(range(base.n_obs))
    bad = base.obs.assign(split="test")
    with pytest.raises(InputError, match="split must be one of"):
        training_rows(bad)


def contacts_in_pairs(path: Path, chroms: set[str]) -> int:
    """Contacts of a pairs file with both ends on ``chroms``, counted from its lines."""
    import gzip

    n = 0
    with gzip.open(path, "rt") as f:
        for line in f:
            if not line.startswith("#"):
                fields = line.split("\t")
                n += fields[1] in chroms and fields[3] in chroms
    return n


def test_pseudobulk_pools_training_cells_only(work, tmp_path):
    """The graph's pseudobulk holds the training cells' contacts and none of the held-out
    ones'. Referees: the cells' pairs files counted line by line, and their own coolers."""
    w, split = work["work"], work["split"]
    out = tmp_path / "pb.mcool"
    args = ["pseudobulk", "--scool", f"1000000={work['scool']}", "--qc", w / "qc/cells.tsv",
            "--split", w / "qc/split.tsv", "--no-balance", "--out", out]  # fmt: skip
    assert main([str(x) for x in args]) == 0
    got = cooler.Cooler(f"{out}::resolutions/1000000").pixels()[:].set_index(["bin1_id", "bin2_id"])["count"]
    train = list(split.index[split == "train"])
    sheet = pd.read_csv(work["sheet"], sep="\t", index_col="cell_id")
    chroms = set(pd.read_csv(work["chromsizes"], sep="\t", header=None)[0].astype(str))
    assert int(got.sum()) == sum(contacts_in_pairs(Path(sheet.loc[c, "pairs"]), chroms) for c in train)
    expect = None
    for cell in train:
        px = cooler.Cooler(f"{work['scool']}::/cells/{cell}").pixels()[:].set_index(["bin1_id", "bin2_id"])["count"]
        expect = px if expect is None else expect.add(px, fill_value=0)
    assert got.sort_index().astype(int).equals(expect[expect > 0].sort_index().astype(int))
    # without the split every passing cell is pooled: more contacts
    every_cell = ["pseudobulk", "--scool", f"1000000={work['scool']}", "--qc", w / "qc/cells.tsv", "--no-balance", "--out", tmp_path / "all.mcool"]
    assert main([str(x) for x in every_cell]) == 0
    every = cooler.Cooler(f"{tmp_path / 'all.mcool'}::resolutions/1000000").pixels()[:]["count"].sum()
    assert every > got.sum()


def test_pseudobulk_split_of_other_cells(work, tmp_path, capsys):
    w = work["work"]
    bad = tmp_path / "split.tsv"
    bad.write_text("cell_id\tsplit\ncell9999\ttrain\n")
    args = ["pseudobulk", "--scool", f"1000000={work['scool']}", "--qc", w / "qc/cells.tsv", "--split", bad, "--out", tmp_path / "pb.mcool"]
    assert main([str(x) for x in args]) == 2
    assert f"{bad}: " in capsys.readouterr().err and not (tmp_path / "pb.mcool").exists()
