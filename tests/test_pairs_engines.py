"""The compiled pairs scanner and the pandas reader agree, on real files and edge cases."""

from __future__ import annotations

import gzip

import numpy as np
import pytest

from ampflow.base.errors import InputError
from ampflow.io.genome import ChromNamer, read_chromsizes
from ampflow.io.pairs import read_pairs, sniff_layout

ENGINES = ("compiled", "pandas")
BIG = 300_000_000  # generous sizes where a test file carries no genome of its own


def both(path, sizes, **kw):
    namer = ChromNamer(tuple(sizes), kw.pop("strip_prefix", ""), kw.pop("chr_prefix", "auto"))
    return [read_pairs(path, namer, sizes, engine=e, **kw) for e in ENGINES]


def assert_same(a, b):
    assert a.stats == b.stats
    for f in ("chrom1", "pos1", "chrom2", "pos2"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f


@pytest.mark.parametrize(
    "rel, genome",
    [
        ("hires/GSM6998595_GasaE751001.pairs.gz", "mm10"),
        ("hires/hires_utils_test.hg38.impute.pairs.gz", "header"),
        ("pairs/mm9.sample1.pairs", "header"),
        ("pairs/hg19.sample1.noheader.pairs", "big"),
        ("pairs/4dn.chr21_22.pairs.gz", "big"),
        ("schic/gageseq_chr1/A1_A4.pairs.gz", "mm10"),
    ],
)
def test_real_files_same_contacts(shared_data, rel, genome):
    path = shared_data / rel
    if genome == "mm10":
        sizes = read_chromsizes(shared_data / "annotation" / "mm10.chrom.sizes")
    elif genome == "header":
        sizes = sniff_layout(path).header_chromsizes
    else:
        sizes = {f"chr{c}": BIG for c in [*range(1, 23), "X", "Y", "M"]}
    compiled, pandas_ = both(path, sizes, strip_prefix="mm10_")
    assert len(compiled) > 0
    assert_same(compiled, pandas_)


def write(path, text, gz=False, members=1):
    data = text.encode()
    if gz:
        step = max(1, len(data) // members)
        path.write_bytes(b"".join(gzip.compress(data[i : i + step]) for i in range(0, len(data), step)))
    else:
        path.write_bytes(data)
    return path


SIZES = {"chr1": 1000, "chr2": 800}
HEADER = "## pairs format v1.0\n#columns: readID chr1 pos1 chr2 pos2 strand1 strand2\n"
ROWS = [".\tchr1\t10\tchr1\t500\t+\t-", ".\tchr1\t20\tchr2\t30\t+\t+", ".\t2\t40\tchr2\t800\t-\t-", ".\tchr9\t1\tchr1\t2\t+\t+"]


@pytest.mark.parametrize(
    "name, text, gz, members",
    [
        ("plain", HEADER + "\n".join(ROWS) + "\n", False, 1),
        ("crlf", (HEADER + "\n".join(ROWS) + "\n").replace("\n", "\r\n"), False, 1),
        ("no-final-newline", HEADER + "\n".join(ROWS), False, 1),
        ("blank-lines", HEADER + "\n" + "\n\n".join(ROWS) + "\n\n", False, 1),
        ("comment-mid-file", HEADER + ROWS[0] + "\n#note\n" + "\n".join(ROWS[1:]) + "\n", False, 1),
        ("hash-in-read-id", HEADER + "\n".join("r#0/1" + r[1:] for r in ROWS) + "\n", False, 1),
        ("gzip-multi-member", HEADER + "\n".join(ROWS) + "\n", True, 3),
        ("whitespace", "\n".join(r.replace("\t", "  ") for r in ROWS) + "\n", False, 1),
    ],
)
def test_edge_cases_same_contacts(tmp_path, name, text, gz, members):
    path = write(tmp_path / f"{name}.pairs{'.gz' if gz else ''}", text, gz, members)
    compiled, pandas_ = both(path, SIZES)
    assert compiled.stats["total"] == 4 and compiled.stats["dropped_unknown_chrom"] == 1
    assert_same(compiled, pandas_)


@pytest.mark.parametrize(
    "bad, message",
    [
        (".\tchr1\t10\tchr1", "too few columns"),
        (".\tchr1\t1e3\tchr1\t5\t+\t+", "pos1 is not an integer"),
        (".\tchr1\t10\tchr1\t-5\t+\t+", "pos2 is negative"),
        (".\tchr1\t10\tchr2\t801\t+\t+", "past the end of chr2"),
    ],
)
def test_bad_lines_same_error(tmp_path, bad, message):
    path = write(tmp_path / "bad.pairs.gz", HEADER + ROWS[0] + "\n" + bad + "\n" + ROWS[1] + "\n", gz=True)
    errors = []
    for engine in ENGINES:
        with pytest.raises(InputError) as e:
            read_pairs(path, ChromNamer(tuple(SIZES)), SIZES, engine=engine)
        errors.append(str(e.value))
    assert errors[0] == errors[1]
    assert message in errors[0] and f"{path}:4" in errors[0]


def test_truncated_gzip_same_error(tmp_path):
    full = gzip.compress((HEADER + "\n".join(ROWS * 2000) + "\n").encode())
    path = tmp_path / "cut.pairs.gz"
    path.write_bytes(full[: len(full) // 2])
    for engine in ENGINES:
        with pytest.raises(InputError, match="truncated or corrupt gzip"):
            read_pairs(path, ChromNamer(tuple(SIZES)), SIZES, engine=engine)
