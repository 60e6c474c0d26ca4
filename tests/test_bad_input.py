"""Bad input gets one clear InputError naming the file, the line (or key) and the value;
the CLI exits 2 and leaves nothing under its final output names.

Longer than 400 lines on purpose: one short case per kind of bad input, read as a list;
splitting them by stage would scatter the contract they share (message, exit 2, no output).
"""

from __future__ import annotations

import gzip
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import assert_names

from ampflow.base.errors import InputError
from ampflow.cli import main
from ampflow.io.annotation import read_genes
from ampflow.io.genome import ChromNamer, read_chromsizes
from ampflow.io.pairs import read_pairs
from ampflow.io.rna import read_rna
from ampflow.io.sheet import read_sheet
from ampflow.prepare.qc import QCThresholds, qc_table

REPO = Path(__file__).resolve().parents[1]
SIZES = {"chr1": 1_000_000, "chr2": 500_000}
HEADER = "## pairs format v1.0\n#chromosome: chr1 1000000\n#chromosome: chr2 500000\n#columns: readID chr1 pos1 chr2 pos2 strand1 strand2\n"
N_HEADER = HEADER.count("\n")


def rows(n: int = 20, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        c2 = "chr1" if i % 3 else "chr2"
        out.append(f"r{i}\tchr1\t{rng.integers(1, 1_000_000)}\t{c2}\t{rng.integers(1, 500_000)}\t+\t-\n")
    return "".join(out)


@pytest.fixture
def sizes_file(tmp_path) -> Path:
    p = tmp_path / "chrom.sizes"
    p.write_text("".join(f"{c}\t{s}\n" for c, s in SIZES.items()))
    return p


def bin_pairs(pairs, sizes_file, out, capsys) -> tuple[int, str]:
    """Run ``ampflow bin-pairs``; return (exit status, stderr)."""
    capsys.readouterr()
    rc = main(["bin-pairs", str(pairs), "--chromsizes", str(sizes_file), "--resolution", "100000", "--out", str(out)])
    return rc, capsys.readouterr().err


def expect_cli_error(tmp_path, pairs, sizes_file, capsys, line=None, value=None) -> str:
    out = tmp_path / "out" / "cell.cool"
    rc, err = bin_pairs(pairs, sizes_file, out, capsys)
    assert rc == 2, err
    assert not out.exists()
    assert not out.parent.exists() or not any(out.parent.iterdir())  # no temporary left either
    assert_names(err, pairs, line=line, value=value)
    return err


# ------------------------------------------------------------------ pairs files
def test_missing_pairs_file_in_sheet(tmp_path, sizes_file, capsys):
    good = tmp_path / "a.pairs"
    good.write_text(HEADER + rows())
    sheet = tmp_path / "cells.tsv"
    missing = tmp_path / "b.pairs"
    sheet.write_text(f"cell_id\tpairs\nA\t{good}\nB\t{missing}\n")
    with pytest.raises(InputError) as e:
        read_sheet(sheet)
    assert (e.value.line, e.value.key, e.value.value) == (3, "pairs", str(missing))
    assert_names(str(e.value), sheet, line=3, key="pairs", value=str(missing))

    out = tmp_path / "out" / "100kb.scool"
    stats = tmp_path / "out" / "contacts.tsv"
    capsys.readouterr()
    rc = main(
        ["bin-cells", "--sheet", str(sheet), "--chromsizes", str(sizes_file), "--resolutions", "100000",
         "--out-scool", str(out), "--stats", str(stats), "--cache-dir", str(tmp_path / "cache")]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2
    assert not out.exists() and not stats.exists()
    assert_names(err, sheet, line=3, key="pairs", value=str(missing))


def test_empty_pairs_file(tmp_path, sizes_file, capsys):
    p = tmp_path / "empty.pairs"
    p.write_text("")
    err = expect_cli_error(tmp_path, p, sizes_file, capsys)
    assert "empty" in err


def test_header_only_pairs_file(tmp_path, sizes_file, capsys):
    p = tmp_path / "header.pairs.gz"
    with gzip.open(p, "wt") as fh:
        fh.write(HEADER)
    err = expect_cli_error(tmp_path, p, sizes_file, capsys)
    assert "only header lines" in err


def test_truncated_gzip(tmp_path, sizes_file, capsys):
    full = tmp_path / "full.pairs.gz"
    with gzip.open(full, "wt") as fh:
        fh.write(HEADER + rows(20_000))
    data = full.read_bytes()
    p = tmp_path / "cut.pairs.gz"
    p.write_bytes(data[: len(data) // 2])
    err = expect_cli_error(tmp_path, p, sizes_file, capsys)
    assert "truncated" in err
    # the intact file is fine
    assert read_pairs(full, ChromNamer(tuple(SIZES)), SIZES).stats["total"] == 20_000


def test_too_few_columns(tmp_path, sizes_file, capsys):
    p = tmp_path / "short.pairs"
    p.write_text(HEADER + rows(10) + "r\tchr1\t500\tchr2\n" + rows(10, seed=1))
    err = expect_cli_error(tmp_path, p, sizes_file, capsys, line=N_HEADER + 11, value="r\tchr1\t500\tchr2")
    assert "too few columns" in err


def test_non_integer_position(tmp_path, sizes_file, capsys):
    p = tmp_path / "nonint.pairs"
    p.write_text(HEADER + rows(10) + "r\tchr1\t500\tchr2\t12.5\t+\t+\n" + rows(10, seed=1))
    err = expect_cli_error(tmp_path, p, sizes_file, capsys, line=N_HEADER + 11, value="12.5")
    assert "pos2 is not an integer" in err


def test_negative_position(tmp_path, sizes_file, capsys):
    p = tmp_path / "neg.pairs"
    p.write_text(HEADER + rows(10) + "r\tchr1\t-7\tchr2\t100\t+\t+\n")
    err = expect_cli_error(tmp_path, p, sizes_file, capsys, line=N_HEADER + 11, value="-7")
    assert "pos1 is negative" in err


def test_position_past_chromosome_end(tmp_path, sizes_file, capsys):
    p = tmp_path / "past.pairs"
    p.write_text(HEADER + rows(10) + "r\tchr1\t500\tchr2\t500001\t+\t+\n")
    err = expect_cli_error(tmp_path, p, sizes_file, capsys, line=N_HEADER + 11, value="500001")
    assert "past the end of chr2" in err


def test_position_too_large_for_int64(tmp_path, sizes_file, capsys):
    p = tmp_path / "huge.pairs"
    p.write_text(HEADER + rows(10) + "r\tchrUn\t99999999999999999999999\tchr1\t5\t+\t+\n")
    expect_cli_error(tmp_path, p, sizes_file, capsys, line=N_HEADER + 11, value="99999999999999999999999")


def test_unknown_chromosome_dropped_and_counted(tmp_path, sizes_file, capsys):
    p = tmp_path / "unknown.pairs"
    p.write_text(HEADER + rows(10) + "r\tchrUn_gl000220\t600000000\tchr1\t5\t+\t+\n" + rows(10, seed=1))
    c = read_pairs(p, ChromNamer(tuple(SIZES)), SIZES)
    assert c.stats["total"] == 21
    assert c.stats["dropped_unknown_chrom"] == 1
    assert len(c) == 20
    out = tmp_path / "out" / "cell.cool"
    rc, err = bin_pairs(p, sizes_file, out, capsys)
    assert rc == 0, err
    assert out.exists()


def test_hash_in_read_id_is_data_not_a_comment(tmp_path):
    # old Illumina read ids end in '#0/1'; '#' lines between data lines are skipped
    p = tmp_path / "hash.pairs"
    p.write_text(HEADER + "HWI-1:1:1101#0/1\tchr1\t10\tchr2\t20\t+\t+\n#comment\n" + rows(5))
    c = read_pairs(p, ChromNamer(tuple(SIZES)), SIZES)
    assert c.stats["total"] == 6
    assert (c.pos1[0], c.pos2[0]) == (10, 20)


def test_keep_names_unknown_chromosome(tmp_path):
    p = tmp_path / "a.pairs"
    p.write_text(HEADER + rows(5))
    with pytest.raises(InputError) as e:
        read_pairs(p, ChromNamer(tuple(SIZES)), SIZES, keep=["chr1", "chr9"])
    assert e.value.key == "chromosomes" and e.value.value == ["chr9"]


# ------------------------------------------------------------------ cell sheet
def test_duplicate_cell_ids_in_sheet(tmp_path):
    sheet = tmp_path / "cells.tsv"
    sheet.write_text("cell_id\tpairs\tcell_type\nA\ta.pairs\tx\nB\tb.pairs\ty\n\nA\tc.pairs\tz\n")
    with pytest.raises(InputError) as e:
        read_sheet(sheet, check_files=False)
    assert (e.value.line, e.value.key, e.value.value) == (5, "cell_id", "A")  # blank line 4 counted
    assert_names(str(e.value), sheet, line=5, key="cell_id", value="A")
    assert "first seen on line 2" in str(e.value)


def test_sheet_row_with_extra_fields(tmp_path):
    sheet = tmp_path / "cells.tsv"
    sheet.write_text("cell_id\tpairs\nA\ta.pairs\nB\tb.pairs\textra\n")
    with pytest.raises(InputError) as e:
        read_sheet(sheet, check_files=False)
    assert_names(str(e.value), sheet, line=3, value="B\tb.pairs\textra")


def test_empty_sheet(tmp_path):
    sheet = tmp_path / "cells.tsv"
    sheet.write_text("")
    with pytest.raises(InputError) as e:
        read_sheet(sheet)
    assert_names(str(e.value), sheet)


# ------------------------------------------------------------------ QC pairing
def _contacts(cells):
    n = len(cells)
    return pd.DataFrame(
        {"total": [5000] * n, "cis": [4000] * n, "trans": [1000] * n, "dropped_unknown_chrom": [0] * n,
         "dropped_excluded": [0] * n},
        index=pd.Index(cells, name="cell_id"),
    )  # fmt: skip


def _rna(cells):
    n = len(cells)
    return pd.DataFrame({"rna_umis": [1000] * n, "rna_genes": [400] * n}, index=pd.Index(cells, name="cell_id"))


def test_cells_in_only_one_modality_are_reported():
    t = qc_table(_contacts(["a", "b", "c"]), _rna(["b", "c", "d"]), QCThresholds(), rna_path="rna.tsv")
    assert list(t.index) == ["a", "b", "c", "d"]
    assert list(t["matched"]) == [False, True, True, False]
    assert list(t["pass"]) == [False, True, True, False]
    assert t.loc["a", "reason"] == "not in RNA matrix"
    assert t.loc["d", "reason"] == "not in cell sheet (no pairs)"


def test_no_cell_in_both_modalities():
    with pytest.raises(InputError) as e:
        qc_table(_contacts(["a", "b"]), _rna(["x", "y"]), QCThresholds(), rna_path="rna.tsv")
    msg = str(e.value)
    assert msg.startswith("rna.tsv: ")
    assert "'a'" in msg and "'x'" in msg


def test_qc_threshold_of_wrong_type():
    with pytest.raises(InputError) as e:
        QCThresholds(min_contacts="many")
    assert (e.value.key, e.value.value) == ("qc.min_contacts", "many")


# ------------------------------------------------------------------ RNA matrix
RNA_HEADER = "gene\tc1\tc2\tc3\n"
RNA_ROWS = "Actb\t1\t2\t3\nGapdh\t0\t0.5\t4\n"


def test_negative_count(tmp_path, capsys):
    p = tmp_path / "rna.tsv"
    p.write_text(RNA_HEADER + RNA_ROWS + "Xist\t1\t-2\t3\n")
    with pytest.raises(InputError) as e:
        read_rna(p)
    assert_names(str(e.value), p, line=4, key="gene Xist, cell c2", value="-2")
    assert "negative" in str(e.value)

    out, stats = tmp_path / "out" / "counts.h5ad", tmp_path / "out" / "rna.tsv"
    capsys.readouterr()
    rc = main(["load-rna", str(p), "--out", str(out), "--stats", str(stats)])
    assert rc == 2
    assert not out.exists() and not stats.exists()
    assert_names(capsys.readouterr().err, p, line=4, key="gene Xist, cell c2")


def test_non_numeric_count(tmp_path):
    p = tmp_path / "rna.tsv.gz"
    with gzip.open(p, "wt") as fh:
        fh.write(RNA_HEADER + RNA_ROWS + "\n" + "Xist\t1\t2\tmany\n")
    with pytest.raises(InputError) as e:
        read_rna(p)
    assert_names(str(e.value), p, line=5, key="gene Xist, cell c3", value="many")  # blank line 4 counted
    assert "not a number" in str(e.value)


def test_missing_count_na(tmp_path):
    p = tmp_path / "rna.tsv"
    p.write_text(RNA_HEADER + RNA_ROWS + "Xist\tNA\t2\t3\n")
    with pytest.raises(InputError) as e:
        read_rna(p)
    assert_names(str(e.value), p, line=4, key="gene Xist, cell c1", value="NA")


def test_row_with_too_many_fields(tmp_path):
    p = tmp_path / "rna.tsv"
    p.write_text(RNA_HEADER + RNA_ROWS + "Xist\t1\t2\t3\t4\n")
    with pytest.raises(InputError) as e:
        read_rna(p)
    assert_names(str(e.value), p, line=4, key="gene Xist", value="Xist\t1\t2\t3\t4")


def test_duplicate_cell_ids_in_rna_header(tmp_path):
    p = tmp_path / "rna.tsv"
    p.write_text("gene\tc1\tc2\tc1\n" + RNA_ROWS)
    with pytest.raises(InputError) as e:
        read_rna(p)
    assert_names(str(e.value), p, line=1, key="cell", value="c1")
    assert "columns 2 and 4" in str(e.value)


def test_rna_header_only(tmp_path):
    p = tmp_path / "rna.tsv"
    p.write_text(RNA_HEADER)
    with pytest.raises(InputError) as e:
        read_rna(p)
    assert_names(str(e.value), p)
    assert "no genes" in str(e.value)


def test_gene_called_na_is_a_gene(tmp_path):
    p = tmp_path / "rna.tsv"
    p.write_text(RNA_HEADER + RNA_ROWS + "NA\t1\t1\t1\n")
    assert list(read_rna(p).var_names) == ["Actb", "Gapdh", "NA"]


# ------------------------------------------------------------------ annotation, genome
def test_annotation_with_no_gene_on_the_genome(tmp_path):
    p = tmp_path / "genes.bed"
    p.write_text("chrZ\t10\t100\tA\tE1\t+\nchrY\t10\t100\tB\tE2\t-\n")
    with pytest.raises(InputError) as e:
        read_genes(p, ChromNamer(tuple(SIZES)), SIZES)
    assert_names(str(e.value), p, value=["chrY", "chrZ"])
    assert "chromosome naming" in str(e.value)


def test_gtf_start_below_one(tmp_path):
    p = tmp_path / "genes.gtf"
    p.write_text('chr1\tx\tgene\t50\t100\t.\t+\t.\tgene_id "E1"; gene_name "A";\n'
                 'chr1\tx\tgene\t0\t100\t.\t+\t.\tgene_id "E2"; gene_name "B";\n')  # fmt: skip
    with pytest.raises(InputError) as e:
        read_genes(p, ChromNamer(tuple(SIZES)), SIZES)
    assert_names(str(e.value), p, line=2, value=["0", "100"])


def test_truncated_gzip_annotation(tmp_path):
    full = tmp_path / "genes.bed.gz"
    rng = np.random.default_rng(0)
    with gzip.open(full, "wt") as fh:
        for i in range(20_000):
            s = int(rng.integers(0, 900_000))
            fh.write(f"chr1\t{s}\t{s + int(rng.integers(1, 50_000))}\tG{i}\tE{i}\t+\n")
    data = full.read_bytes()
    p = tmp_path / "cut.bed.gz"
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError) as e:
        read_genes(p, ChromNamer(tuple(SIZES)), SIZES)
    assert_names(str(e.value), p)
    assert "truncated" in str(e.value)


def test_chromsizes_with_non_integer_size(tmp_path, capsys):
    p = tmp_path / "chrom.sizes"
    p.write_text("chr1\t1000000\nchr2\t5e5\n")
    with pytest.raises(InputError) as e:
        read_chromsizes(p)
    assert_names(str(e.value), p, line=2, value="5e5")

    pairs = tmp_path / "a.pairs"
    pairs.write_text(HEADER + rows(5))
    out = tmp_path / "out" / "cell.cool"
    rc, err = bin_pairs(pairs, p, out, capsys)
    assert rc == 2 and not out.exists()
    assert_names(err, p, line=2, value="5e5")


# ------------------------------------------------------------------ workflow config
def _snakemake() -> str:
    exe = Path(sys.executable).with_name("snakemake")
    if exe.exists():
        return str(exe)
    return shutil.which("snakemake") or str(REPO / ".venv" / "bin" / "snakemake")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("wf")
    for name in ("workflow", "config"):
        shutil.copytree(REPO / name, d / name)
    assert main(["demo-data", str(d / "resources" / "demo"), "--cells", "8"]) == 0
    return d


def _dry_run(workdir: Path, configfile_text: str) -> subprocess.CompletedProcess:
    cfg = workdir / "bad.yaml"
    cfg.write_text(configfile_text)
    return subprocess.run(
        [_snakemake(), "-n", "--configfile", "config/demo.yaml", str(cfg), "--cores", "1"],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra, expected",
    [
        ('qc: {min_contacts: "many"}\n', ["min_contacts", "'many'"]),  # wrong type
        ("foo: 1\n", ["'foo' was unexpected", "'foo': 1"]),  # unknown key
        ("embed: {x: {data: d, cells: c.tsv}}\n", ["embed.x: give either data", "['cells', 'data']"]),
        ("embed: {x: {cells: resources/demo/cells.tsv}}\n", ["embed.x: give either data", "['cells']"]),
        ("embed: {x: {cells: none.tsv, rna: r.tsv}}\n", ["none.tsv: cell sheet does not exist"]),
        ("embed: {x: {cells: c.tsv, rna: r.tsv, genes: g.bed}}\n", ["'genes' was unexpected"]),
    ],
)
def test_config_error_names_key_and_value(workdir, extra, expected):
    r = _dry_run(workdir, extra)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    for text in expected:
        assert text in out


@pytest.mark.slow
def test_config_demo_is_valid(workdir):
    # the same setup with the demo config alone dry-runs cleanly (the failures above are the config's)
    r = subprocess.run([_snakemake(), "-n", "--configfile", "config/demo.yaml", "--cores", "1"], cwd=workdir, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
