"""The 400-cell Lee 2019 folder written from BandNorm's binned tables: binning its pairs
files at 1 Mb with the package's own reader and binning gives back the source table, and
bad input names the file, the row and the value and leaves nothing under the final name."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from conftest import load_script

from ampflow.io.genome import ChromNamer
from ampflow.io.pairs import read_pairs
from ampflow.prepare.binning import bin_contacts

conv = load_script("lee2019_from_bandnorm")
SIZES = {conv.CHROM: conv.CHROM_SIZE}
LAST_BIN = (conv.CHROM_SIZE // conv.BIN) * conv.BIN  # 249 Mb: the short last bin


def source_tables(seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """BandNorm's three tables in their shapes (float bins as R's numeric), five cells."""
    rng = np.random.default_rng(seed)
    rows = []
    names = ["Astro_1", "Astro_2", "MG_1", "ODC_7", "Sst_3"]
    for cell in names:
        for _ in range(12):
            a = int(rng.integers(0, 250)) * conv.BIN
            b = min(a + int(rng.integers(0, 4)) * conv.BIN, LAST_BIN)
            rows.append(("chr1", float(a), float(b), int(rng.integers(1, 6)), float(b - a), cell))
        rows.append(("chr1", float(LAST_BIN), float(LAST_BIN), 3, 0.0, cell))
    hic = pd.DataFrame(rows, columns=["chrom", "binA", "binB", "count", "diag", "cell"])
    hic = hic.groupby(["chrom", "binA", "binB", "diag", "cell"], as_index=False)["count"].sum()
    batch = pd.DataFrame({"cell_name": names, "batch": ["b1", "b2", "b1", "b2", "b1"]})
    types = pd.DataFrame({"cell_name": names, "cluster": [n.split("_")[0] for n in names]})
    return hic, batch, types


def test_binning_the_written_pairs_gives_back_the_source_table(tmp_path):
    hic, batch, types = source_tables()
    out = tmp_path / "lee"
    sheet = conv.write_folder(conv.check_contacts(hic, "hic_df.rda"), conv.cell_labels(batch, types), out)
    written = pd.read_csv(out / "cells.tsv", sep="\t")
    assert list(written.columns) == ["cell_id", "pairs", "cell_type", "batch"]
    assert sorted(written["cell_id"]) == [f"lee2019_{k:03d}" for k in range(5)]
    names = pd.read_csv(out / "source_names.tsv", sep="\t").set_index("cell_id")["source_name"]
    assert sorted(names) == sorted(batch["cell_name"])
    for row in written.itertuples():
        src = names[row.cell_id]
        assert row.cell_type == src.split("_")[0]
        assert row.batch == batch.set_index("cell_name").loc[src, "batch"]
        contacts = read_pairs(out / row.pairs, ChromNamer(tuple(SIZES)), SIZES)
        got = bin_contacts(contacts, SIZES, conv.BIN)
        want = hic[hic["cell"] == src]
        got_set = {(int(r.bin1_id) * conv.BIN, int(r.bin2_id) * conv.BIN, int(r.count)) for r in got.itertuples()}
        want_set = {(int(r.binA), int(r.binB), int(r.count)) for r in want.itertuples()}
        assert got_set == want_set, row.cell_id
    assert (out / "chrom.sizes").read_text() == f"chr1\t{conv.CHROM_SIZE}\n"
    assert len(sheet) == 5


def test_the_ids_order_is_seeded_and_does_not_follow_the_source(tmp_path):
    hic, batch, types = source_tables()
    cells = conv.cell_labels(batch, types)
    first = conv.write_folder(conv.check_contacts(hic, "x"), cells, tmp_path / "a", seed=1)
    again = conv.write_folder(conv.check_contacts(hic, "x"), cells, tmp_path / "b", seed=1)
    other = conv.write_folder(conv.check_contacts(hic, "x"), cells, tmp_path / "c", seed=2)
    assert list(first["source_name"]) == list(again["source_name"])
    assert list(first["source_name"]) != list(other["source_name"])


@pytest.mark.parametrize(
    ("column", "value", "message"),
    [
        ("binA", 1_500_000.0, "row 4: binA 1500000.0 is not a multiple of 1000000"),
        ("binB", 250_000_000.0, "row 4: binB 250000000.0 is not a multiple of 1000000 below 249250621"),
        ("count", -1, "row 4: count -1.0 is not a non-negative integer"),
        ("chrom", "chr2", "row 4: chrom 'chr2', expected 'chr1' only"),
    ],
)
def test_bad_contacts_name_the_file_row_and_value_and_write_nothing(tmp_path, column, value, message):
    hic, batch, types = source_tables()
    hic[column] = hic[column].astype(object)
    hic.loc[4, column] = value
    with pytest.raises(ValueError, match=f"^hic_df.rda: {message}"):
        conv.write_folder(conv.check_contacts(hic, "hic_df.rda"), conv.cell_labels(batch, types), tmp_path / "lee")
    assert not (tmp_path / "lee").exists()


def test_a_cell_without_its_type_is_named(tmp_path):
    hic, batch, types = source_tables()
    with pytest.raises(ValueError, match="cell 'Sst_3' is only in batch.rda"):
        conv.cell_labels(batch, types[types["cell_name"] != "Sst_3"])
    with pytest.raises(ValueError, match="hic_df.rda: cell 'Sst_3' has no batch or type"):
        keep = batch["cell_name"] != "Sst_3"
        conv.write_folder(conv.check_contacts(hic, "x"), conv.cell_labels(batch[keep], types[keep]), tmp_path / "lee")
    assert not (tmp_path / "lee").exists()


def test_a_failure_midway_leaves_no_folder_under_the_final_name(tmp_path, monkeypatch):
    hic, batch, types = source_tables()
    calls = []

    def fail_on_third(x):
        calls.append(x)
        if len(calls) == 3:
            raise OSError("disk full")
        return conv.BIN // 2 + x

    monkeypatch.setattr(conv, "midpoint", fail_on_third)
    with pytest.raises(OSError, match="disk full"):
        conv.write_folder(conv.check_contacts(hic, "x"), conv.cell_labels(batch, types), tmp_path / "lee")
    assert list(tmp_path.iterdir()) == []
