"""``scripts/bench_optimizer.py``: Adam's step by implementation at a small genome's shape.

Referees: torch's per-parameter Adam loop (the foreach kernels must equal it bit for bit,
the fused kernel to rounding), and the parameters' own count from the model.
"""

from __future__ import annotations

import re

from conftest import load_script

bo = load_script("bench_optimizer")

ROW = re.compile(
    r"^  (loop|foreach|fused)\s+([\d.]+) ms/step\s+floor ratio ([\d.]+)\s+([\d.]+)x the loop\s+"
    r"largest difference from the loop after (\d+) steps: ([\d.e+-]+) of the largest parameter$",
    re.M,
)


def test_the_three_implementations_step_alike(tmp_path, capsys):
    sizes = tmp_path / "genome.sizes"
    sizes.write_text("chrA\t3000000\nchrB\t2000000\n")
    assert bo.main(["--chrom-sizes", str(sizes), "--chroms", "chrA", "chrB", "--shapes", "100000:4", "--genes", "30", "--steps", "2", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    rows = {m.group(1): m for m in ROW.finditer(out)}
    assert set(rows) == {"loop", "foreach", "fused"}, out
    assert float(rows["loop"].group(6)) == 0.0 and float(rows["foreach"].group(6)) == 0.0, out
    assert float(rows["fused"].group(6)) <= 1e-5, out  # another kernel, the same arithmetic to rounding
    assert all(int(m.group(5)) == 3 for m in rows.values()) and float(rows["loop"].group(4)) == 1.0
    shape = bo.build_shape({"chrA": 3_000_000, "chrB": 2_000_000}, 100_000, 4, 30, 10, 0)
    params, _ = bo.parameters_of(shape, 0)
    n = sum(p.numel() for p in params)
    assert f"{n / 1e6:,.1f} M parameters in {len(params)} tensors" in out


def test_an_absent_genome_is_skipped(tmp_path, capsys):
    assert bo.main(["--chrom-sizes", str(tmp_path / "none.sizes")]) == 0
    assert "skipped" in capsys.readouterr().out
