"""FASTA reading for extraction: format variants, one policy per problem, clear errors."""

from __future__ import annotations

import gzip

import pytest
from helpers import assert_names

from ampflow.base.errors import InputError
from ampflow.io.fasta import DNA, PROTEIN, FastaCleaner, FastaPolicy, read_fasta


def write(tmp_path, text: str, name: str = "in.fa"):
    p = tmp_path / name
    p.write_text(text)
    return p


def clean(path, alphabet=PROTEIN, max_length=1022, **policy):
    c = FastaCleaner(path, alphabet, FastaPolicy(**policy), max_length)
    return list(c.records()), c


def test_wrapped_lower_case_crlf_descriptions_comments_gzip(tmp_path):
    text = ";old comment\r\n>p1 some description\r\nmkt\r\nAYI\r\n\r\n>p2\nMK TA*\n"
    recs, c = clean(write(tmp_path, text))
    assert [(r.id, r.seq, r.line, r.number) for r in recs] == [("p1", "MKTAYI", 2, 1), ("p2", "MKTA", 6, 2)]
    assert c.summary() == {"kept": 2, "lower_case": 1, "records": 2, "stop_removed": 1}
    assert c.problems == []
    gz = tmp_path / "in.fa.gz"
    with gzip.open(gz, "wt") as fh:
        fh.write(text)
    assert [r.seq for r in clean(gz)[0]] == ["MKTAYI", "MKTA"]


def test_whole_header_as_id(tmp_path):
    p = write(tmp_path, ">MH1 phage  x_1 # 1\nMK\n>MH1 phage x_2 # 9\nMA\n")
    recs, _ = clean(p, ids="header")
    assert [r.id for r in recs] == ["MH1 phage x_1 # 1", "MH1 phage x_2 # 9"]


def test_empty_records(tmp_path):
    p = write(tmp_path, ">a\n>b\n*\n>c\nMK\n")
    recs, c = clean(p)
    assert [r.id for r in recs] == ["c"]
    assert [(q.id, q.problem, q.action, q.line) for q in c.problems] == [("a", "empty", "skipped", 1), ("b", "empty", "skipped", 2)]
    with pytest.raises(InputError) as e:
        clean(p, empty="fail")
    assert_names(str(e.value), p, line=1, value="a")


def test_invalid_letters(tmp_path):
    p = write(tmp_path, ">ok\nMKT\n>bad desc\nMK*T-1\n")
    recs, c = clean(p, invalid="skip")
    assert [r.id for r in recs] == ["ok"]
    (q,) = c.problems
    assert (q.problem, q.action, q.line) == ("invalid", "skipped", 3)
    assert "'*'" in q.detail and "'-'" in q.detail and "'1'" in q.detail
    with pytest.raises(InputError) as e:
        clean(p)  # invalid: fail is the default
    msg = str(e.value)
    assert_names(msg, p, line=3, value="bad desc")
    assert "extract.fasta.invalid" in msg and "'bad'" in msg


def test_ambiguous_letters_each_policy(tmp_path):
    p = write(tmp_path, ">d1\nACGTNNRY\n>d2\nACGT\n")
    recs, c = clean(p, alphabet=DNA)
    assert recs[0].seq == "ACGTNNRY"
    assert [(q.id, q.action, q.detail) for q in c.problems] == [("d1", "kept", "2 x 'N', 1 x 'R', 1 x 'Y'")]
    recs, _ = clean(p, alphabet=DNA, ambiguous="replace")
    assert recs[0].seq == "ACGTNNNN"
    recs, _ = clean(p, alphabet=DNA, ambiguous="skip")
    assert [r.id for r in recs] == ["d2"]
    with pytest.raises(InputError) as e:
        clean(p, alphabet=DNA, ambiguous="fail")
    assert_names(str(e.value), p, line=1, value="d1")
    recs, _ = clean(write(tmp_path, ">p\nMKXBZJ\n"), ambiguous="replace")
    assert recs[0].seq == "MKXXXX"


def test_duplicate_ids_each_policy(tmp_path):
    p = write(tmp_path, ">x first\nMK\n>y\nMA\n>x second\nMT\n>x_2\nMW\n>x third\nMV\n")
    with pytest.raises(InputError) as e:
        clean(p)
    assert_names(str(e.value), p, line=5, value="x second")
    assert "first at line 1" in str(e.value)
    recs, c = clean(p, duplicate_ids="skip")
    assert [(r.id, r.seq) for r in recs] == [("x", "MK"), ("y", "MA"), ("x_2", "MW")]
    assert [(q.line, q.action) for q in c.problems] == [(5, "skipped"), (9, "skipped")]
    recs, c = clean(p, duplicate_ids="rename")
    # x_2 is taken by the first rename, so the real x_2 becomes x_2_2 and the third x x_3
    assert [r.id for r in recs] == ["x", "y", "x_2", "x_2_2", "x_3"]
    assert len({r.id for r in recs}) == 5


def test_too_long_each_policy(tmp_path):
    p = write(tmp_path, ">long\n" + "M" * 1030 + "\n>short\nMK\n")
    recs, c = clean(p)
    assert (len(recs[0].seq), recs[0].original_length) == (1022, 1030)
    assert [(q.problem, q.action, q.length) for q in c.problems] == [("too_long", "truncated", 1030)]
    assert [r.id for r in clean(p, too_long="skip")[0]] == ["short"]
    with pytest.raises(InputError) as e:
        clean(p, too_long="fail")
    assert_names(str(e.value), p, line=1, value="long")


@pytest.mark.parametrize(
    "text, line, words",
    [
        ("MKT\n>a\nMK\n", 1, "before the first"),
        ("", None, "no FASTA record"),
        (">a\nMK\n>\nMK\n", 3, "without an id"),
    ],
)
def test_not_fasta(tmp_path, text, line, words):
    p = write(tmp_path, text)
    with pytest.raises(InputError) as e:
        list(read_fasta(p)) if line != 3 else clean(p)
    assert words in str(e.value)
    assert_names(str(e.value), p, line=line)


def test_policy_values_checked():
    with pytest.raises(InputError) as e:
        FastaPolicy(ambiguous="drop")
    assert "extract.fasta.ambiguous" in str(e.value) and "drop" in str(e.value)
    with pytest.raises(InputError):
        FastaPolicy.from_dict({"dup": "skip"})
