"""Binning in blocks of cells: each block's .scool holds exactly its cells' pixels, the
gathered .scool every cell's, and the workflow plans one job a block (Snakemake's own
dry run is the referee for which jobs run)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import cooler
import pandas as pd
import pytest
import yaml
from conftest import workflow_copy
from helpers import independent_count

from ampflow.cli import main
from ampflow.io.genome import read_chromsizes, resolution_label
from ampflow.prepare.blocks import block_digest, block_names, block_rows, gather_scool, gather_stats
from ampflow.prepare.cells import ParseOptions, bin_block

RESOLUTIONS = (1_000_000, 500_000, 100_000)
BIN = Path(sys.executable).parent


def test_block_names_and_rows():
    assert block_names(7500, 250) == [f"{i:04d}" for i in range(30)]
    assert len(block_names(7510, 250)) == 31
    assert block_names(1, 250) == ["0000"]
    assert block_rows("0002", 250) == slice(500, 750)
    with pytest.raises(Exception, match="block_cells"):
        block_names(10, 0)
    assert block_digest(["a"], ["x.pairs"]) != block_digest(["a"], ["y.pairs"])


def _opts(sizes, resolutions=RESOLUTIONS):
    return ParseOptions(tuple(sizes.items()), None, "", "auto", None, tuple(sorted(resolutions)))


def test_gathered_blocks_hold_every_pixel_of_every_cell(shared_data, demo_dir, tmp_path):
    """Three blocks (2 + 2 + 1 cells: the real HiRES cell and demo cells on their own
    genome's bins) gathered into one .scool: each cell's pixels equal a plain-Python
    count of its pairs file, at every resolution; the stats table keeps sheet order."""
    sheet = pd.read_csv(demo_dir / "cells.tsv", sep="\t").iloc[:5]
    sizes = read_chromsizes(demo_dir / "chrom.sizes")
    blocks = []
    for b in block_names(len(sheet), 2):
        rows = sheet.iloc[block_rows(b, 2)]
        folder = tmp_path / b
        out = {res: folder / f"{res}.scool" for res in RESOLUTIONS}
        bin_block(rows["cell_id"], rows["pairs"], _opts(sizes), out, folder / "contacts.tsv")
        blocks.append(folder)
    for res in RESOLUTIONS:
        n = gather_scool([str(f / f"{res}.scool") for f in blocks], tmp_path / f"all.{res}.scool")
        assert n == 5
        path = str(tmp_path / f"all.{res}.scool")
        assert cooler.fileops.is_scool_file(path)
        for cell, pairs in zip(sheet["cell_id"], sheet["pairs"]):
            px = cooler.Cooler(f"{path}::/cells/{cell}").pixels()[:]
            got = {(int(a), int(b)): int(c) for a, b, c in zip(px["bin1_id"], px["bin2_id"], px["count"])}
            assert got == dict(independent_count(pairs, sizes, res)), (cell, res)
    table = gather_stats([str(f / "contacts.tsv") for f in blocks], tmp_path / "contacts.tsv")
    assert list(table.index) == list(sheet["cell_id"])

    # the real cell on mm10: three resolutions stored in well under 1 MB
    mm10 = read_chromsizes(shared_data / "annotation" / "mm10.chrom.sizes", [f"chr{i}" for i in range(1, 20)] + ["chrX"])
    pairs = shared_data / "hires" / "GSM6998595_GasaE751001.pairs.gz"
    out = {res: tmp_path / "real" / f"{res}.scool" for res in RESOLUTIONS}
    bin_block(["hires"], [str(pairs)], _opts(mm10), out, tmp_path / "real" / "contacts.tsv")
    px = cooler.Cooler(f"{out[100_000]}::/cells/hires").pixels()[:]
    assert int(px["count"].sum()) == 135083
    stored = sum(os.path.getsize(p) for p in out.values())
    print(f"real HiRES cell, 3 resolutions: {stored / 1e6:.3f} MB stored")
    assert stored < 1e6


def test_a_sheet_changed_since_planning_is_refused(demo_dir, tmp_path, capsys):
    """The block's digest is what the workflow planned: other rows are refused in one line."""
    args = ["bin-block", "--sheet", str(demo_dir / "cells.tsv"), "--block", "0000", "--block-cells", "3",
            "--digest", "0123456789abcdef", "--chromsizes", str(demo_dir / "chrom.sizes"), "--resolutions", "1000000",
            "--out-scool", str(tmp_path / "b.scool"), "--stats", str(tmp_path / "c.tsv")]  # fmt: skip
    assert main(args) != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("ampflow bin-block: error:") and "changed since the workflow was planned" in last and "cells.tsv" in last
    assert not (tmp_path / "b.scool").exists() and not (tmp_path / "c.tsv").exists()


def _jobs(out: str) -> dict[str, int]:
    """Snakemake's dry-run job table: rule -> count."""
    rows = [ln.split() for ln in out.splitlines()]
    return {w[0]: int(w[1]) for w in rows if len(w) == 2 and w[1].isdigit() and w[0] != "total"}


def test_dry_run_of_7500_cells_plans_blocks_and_10_new_cells_one_block(demo_dir, tmp_path):
    """7,500 cells (demo pairs files reused) are 30 binning jobs of 250; once those exist,
    10 appended cells make one more block, and only it, the gather and what depends on
    them are planned."""
    root = workflow_copy(tmp_path)
    src = pd.read_csv(demo_dir / "cells.tsv", sep="\t")
    pairs = [str(Path(p).resolve()) for p in src["pairs"]]
    sheet = pd.DataFrame({"cell_id": [f"c{i:05d}" for i in range(7510)], "pairs": [pairs[i % len(pairs)] for i in range(7510)]})
    sheet["cell_type"] = "x"
    sheet.iloc[:7500].to_csv(root / "cells.tsv", sep="\t", index=False)
    # a user's config: the template, copied and pointed at the sheet (Hi-C only)
    cfg = yaml.safe_load((root / "config/config.yaml").read_text())
    cfg.update(dataset="big", inputs={"cells": "cells.tsv", "chromsizes": str(demo_dir / "chrom.sizes")})
    cfg["prepare"] = {"block_cells": 250}
    (root / "user.yaml").write_text(yaml.safe_dump(cfg))
    labels = [resolution_label(c["resolution"]) for c in cfg["configs"]]
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    cmd = [str(BIN / "snakemake"), "-n", "--cores", "2", "results/big/binned/pseudobulk.mcool", "--configfile", "user.yaml"]
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    jobs = _jobs(r.stdout)
    assert jobs["bin_block"] == 30 and jobs["gather_blocks"] == 1, jobs
    # the 30 blocks done (their outputs newer than every pairs file), then 10 cells appended
    time.sleep(0.05)
    for b in block_names(7500, 250):
        folder = root / "results/big/binned/blocks" / b
        folder.mkdir(parents=True)
        for name in [f"{label}.scool" for label in labels] + ["contacts.tsv"]:
            (folder / name).touch()
    sheet.to_csv(root / "cells.tsv", sep="\t", index=False)
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    jobs = _jobs(r.stdout)
    print("after adding 10 cells:", jobs)
    assert jobs["bin_block"] == 1 and jobs["gather_blocks"] == 1, (jobs, r.stdout[:3000])
    assert "block=0030" in r.stdout and "block=0029" not in r.stdout
