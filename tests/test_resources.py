"""The prepare rules' memory formulas cover the real peak of their commands on real
data (the kernel's high-water mark of the job's process, not a count of our own)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ampflow.prepare.resources import NEEDS, bin_block_mem_mb

BIN = Path(sys.executable).parent


# a fresh interpreter runs the command, so that its children's high-water mark is the
# command's alone (this process's earlier children would count otherwise)
PEAK = (
    "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, capture_output=True);"
    " print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)


def _peak_mb(cmd, cwd) -> float:
    """Peak RSS (MB) of ``cmd``'s largest process."""
    r = subprocess.run([sys.executable, "-c", PEAK, *cmd], cwd=cwd, check=True, capture_output=True, text=True, timeout=300)
    return int(r.stdout.split()[-1]) * 1024 / 1e6


def test_load_rna_formula_covers_the_real_hires_matrix(shared_data, tmp_path):
    rna = shared_data / "hires" / "GSE223917_HiRES_brain.rna.umicount.tsv.gz"
    peak = _peak_mb([str(BIN / "ampflow"), "load-rna", str(rna), "--out", "c.h5ad", "--stats", "s.tsv"], tmp_path)
    need = NEEDS["load_rna"].mem_mb(os.path.getsize(rna) / 1e6)
    print(f"load_rna on the HiRES brain matrix: peak {peak:.0f} MB, mem_mb {need}")
    assert peak < need


def test_bin_block_formula_covers_the_real_hires_cell(shared_data, tmp_path):
    """Four copies of the real cell binned at 1 Mb, 500 kb and 100 kb by one worker."""
    pairs = shared_data / "hires" / "GSM6998595_GasaE751001.pairs.gz"
    sizes = tmp_path / "mm10.sizes"
    lines = (shared_data / "annotation" / "mm10.chrom.sizes").read_text().splitlines()
    sizes.write_text("\n".join(ln for ln in lines if ln.split("\t")[0] not in ("chrY", "chrM")) + "\n")
    sheet = tmp_path / "cells.tsv"
    sheet.write_text("cell_id\tpairs\n" + "".join(f"c{i}\t{pairs}\n" for i in range(4)))
    cmd = [str(BIN / "ampflow"), "bin-block", "--sheet", str(sheet), "--block", "0000", "--block-cells", "4",
           "--chromsizes", str(sizes), "--resolutions", "1000000", "500000", "100000",
           "--out-scool", "a.scool", "b.scool", "c.scool", "--stats", "s.tsv", "--threads", "1"]  # fmt: skip
    peak = _peak_mb(cmd, tmp_path)
    need = bin_block_mem_mb([pairs] * 4, threads=1)
    print(f"bin_block of the real cell: peak {peak:.0f} MB, mem_mb {need}")
    assert peak < need
