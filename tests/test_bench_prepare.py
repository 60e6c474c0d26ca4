"""scripts/bench_prepare.py's stage measurements against known quantities: a grandchild
that holds 200 MB, a child that burns a known CPU time, a stage that writes a known
number of bytes. The referee is each of those, not the measuring code."""

from __future__ import annotations

import sys
import textwrap

import pytest
from conftest import load_script

bp = load_script("bench_prepare")
MB = 1e6
HOLD = 200 * 2**20  # bytes the grandchild writes and holds


def child_script(tmp_path, body: str):
    path = tmp_path / "child.py"
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


def test_sampler_sees_a_grandchilds_allocation(tmp_path):
    # parent -> grandchild: the memory sits two levels below the process measured, as a
    # job's does below Snakemake; every page is written so that it is resident
    grandchild = f"b = bytearray(b'\\x01') * {HOLD}; import time; time.sleep(1.0)"
    cmd = child_script(
        tmp_path,
        f"""
        import subprocess, sys
        subprocess.run([sys.executable, "-c", {grandchild!r}], check=True)
    """,
    )
    m = bp.measure(cmd, cwd=tmp_path, watch=tmp_path / "none", log=tmp_path / "log", interval=0.1)
    assert m.samples >= 5
    assert m.rss_jobs >= HOLD, m  # the sum over descendants
    assert m.hwm >= HOLD, m  # and the kernel's own peak of the grandchild
    assert m.pss_jobs >= HOLD, m  # private pages count whole in the proportional size
    # two interpreters' worth on top of the allocation, no more
    assert m.rss_jobs < HOLD + 150 * MB, m
    assert m.rss_root < 100 * MB  # the measured process itself did not allocate
    assert m.rss_tree >= m.rss_jobs


def test_cpu_and_disk_of_a_stage(tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    # a child that burns ~0.6 s of CPU in a grandchild, then writes 5 MB of random bytes
    burn = "import time; t = time.process_time()\nwhile time.process_time() - t < 0.6: pass"
    cmd = child_script(
        tmp_path,
        f"""
        import os, subprocess, sys
        subprocess.run([sys.executable, "-c", {burn!r}], check=True)
        os.makedirs({str(out / "binned")!r}, exist_ok=True)
        with open({str(out / "binned" / "x.bin")!r}, "wb") as fh:
            fh.write(os.urandom(5 * 2**20))
    """,
    )
    m = bp.measure(cmd, cwd=tmp_path, watch=out, log=tmp_path / "log", interval=0.1)
    assert m.cpu >= 0.6  # the grandchild's CPU counts (waited for by its parent)
    assert m.cpu < m.wall + 0.5  # one process at a time: not more CPU than wall
    assert 5 * 2**20 <= m.disk < 5 * 2**20 + 64 * 1024
    assert bp.subfolder_disk(out) == {"binned": m.disk}


def test_a_failing_stage_stops_the_bench(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"]
    with pytest.raises(SystemExit, match="exit 3"):
        bp.measure(cmd, cwd=tmp_path, watch=tmp_path, log=tmp_path / "log")


def test_stage_targets_are_files_of_the_workflow():
    stages = bp.stage_targets("bench_9")
    names = [n for n, _ in stages]
    assert names[:5] == ["binning", "rna counts", "qc cells", "split", "pseudobulk"]
    binning = dict(stages)["binning"]
    assert binning == ["results/bench_9/qc/contacts.tsv"] + [f"results/bench_9/binned/{r}.scool" for r in ("1mb", "500kb", "100kb")]
    for cfg in ("1mb_s10", "500kb_s20", "100kb_s30"):
        for kind in ("hic.h5ad", "rna.h5ad", "graph"):
            assert any(t == f"results/bench_9/data/{cfg}/{kind}" for _, ts in stages for t in ts)


def test_cell_counts_option():
    assert bp.parse_args(["--cells", "300,100"]).cells == [100, 300]
    assert bp.parse_args(["--cells", "20,40"]).contacts == 150_000
    assert bp.parse_args([]).contacts == 20_000_000
    with pytest.raises(SystemExit):
        bp.parse_args(["--cells", "4"])
