"""Pseudobulk .mcool from the passing cells (HiGlass-viewable; feeds graph contact edges)."""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd

from ..io.atomic import atomic_path
from ..progress import Progress

log = logging.getLogger(__name__)
BATCH = 200


def sum_cells(scool: str, cells: list[str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Bins and summed pixels of ``cells`` in a .scool."""
    import cooler

    bins = cooler.Cooler(f"{scool}::/cells/{cells[0]}").bins()[["chrom", "start", "end"]][:]
    acc = None
    batch = []
    progress = Progress(len(cells), "cells", log, verb="summed")

    def flush(acc, batch):
        frames = batch if acc is None else [acc, *batch]
        return pd.concat(frames, ignore_index=True).groupby(["bin1_id", "bin2_id"], sort=True)["count"].sum().reset_index()

    for cell in cells:
        batch.append(cooler.Cooler(f"{scool}::/cells/{cell}").pixels()[:])
        progress.update()
        if len(batch) >= BATCH:
            acc, batch = flush(acc, batch), []
    if batch:
        acc = flush(acc, batch)
    acc["count"] = acc["count"].astype(np.int64)
    return bins, acc


def write_mcool(path, scools: dict[int, str], cells: list[str], balance: bool = True) -> dict:
    """Write ``path`` with one ``resolutions/{res}`` cooler per entry of ``scools``.

    Balancing (ICE, cooler defaults) is attempted per resolution; sparse data may not
    converge, which is logged and recorded, not fatal.
    """
    import cooler

    report = {}
    with atomic_path(path) as tmp:
        for i, res in enumerate(sorted(scools)):
            bins, pixels = sum_cells(scools[res], cells)
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
