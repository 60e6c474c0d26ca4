"""The readers on real files from other projects (../shared/data, see its README).

Skipped when the folder is absent (set AMPFLOW_SHARED_DATA to point elsewhere).
Small variants of the real files are written by the tests themselves.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from ampflow.io.annotation import read_genes
from ampflow.io.genome import ChromNamer, read_chromsizes
from ampflow.io.pairs import read_pairs, sniff_layout
from ampflow.io.rna import read_rna, round_counts


@pytest.fixture(scope="module")
def data(shared_data) -> Path:
    return shared_data


def need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} not present")
    return path


@pytest.fixture(scope="module")
def mm10(data) -> dict[str, int]:
    return read_chromsizes(need(data / "annotation" / "mm10.chrom.sizes"))


# hg19 primary assembly (UCSC hg19.chrom.sizes)
HG19 = {
    "chr1": 249250621, "chr2": 243199373, "chr3": 198022430, "chr4": 191154276, "chr5": 180915260,
    "chr6": 171115067, "chr7": 159138663, "chr8": 146364022, "chr9": 141213431, "chr10": 135534747,
    "chr11": 135006516, "chr12": 133851895, "chr13": 115169878, "chr14": 107349540, "chr15": 102531392,
    "chr16": 90354753, "chr17": 81195210, "chr18": 78077248, "chr19": 59128983, "chr20": 63025520,
    "chr21": 48129895, "chr22": 51304566, "chrX": 155270560, "chrY": 59373566, "chrM": 16571,
}  # fmt: skip


def count_by_hand(path: Path, c1: int, p1: int, c2: int, p2: int, genome) -> dict[str, int]:
    """Independent count of total / cis / trans / unknown, line by line."""
    total = cis = trans = unknown = 0
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as fh:
        for line in fh:
            if line.startswith("#") or not line.strip():
                continue
            f = line.split()
            total += 1
            a, b = genome(f[c1]), genome(f[c2])
            if a is None or b is None:
                unknown += 1
                continue
            assert 0 <= int(f[p1]) and 0 <= int(f[p2])
            if a == b:
                cis += 1
            else:
                trans += 1
    return {"total": total, "cis": cis, "trans": trans, "dropped_unknown_chrom": unknown, "dropped_excluded": 0}


# ------------------------------------------------------------------ pairs
def test_hires_cell(data, mm10):
    path = need(data / "hires" / "GSM6998595_GasaE751001.pairs.gz")
    layout = sniff_layout(path)
    assert layout.usecols == [1, 2, 3, 4]
    assert set(layout.header_chromsizes) == {f"chr{i}" for i in range(1, 20)} | {"chrX"}
    assert all(mm10[c] == s for c, s in layout.header_chromsizes.items())
    c = read_pairs(path, ChromNamer(tuple(mm10)), mm10)
    expected = {"total": 135_083, "cis": 122_306, "trans": 12_777, "dropped_unknown_chrom": 0, "dropped_excluded": 0}
    assert c.stats == expected
    assert len(c) == 135_083
    assert c.pos1.min() >= 1 and c.pos2.min() >= 1
    # keep a subset: the rest are excluded, not unknown
    k = read_pairs(path, ChromNamer(tuple(mm10)), mm10, keep=["chr1", "chr2"])
    assert k.stats["dropped_unknown_chrom"] == 0
    assert k.stats["dropped_excluded"] == 135_083 - len(k)
    assert set(np.unique(np.concatenate([k.chrom1, k.chrom2]))) <= {0, 1}


def test_pairs_without_header(data, tmp_path):
    path = need(data / "pairs" / "hg19.sample1.noheader.pairs")
    sizes_file = tmp_path / "hg19.chrom.sizes"
    sizes_file.write_text("".join(f"{c}\t{s}\n" for c, s in HG19.items()))
    sizes = read_chromsizes(sizes_file)
    namer = ChromNamer(tuple(sizes))
    layout = sniff_layout(path, namer)
    # chrom1 pos1 strand1 chrom2 pos2 strand2: 1-based columns 1,2 and 4,5
    assert (layout.chrom1, layout.pos1, layout.chrom2, layout.pos2) == (0, 1, 3, 4)
    assert layout.n_header == 0 and layout.columns is None
    c = read_pairs(path, namer, sizes)
    expected = count_by_hand(path, 0, 1, 3, 4, lambda n: n if n in sizes else None)
    assert c.stats == expected
    assert c.stats["total"] == 60_643
    assert c.stats["dropped_unknown_chrom"] > 0  # chrUn_*, *_random, *_hap contigs


def test_chromsize_header_and_columns_longer_than_rows(data):
    path = need(data / "pairs" / "mm9.sample1.pairs")
    layout = sniff_layout(path)
    sizes = layout.header_chromsizes
    assert len(sizes) == 22 and sizes["chr1"] == 197_195_432 and sizes["chrM"] == 16_299
    # '#columns:' names 10 columns, the rows have 8 (no sam1/sam2)
    assert len(layout.columns) == 10
    with open(path) as fh:
        widths = {len(line.split("\t")) for line in fh if not line.startswith("#")}
    assert widths == {8}
    assert layout.usecols == [1, 2, 3, 4]  # found by name: chrom1 pos1 chrom2 pos2
    c = read_pairs(path, ChromNamer(tuple(sizes)), sizes)
    assert c.stats == count_by_hand(path, 1, 2, 3, 4, lambda n: n if n in sizes else None)
    assert c.stats["total"] == 10_000 and c.stats["dropped_unknown_chrom"] == 0


def test_extra_phase_prob_columns(data):
    plain = need(data / "hires" / "hires_utils_test.hg38.pairs.gz")
    imputed = need(data / "hires" / "hires_utils_test.hg38.impute.pairs.gz")
    layout = sniff_layout(imputed)
    assert layout.columns[-4:] == ["phase_prob00", "phase_prob01", "phase_prob10", "phase_prob11"]
    sizes = layout.header_chromsizes
    assert "chr1" in sizes
    namer = ChromNamer(tuple(sizes))
    a = read_pairs(plain, namer, sizes)
    b = read_pairs(imputed, namer, sizes)
    assert a.stats["total"] == b.stats["total"] == 1973
    # (the two files do not hold exactly the same contacts: compare with the text itself)
    genome = lambda n: n if n in sizes else None  # noqa: E731
    assert b.stats == count_by_hand(imputed, 1, 2, 3, 4, genome)
    with gzip.open(imputed, "rt") as fh:
        rows = [line.rstrip("\n").split("\t") for line in fh if not line.startswith("#")]
    assert {len(r) for r in rows} == {13}
    np.testing.assert_array_equal(b.pos1, [int(r[2]) for r in rows])
    np.testing.assert_array_equal(b.pos2, [int(r[4]) for r in rows])


def test_mm10_prefixed_names(data, mm10):
    files = sorted((need(data / "schic" / "gageseq_chr1")).glob("*.pairs.gz"))
    assert len(files) == 31
    namer = ChromNamer(tuple(mm10), strip_prefix="mm10_")
    total = 0
    for f in files:
        c = read_pairs(f, namer, mm10)
        assert c.stats["dropped_unknown_chrom"] == 0, f
        assert c.stats["trans"] == 0 and c.stats["cis"] == c.stats["total"] == len(c)
        assert set(np.unique(c.chrom1)) == {0}  # chr1
        total += c.stats["total"]
    with gzip.open(files[0], "rt") as fh:
        n0 = sum(1 for _ in fh)
    assert read_pairs(files[0], namer, mm10).stats["total"] == n0
    assert total > 0
    # without strip_prefix every contact is on an unknown chromosome: dropped, not fatal
    c = read_pairs(files[0], ChromNamer(tuple(mm10)), mm10)
    assert c.stats["dropped_unknown_chrom"] == n0 and len(c) == 0


def test_numeric_chromosome_names(data, mm10, tmp_path):
    src = need(data / "hires" / "GSM6998595_GasaE751001.pairs.gz")
    header, body = [], []
    with gzip.open(src, "rt") as fh:
        for line in fh:
            if line.startswith("#"):
                header.append(line)
            elif len(body) < 400:
                body.append(line)
            else:
                break
    # add a few trans lines from further in the file so both legs are exercised
    trans = []
    with gzip.open(src, "rt") as fh:
        for line in fh:
            f = line.split("\t")
            if not line.startswith("#") and f[1] != f[3]:
                trans.append(line)
                if len(trans) == 50:
                    break
    with_chr = tmp_path / "chr.pairs"
    with_chr.write_text("".join(header + body + trans))
    no_chr = tmp_path / "nochr.pairs.gz"
    with gzip.open(no_chr, "wt") as fh:
        for line in header:
            fh.write(line.replace("#chromosome: chr", "#chromosome: ") if line.startswith("#chromosome") else line)
        for line in body + trans:
            f = line.split("\t")
            f[1], f[3] = f[1].removeprefix("chr"), f[3].removeprefix("chr")
            fh.write("\t".join(f))
    with gzip.open(no_chr, "rt") as fh:
        assert "\t1\t" in fh.read()
    namer = ChromNamer(tuple(mm10))  # chr_prefix auto
    assert namer("1") == "chr1" and namer("X") == "chrX"
    a = read_pairs(with_chr, namer, mm10)
    b = read_pairs(no_chr, namer, mm10)
    assert b.stats == a.stats
    assert b.stats["dropped_unknown_chrom"] == 0 and b.stats["trans"] == 50
    for name in ("chrom1", "pos1", "chrom2", "pos2"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    # header-less too: '1' is a chromosome because the genome knows 'chr1'
    bare = tmp_path / "bare.pairs"
    with gzip.open(no_chr, "rt") as fh:
        bare.write_text("".join("\t".join(line.split("\t")[1:5]) + "\n" for line in fh if line[0] != "#"))
    layout = sniff_layout(bare, namer)
    assert layout.usecols == [0, 1, 2, 3]
    assert read_pairs(bare, namer, mm10).stats == a.stats


# ------------------------------------------------------------------ RNA
def test_brain_rna_matrix(data):
    path = need(data / "hires" / "GSE223917_HiRES_brain.rna.umicount.tsv.gz")
    adata = read_rna(path)
    assert adata.shape == (399, 39_884)  # cells x genes
    assert {c[:8] for c in adata.obs_names} == {"ValaB8w3", "ValaB8w4", "ValbB8w1"}
    assert adata.obs_names.is_unique and adata.var_names.is_unique
    data_ = adata.X.data
    assert (data_ >= 0).all()
    frac = int((data_ != np.floor(data_)).sum())
    assert frac > 0  # featureCounts --fraction

    X, report = round_counts(adata.X)
    assert report["mode"] == "half_up"
    assert report["fractional_entries"] == frac > 0
    assert report["nonzero_entries"] == adata.X.nnz
    assert report["total_before"] == pytest.approx(float(data_.astype(np.float64).sum()))
    assert report["total_after"] == pytest.approx(float(np.floor(data_.astype(np.float64) + 0.5).sum()))
    assert report["total_after"] != report["total_before"]
    assert float(X.sum()) == pytest.approx(report["total_after"])
    assert (X.data == np.floor(X.data)).all() and (X.data > 0).all()
    # spot check one entry against the text: gene 0610005C13Rik, first header cell with 1.75
    with gzip.open(path, "rt") as fh:
        cells = fh.readline().rstrip("\n").split("\t")[1:]
        row = fh.readline().rstrip("\n").split("\t")
    assert row[0] == adata.var_names[0]
    values = np.array(row[1:], dtype=np.float64)
    np.testing.assert_allclose(adata.X[:, 0].toarray().ravel(), values, rtol=1e-6)
    assert list(adata.obs_names) == cells


# ------------------------------------------------------------------ annotation
def test_gene_bed_and_gtf_agree(data, mm10, tmp_path):
    bed = need(data / "annotation" / "mm10_ensembl96_genes.bed.gz")
    namer = ChromNamer(tuple(mm10))
    genes = read_genes(bed, namer, mm10)
    assert len(genes) + genes.attrs["dropped"] == 56_355
    assert genes.attrs["dropped"] > 0  # patches and scaffolds
    assert set(genes["chrom"]) <= set(mm10)
    assert "NA" not in set(genes["name"])  # symbol NA -> the Ensembl id
    xkr4 = genes[genes["name"] == "Xkr4"].iloc[0]
    assert (xkr4["chrom"], xkr4["start"], xkr4["end"], xkr4["strand"]) == ("chr1", 3_205_900, 3_671_498, "-")

    # a GTF (1-based, inclusive) written from a few BED rows, with Ensembl-style names ('1')
    parts = [genes[genes["chrom"] == "chr1"].head(4), genes[genes["strand"] == "-"].head(2)]
    parts.append(genes[genes["chrom"] == "chrX"].head(2))
    pick = pd.concat(parts).drop_duplicates("gene_id")
    lines = []
    for g in pick.itertuples():
        attrs = f'gene_id "{g.gene_id}.7"; gene_name "{g.name}"; gene_biotype "x";'
        chrom = g.chrom.removeprefix("chr")
        lines.append(f"{chrom}\tensembl\tgene\t{g.start + 1}\t{g.end}\t.\t{g.strand}\t.\t{attrs}\n")
        lines.append(f"{chrom}\tensembl\texon\t{g.start + 1}\t{g.start + 10}\t.\t{g.strand}\t.\t{attrs}\n")
    gtf = tmp_path / "genes.gtf"
    gtf.write_text("#!genome-build GRCm38\n" + "".join(lines))
    from_gtf = read_genes(gtf, namer, mm10)
    cols = ["name", "gene_id", "chrom", "start", "end", "strand"]
    pd.testing.assert_frame_equal(from_gtf[cols].reset_index(drop=True), pick[cols].reset_index(drop=True))
