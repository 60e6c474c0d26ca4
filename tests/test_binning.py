"""Binning is exact: every pixel equals an independent count of the pairs file."""

from __future__ import annotations

import cooler
import numpy as np
import pytest
from helpers import independent_count

from ampflow.cli import main
from ampflow.io.genome import ChromNamer, bin_offsets, read_chromsizes
from ampflow.io.pairs import read_pairs
from ampflow.prepare.binning import bin_contacts


@pytest.mark.slow
def test_real_hires_cell_every_pixel(shared_data, tmp_path):
    pairs = shared_data / "hires" / "GSM6998595_GasaE751001.pairs.gz"
    sizes_file = shared_data / "annotation" / "mm10.chrom.sizes"
    out = tmp_path / "cell.cool"
    rc = main(["bin-pairs", str(pairs), "--chromsizes", str(sizes_file), "--resolution", "500000", "--out", str(out)])
    assert rc == 0
    clr = cooler.Cooler(str(out))
    px = clr.pixels()[:]
    got = {(int(a), int(b)): int(c) for a, b, c in zip(px["bin1_id"], px["bin2_id"], px["count"])}
    expected = independent_count(pairs, read_chromsizes(sizes_file), 500000)
    assert sum(expected.values()) == 135083
    assert len(got) == len(expected)
    assert got == dict(expected)
    # cis/trans split matches the file's known composition
    bins = clr.bins()[:]
    chrom = bins["chrom"].astype(str).to_numpy()
    cis = sum(c for (a, b), c in got.items() if chrom[a] == chrom[b])
    assert cis == 122306
    assert sum(got.values()) - cis == 12777


def test_bins_are_upper_triangle_and_boundaries(tmp_path):
    sizes = {"chr1": 1000, "chr2": 500}
    p = tmp_path / "x.pairs"
    p.write_text(
        "#columns: readID chr1 pos1 chr2 pos2\n"
        ".\tchr1\t100\tchr1\t100\n"  # bin 0
        ".\tchr1\t101\tchr1\t100\n"  # 101 is the first base of bin 1
        ".\tchr2\t1\tchr1\t1000\n"  # trans, written lower-triangle
        ".\tchr1\t1000\tchr1\t1\n"
    )
    c = read_pairs(p, ChromNamer(tuple(sizes)), sizes)
    px = bin_contacts(c, sizes, 100)
    assert (px["bin1_id"] <= px["bin2_id"]).all()
    offs = bin_offsets(sizes, 100)
    assert list(offs) == [0, 10, 15]
    got = {(a, b): n for a, b, n in zip(px["bin1_id"], px["bin2_id"], px["count"])}
    # position 100 is the last base of bin 0 (1-based), 101 the first of bin 1
    assert got == {(0, 0): 1, (0, 1): 1, (0, 9): 1, (9, 10): 1}
    assert np.issubdtype(px["count"].dtype, np.integer)
