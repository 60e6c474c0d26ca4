#!/usr/bin/env python
"""All 400 labelled Lee et al. 2019 cortex cells as a folder ``bench_science.py`` reads.

The shared data hold 174 of the cells of the BandNorm R package's example data (three
of its five sequencing batches). This writes all 400 (100 each of Astro, ODC, MG and
Sst; chr1 at 1 Mb; batches 181218_21yr, 190305_21yr, 190305_29yr, 190315_21yr and
190315_29yr) in the same layout: ``cells.tsv`` (``cell_id``, ``pairs``, ``cell_type``,
``batch``), one 4DN pairs file per cell under ``pairs/`` and ``chrom.sizes``, plus
``source_names.tsv`` (each ``cell_id``'s name in the source, which carries its type:
kept out of ``cells.tsv``).

Input: the folder of ``hic_df.rda``, ``batch.rda`` and ``cell_type.rda`` from the
``data/`` folder of https://github.com/sshen82/BandNorm, read with ``pyreadr`` (``pip
install pyreadr``; R is not needed). The source is binned at 1 Mb: each contact of bin
pair (A, B), ``count`` of them, is written as one pair at the bins' midpoints (the last,
short bin of chr1 at its own midpoint), as the shared folder does, so that binning the
files at 1 Mb gives back the source matrix exactly. Cell ids are ``lee2019_NNN`` in a
seeded random order (``--seed``), so neither the id nor the order tells the type.

    pip install pyreadr
    git clone --depth 1 https://github.com/sshen82/BandNorm /tmp/BandNorm
    python scripts/lee2019_from_bandnorm.py /tmp/BandNorm/data /tmp/lee400/schic/lee2019_pfc_chr1
    PYTHONPATH=src python scripts/bench_science.py --lee /tmp/lee400/schic/lee2019_pfc_chr1 --sections lobo

The folder appears under its final name only when complete.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from ampflow.base.atomic import atomic_path
from ampflow.demo import write_pairs

#: hg19 chr1, the assembly of the source (Lee et al. 2019 mapped to hg19)
CHROM, CHROM_SIZE, BIN = "chr1", 249_250_621, 1_000_000
PAIRS_COLUMNS = "readID chr1 pos1 chr2 pos2 strand1 strand2"
CONTACT_COLUMNS = ("chrom", "binA", "binB", "count", "cell")


def midpoint(bin_start: np.ndarray) -> np.ndarray:
    """Each 1 Mb bin's midpoint as a 1-based position; the last, short bin's own."""
    end = np.minimum(bin_start + BIN, CHROM_SIZE)
    return (bin_start + end) // 2


def check_contacts(contacts: pd.DataFrame, source: str) -> pd.DataFrame:
    """The source's contact table with integer bins and counts, or a ValueError naming
    the file, the column and the first bad value."""
    missing = [c for c in CONTACT_COLUMNS if c not in contacts.columns]
    if missing:
        raise ValueError(f"{source}: no column(s) {missing}; has {list(contacts.columns)}")
    bad = contacts[contacts["chrom"] != CHROM]
    if len(bad):
        raise ValueError(f"{source}: row {bad.index[0]}: chrom {bad['chrom'].iloc[0]!r}, expected {CHROM!r} only")
    out = contacts.loc[:, list(CONTACT_COLUMNS)].copy()
    for col in ("binA", "binB", "count"):
        values = out[col].to_numpy(dtype=float)
        wrong = ~np.isfinite(values) | (values != np.round(values)) | (values < 0)
        if col != "count":
            wrong |= (values % BIN != 0) | (values >= CHROM_SIZE)
        if wrong.any():
            row = int(np.flatnonzero(wrong)[0])
            what = "a non-negative integer" if col == "count" else f"a multiple of {BIN} below {CHROM_SIZE}"
            raise ValueError(f"{source}: row {out.index[row]}: {col} {float(values[row])!r} is not {what}")
        out[col] = values.astype(np.int64)
    return out


def cell_labels(batch: pd.DataFrame, cell_type: pd.DataFrame) -> pd.DataFrame:
    """One row per cell: ``source_name``, ``batch``, ``cell_type``, from the two tables."""
    b = batch.rename(columns={"cell_name": "source_name"})[["source_name", "batch"]]
    t = cell_type.rename(columns={"cell_name": "source_name", "cluster": "cell_type"})[["source_name", "cell_type"]]
    cells = b.merge(t, on="source_name", how="outer", indicator=True)
    lone = cells[cells["_merge"] != "both"]
    if len(lone):
        side = "batch.rda" if lone["_merge"].iloc[0] == "left_only" else "cell_type.rda"
        raise ValueError(f"cell {lone['source_name'].iloc[0]!r} is only in {side}")
    return cells.drop(columns="_merge")


def write_folder(contacts: pd.DataFrame, cells: pd.DataFrame, out: Path, seed: int = 2019) -> pd.DataFrame:
    """Write the folder (cells.tsv, pairs/, chrom.sizes, source_names.tsv) atomically;
    the sheet written, with ``source_name``."""
    unknown = sorted(set(contacts["cell"]) - set(cells["source_name"]))
    if unknown:
        raise ValueError(f"hic_df.rda: cell {unknown[0]!r} has no batch or type")
    order = np.random.default_rng(seed).permutation(len(cells))
    sheet = cells.iloc[order].reset_index(drop=True)
    sheet.insert(0, "cell_id", [f"lee2019_{k:03d}" for k in range(len(sheet))])
    sheet.insert(1, "pairs", [f"pairs/{c}.pairs.gz" for c in sheet["cell_id"]])
    by_cell = dict(tuple(contacts.groupby("cell", sort=False)))
    with atomic_path(out) as tmp:
        (tmp / "pairs").mkdir(parents=True)
        for row in sheet.itertuples():
            mine = by_cell.get(row.source_name, contacts.iloc[:0])
            mine = mine.sort_values(["binA", "binB"])
            n = mine["count"].to_numpy()
            pos1 = np.repeat(midpoint(mine["binA"].to_numpy()), n)
            pos2 = np.repeat(midpoint(mine["binB"].to_numpy()), n)
            table = pd.DataFrame({"readID": ".", "chr1": CHROM, "pos1": pos1, "chr2": CHROM, "pos2": pos2, "strand1": "+", "strand2": "+"})
            write_pairs(tmp / row.pairs, table, {CHROM: CHROM_SIZE}, "hg19", PAIRS_COLUMNS)
        sheet[["cell_id", "pairs", "cell_type", "batch"]].to_csv(tmp / "cells.tsv", sep="\t", index=False)
        sheet[["cell_id", "source_name"]].to_csv(tmp / "source_names.tsv", sep="\t", index=False)
        (tmp / "chrom.sizes").write_text(f"{CHROM}\t{CHROM_SIZE}\n")
    return sheet


def read_rda(path: Path) -> pd.DataFrame:
    try:
        import pyreadr
    except ImportError:
        sys.exit("lee2019_from_bandnorm: reading .rda needs pyreadr (pip install pyreadr)")
    if not path.is_file():
        sys.exit(f"lee2019_from_bandnorm: {path} not found (the data/ folder of sshen82/BandNorm)")
    tables = pyreadr.read_r(str(path))
    if len(tables) != 1:
        sys.exit(f"lee2019_from_bandnorm: {path} holds {list(tables)}, expected one table")
    return next(iter(tables.values()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rda_dir", type=Path, help="folder of hic_df.rda, batch.rda and cell_type.rda")
    ap.add_argument("out", type=Path, help="the folder to write (e.g. .../schic/lee2019_pfc_chr1)")
    ap.add_argument("--seed", type=int, default=2019, help="seed of the cell ids' order")
    a = ap.parse_args(argv)
    try:
        contacts = check_contacts(read_rda(a.rda_dir / "hic_df.rda"), str(a.rda_dir / "hic_df.rda"))
        cells = cell_labels(read_rda(a.rda_dir / "batch.rda"), read_rda(a.rda_dir / "cell_type.rda"))
        sheet = write_folder(contacts, cells, a.out, a.seed)
    except ValueError as e:
        sys.exit(f"lee2019_from_bandnorm: {e}")
    print(f"{len(sheet)} cells, {int(contacts['count'].sum()):,} contacts -> {a.out}")
    print(pd.crosstab(sheet["batch"], sheet["cell_type"]).to_string())
    return 0


if __name__ == "__main__":
    sys.exit(main())
