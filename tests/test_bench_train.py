"""scripts/bench_train.py on a tiny genome: every component is in the table with its
seconds, every variant has a floor ratio, and the components add up to the step.

The sum is checked against an independent clock: the script times plain steps with
nothing installed, apart from the instrumented steps whose components it sums.
"""

from __future__ import annotations

import re

import pytest
from conftest import load_script

bt = load_script("bench_train")
STRATA = 4
NUMBER = r"(\d+\.\d+)"


@pytest.fixture
def sizes(tmp_path):
    path = tmp_path / "tiny.chrom.sizes"
    path.write_text("chrA\t3000000\nchrB\t2000000\nchrM\t16000\n")
    return path


def run(capsys, sizes, *extra) -> str:
    argv = [
        "--chrom-sizes", str(sizes), "--chroms", "chrA", "chrB", "--shapes", f"100000:{STRATA}",
        "--genes", "30", "--graph-degree", "3", "--cells", "16", "--batch", "8", "--steps", "5",
        "--matmul", "256", "--threads", "1", "--memory-gib", "1", *extra,
    ]  # fmt: skip
    assert bt.main(argv) == 0
    return capsys.readouterr().out


def test_table_has_every_component_and_ratio(capsys, sizes):
    out = run(capsys, sizes)
    assert "tiny 100kb/4: 50 anchors" in out
    components = ["encoders", "graph", *(f"attention k={k}" for k in range(1, STRATA)), "decode", "likelihood",
                  "other forward", "backward", "optimizer"]  # fmt: skip
    rows = {}
    for name in [*components, "sum of components", "plain step"]:
        line = next((x for x in out.splitlines() if x.strip().startswith(name + " ")), None)
        assert line is not None, (name, out)
        rows[name] = [float(x) for x in re.findall(r"-?\d+\.\d+", line[len(name) + 2 :])]
    # GFLOP, then (seconds, floor ratio) for old and for new
    plain = rows["plain step"]
    assert len(plain) == 5 and plain[0] > 0, plain
    old_ratio, new_ratio = plain[2], plain[4]
    assert all(s > 0 for s in plain[1::2]), plain
    assert 0 < old_ratio <= 1.5 and 0 < new_ratio <= 1.5, plain
    for name in components:
        assert len(rows[name]) >= 3 and all(x >= 0 for x in rows[name]), (name, rows[name])
    # the components of an instrumented step add up to about a plain step timed apart
    # (a shared CPU's load makes single steps vary)
    # (the fastest of each: other processes' load on a shared CPU only ever adds time)
    sums = [float(x) for x in re.findall(r"components sum to \d+\.\d+x .*fastest steps: (\d+\.\d+)x", out)]
    assert len(sums) == 2, out
    assert all(0.5 <= x <= 2.0 for x in sums), sums
    assert re.search(rf"new / old speed-up: {NUMBER}x", out)
    summary = out[out.index("summary") :]
    assert re.search(r"100kb/4 .* \d+\.\d+x .* \d+\.\d+\s*$", summary.splitlines()[2]), summary


def test_old_kernel_skipped_with_its_reason(capsys, sizes):
    out = run(capsys, sizes, "--old", "chunked", "--max-old-gib", "0", "--steps", "1")
    assert "old: skipped: the chunked kernel (chunk 2048) would save" in out
    assert "old s/step" not in out.split("summary")[0]
    assert re.search(r"100kb/4 .* skipped ", out)
    assert re.search(rf"new: step {NUMBER} s; floor {NUMBER} s .* floor ratio {NUMBER}", out)


def test_band_and_chunk_pair_counts():
    """The floor's attention term counts in-window pairs; the old kernel's, its blocks."""
    n, w = 20, 3
    assert bt.band_pairs(n, w) == sum(1 for i in range(n) for j in range(n) if abs(i - j) <= w)
    assert bt.chunked_pairs(n, w, 8) == 8 * 11 + 8 * 14 + 4 * 7
    assert bt.chunked_pairs(n, w, 64) == n * n
