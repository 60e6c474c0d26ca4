"""scripts/bench_extract.py's part 5 (the GPU benchmark that travels): its synthetic
inputs follow the recorded length quantiles, and its code runs, here on the CPU with
tiny shapes, printing padded and packed rows whose figures add up."""

from __future__ import annotations

import numpy as np
from conftest import load_script

be = load_script("bench_extract")


def test_synthetic_lengths_follow_the_recorded_quantiles():
    for name, (_, _, q) in be.LENGTH_QUANTILES.items():
        assert len(q) == 21 and q == sorted(q), name
        n = be.synthetic_lengths(name, 20000, seed=3)
        assert n.min() >= q[0] and n.max() <= q[-1]
        got = np.percentile(n, [25, 50, 75])
        want = np.array([q[5], q[10], q[15]])
        assert np.all(np.abs(got - want) <= 0.05 * want + 2), (name, got, want)
    a = be.synthetic_sequences("esm_proteins", 30, seed=7)
    assert a == be.synthetic_sequences("esm_proteins", 30, seed=7)  # same seed, same inputs
    assert a != be.synthetic_sequences("esm_proteins", 30, seed=8)
    assert [len(s) for s in a] == be.synthetic_lengths("esm_proteins", 30, seed=7).tolist()
    assert set("".join(a)) <= set("ACDEFGHIKLMNPQRSTVWY")


def test_device_part_runs_on_the_cpu(capsys):
    args = be.parse_args(["--device", "cpu", "--device-shapes", "tiny", "--device-sets", "esm_proteins,viral_proteins", "--device-n", "40", "--repeats", "1"])
    rows = be.part_device(args)
    out = capsys.readouterr().out
    assert "measured matmul rate" in out and out.count("packed / padded:") == 2
    assert [(r["set"], r["pack"]) for r in rows] == [("esm_proteins", False), ("esm_proteins", True), ("viral_proteins", False), ("viral_proteins", True)]
    for r in rows:
        assert r["sequences"] == 40 and 0 <= r["padding"] < 1
        assert np.isclose(r["tokens_per_s"], r["tokens"] / r["seconds"]) and np.isclose(r["of_floor"], r["floor_seconds"] / r["seconds"])
    # the same sequences either way; packing never computes more positions than padding
    for padded, packed in zip(rows[::2], rows[1::2]):
        assert padded["tokens"] == packed["tokens"]
        assert packed["padding"] <= padded["padding"]
