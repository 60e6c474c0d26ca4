"""scripts/bench_stacked_strata.py at a small mm10 shape: the stacked step dispatches fewer
computing operations than the loop over strata, counted by a dispatch mode in the same
run (the referee is the loop's own count)."""

from __future__ import annotations

import re

from conftest import load_script


def test_stacking_dispatches_fewer_computing_operations(capsys, shared_data):
    bench = load_script("bench_stacked_strata")
    assert bench.main(["--shapes", "10000000:4", "--reps", "1", "--threads", "1", "--data-dir", str(shared_data)]) == 0
    out = capsys.readouterr().out
    m = re.search(r"10000000:4: computing ops/step (\d+) -> (\d+) .*steps/s ([\d.]+) -> ([\d.]+)", out)
    assert m, out
    loop, stacked = int(m[1]), int(m[2])
    # four strata: three blocks and their decodes in one pass instead of three
    assert 0 < stacked < loop, out
    assert float(m[3]) > 0 and float(m[4]) > 0
