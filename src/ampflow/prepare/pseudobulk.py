"""Pseudobulk .mcool from the given cells (HiGlass-viewable; feeds graph contact edges).

The workflow pools the training cells only: the graph is fitted, so held-out cells stay out.
"""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd

from ..io.atomic import atomic_path
from ..io.cool import cell_bins, cell_pixels
from ..io.errors import InputError
from ..io.genome import bin_offsets, make_bins
from ..progress import Progress

log = logging.getLogger(__name__)
BATCH = 200


def sum_cells(scool: str, cells: list[str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Bins and summed pixels of ``cells`` in a .scool."""
    bins, _ = cell_bins(scool, cells[0])
    acc = None
    batch = []
    progress = Progress(len(cells), "cells", log, verb="summed")

    def flush(acc, batch):
        frames = batch if acc is None else [acc, *batch]
        return pd.concat(frames, ignore_index=True).groupby(["bin1_id", "bin2_id"], sort=True)["count"].sum().reset_index()

    for cell in cells:
        batch.append(cell_pixels(scool, cell, len(bins)))
        progress.update()
        if len(batch) >= BATCH:
            acc, batch = flush(acc, batch), []
    if batch:
        acc = flush(acc, batch)
    acc["count"] = acc["count"].astype(np.int64)
    return bins, acc


def coarsen(bins: pd.DataFrame, pixels: pd.DataFrame, resolution: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Aggregate fixed-width ``bins``/``pixels`` to a coarser ``resolution`` (a multiple of theirs)."""
    chroms = list(dict.fromkeys(bins["chrom"].astype(str)))
    sizes = bins.assign(chrom=bins["chrom"].astype(str)).groupby("chrom", sort=False)["end"].max()
    new_bins = make_bins({c: int(sizes[c]) for c in chroms}, resolution)
    offsets = bin_offsets({c: int(sizes[c]) for c in chroms}, resolution)
    chrom_idx = pd.Categorical(bins["chrom"].astype(str), categories=chroms).codes
    old_to_new = offsets[chrom_idx] + bins["start"].to_numpy() // resolution
    b1 = old_to_new[pixels["bin1_id"].to_numpy()]
    b2 = old_to_new[pixels["bin2_id"].to_numpy()]
    agg = (
        pd.DataFrame({"bin1_id": np.minimum(b1, b2), "bin2_id": np.maximum(b1, b2), "count": pixels["count"].to_numpy()})
        .groupby(["bin1_id", "bin2_id"], sort=True)["count"]
        .sum()
        .reset_index()
    )
    return new_bins, agg


def write_mcool(path, scools: dict[int, str], cells: list[str], balance: bool = True, extra=()) -> dict:
    """Write ``path`` with one ``resolutions/{res}`` cooler per entry of ``scools``,
    plus coarser ``extra`` resolutions aggregated from the finest one (zoom levels).

    Balancing (ICE, cooler defaults) is attempted per resolution; sparse data may not
    converge, which is logged and recorded, not fatal.
    """
    import cooler

    base = min(scools)
    bad = [r for r in extra if r % base]
    if bad:
        raise InputError(f"extra pseudobulk resolutions must be multiples of the finest ({base})", key="pseudobulk.resolutions", value=bad)
    report = {}
    with atomic_path(path) as tmp:
        # read the cells once at the finest resolution; multiples of it are exact
        # aggregates ((p-1)//r == ((p-1)//b*b)//r), other resolutions are read too
        levels = {base: sum_cells(scools[base], cells)}
        for res in sorted(set(scools) | set(extra)):
            if res not in levels:
                levels[res] = coarsen(*levels[base], res) if res % base == 0 else sum_cells(scools[res], cells)
        for i, res in enumerate(sorted(levels)):
            bins, pixels = levels[res]
            uri = f"{tmp}::resolutions/{res}"
            cooler.create_cooler(uri, bins, pixels, ordered=True, mode="w" if i == 0 else "a", dtypes={"count": np.int64})
            entry = {"pixels": int(len(pixels)), "contacts": int(pixels["count"].sum()), "balanced": False}
            if balance:
                try:
                    _, stats = cooler.balance_cooler(cooler.Cooler(uri), store=True, cis_only=False)
                    entry["balanced"] = bool(stats.get("converged", False))
                except Exception as e:  # noqa: BLE001 - balancing is best effort by design
                    log.warning("balancing %s at %d bp failed: %s", path, res, e)
                    entry["balance_error"] = str(e)
            log.info("pseudobulk %d bp: %d contacts in %d pixels, balanced=%s", res, entry["contacts"], entry["pixels"], entry["balanced"])
            report[int(res)] = entry
    return report
