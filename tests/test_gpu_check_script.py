"""scripts/gpu_check.sh (`make gpu-check`) without a GPU: it parses, says in one line
that it skips, and exits 0 (or the skip code asked for); with a stand-in interpreter
that claims a GPU, every check prints its one line and a failing check fails the run."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO

SCRIPT = REPO / "scripts" / "gpu_check.sh"


def run(env_extra: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_extra}
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=timeout)


def test_syntax():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the script runs its checks")
@pytest.mark.parametrize("code", ["", "77"])
def test_without_a_gpu_one_line_and_the_skip_code(code, tmp_path):
    t0 = time.monotonic()
    p = run({"PYTHON": sys.executable, "GPU_CHECK_SKIP_CODE": code or "0", "GPU_CHECK_OUT": str(tmp_path / "o")})
    lines = p.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: SKIP no CUDA GPU visible to torch"), p.stdout + p.stderr
    assert p.returncode == int(code or 0)
    assert time.monotonic() - t0 < 30
    assert not (tmp_path / "o").exists()  # nothing run, nothing written


FAKE = r"""#!/usr/bin/env bash
# a stand-in python: a GPU is visible, bench_memory_model fails, the rest pass
args="$*"
case "$args" in
  *torch.__version__*) echo "2.13.0 12.4 True" ;;
  *is_bf16_supported*) exit 0 ;;
  *bench_memory_model*) echo "worst ratio 1.250 (mm10 1Mb L10, fp32)"; exit 1 ;;
  *bench_train*--hires*) echo "hires 1000000:10 graphed-loop: 85.05 steps/s (eager 17.2: 4.9x), launches/step 120" \
      "(graph launches 1), GPU kernels+copies/step 4044"
    printf '%s%s%s%s\n' "hires 1000000:10 graphed: 312.40 steps/s (eager 17.2: 18.2x), launches/step 1 (graph launches 1), " \
      "GPU kernels+copies/step 3300, host syncs/step 0 (+0 in optimizer.step; CUDA sync debug mode 0), " \
      "compile 0.0 s, capture 1.20 s, first step 2.10 s, epoch 0.68 s (211 steps), " \
      "FLOP floor ratio 0.100, bytes floor ratio 0.200"
    echo "hires 1000000:10 graphed: GPU kernel and copy time 2.95 ms/step against 3.20 ms/step of wall time;" \
      "void at::native::elementwise_kernel<128, 4> 31%, gemm 20%"
    echo "hires 1000000:10 graphed: host syncs by op: {}"
    echo "hires early-stopping 1000000:10 graphed: did not stop within 40 s: epochs pretrain 12 of 300 so far, 2500 steps, 62.5 steps/s" \
      "(validation each epoch included); of the wall time validation 3.1 s, best-weight copies 0.2 s, checkpoints 0.4 s," \
      "the rest (steps, batches, metrics) 36.3 s" ;;
  *bench_train*) echo "  matrix-product rate 50000.0 GFLOP/s wall"
    echo "  new: step 0.0500 s; floor 0.0100 s (1 GFLOP): floor ratio 0.200; its components sum to 1.10x its plain step (medians); 20.00 steps/s" ;;
  *bench_extract*) echo "target 3B prodigal_proteins: varlen at 51.0% of the floor, target 50%: MET" ;;
  *pytest*) echo "5 passed in 3.00s" ;;
  *) cat >/dev/null; echo "fake $1 ok" ;;
esac
"""


def test_every_check_prints_one_line_and_failures_count(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(FAKE)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    p = run({"PYTHON": str(fake), "GPU_CHECK_OUT": str(tmp_path / "o")})
    lines = p.stdout.splitlines()
    checks = {ln.split()[1]: ln for ln in lines if ln.startswith("CHECK ")}
    assert list(checks) == ["env", "mem", "mem-graphed", "attn-fp32", "attn-bf16", "train", "train-hires", "extract", "pytest"], p.stdout
    assert checks["mem"].startswith("CHECK mem FAIL worst ratio 1.250"), checks["mem"]
    assert checks["mem-graphed"].startswith("CHECK mem-graphed FAIL worst ratio 1.250"), checks["mem-graphed"]
    assert checks["env"].startswith("CHECK env PASS fake - ok")
    assert "PASS" in checks["train"] and "20.00 steps/s" in checks["train"] and "50000.0 GFLOP/s" in checks["train"]
    hires = checks["train-hires"]
    assert hires.startswith(
        "CHECK train-hires PASS 1000000:10 graphed-loop: 85.05 steps/s 4.9x, launches/step 120, kernels 4044; "
        "1000000:10 graphed: 312.40 steps/s 18.2x, launches/step 1, kernels 3300, host syncs/step 0 (sync debug mode 0), "
        "compile 0.0 s, capture 1.20 s, epoch 0.68 s, FLOP floor 0.100, bytes floor 0.200; "
        "1000000:10 graphed: kernels busy 2.95 of 3.20 ms/step; "
        "early-stopping 1000000:10 graphed: did not stop within 40 s"
    ), hires
    split = "of the wall time validation 3.1 s, best-weight copies 0.2 s, checkpoints 0.4 s, the rest (steps, batches, metrics) 36.3 s;"
    assert f"2500 steps, 62.5 steps/s; {split}" in hires, hires
    assert "by op" not in hires and "gemm" not in hires  # the kernels' names stay in the log
    assert checks["extract"].startswith("CHECK extract PASS target 3B prodigal_proteins: varlen at 51.0%")
    assert checks["pytest"].startswith("CHECK pytest PASS 5 passed")
    assert lines[-1].startswith("gpu-check: FAIL") and p.returncode == 1
    assert (tmp_path / "o" / "mem.log").read_text().startswith("worst ratio")


def test_only_the_checks_asked_for_run(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(FAKE)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    p = run({"PYTHON": str(fake), "GPU_CHECK_OUT": str(tmp_path / "o"), "GPU_CHECK_ONLY": "env train-hires"})
    names = [ln.split()[1] for ln in p.stdout.splitlines() if ln.startswith("CHECK ")]
    assert names == ["env", "train-hires"], p.stdout
    assert p.returncode == 0 and p.stdout.splitlines()[-1].startswith("gpu-check: PASS")
