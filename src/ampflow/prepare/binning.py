"""Bin contacts into upper-triangle pixel tables and write (single-cell) coolers."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..io.genome import bin_offsets, make_bins
from ..io.pairs import Contacts


def bin_contacts(contacts: Contacts, chromsizes: dict[str, int], resolution: int) -> pd.DataFrame:
    """Count contacts per bin pair.

    Positions are 1-based (4DN spec, as ``cooler cload pairs`` assumes by default), so
    position p falls in bin ``(p - 1) // resolution`` of its chromosome. Pixels are
    upper triangle in global bin ids (bin1_id <= bin2_id), cis and trans, raw counts,
    sorted by (bin1_id, bin2_id).

    Returns
    -------
    DataFrame with int64 columns ``bin1_id, bin2_id, count``.
    """
    offsets = bin_offsets(chromsizes, resolution)
    b1 = offsets[contacts.chrom1] + np.maximum(contacts.pos1 - 1, 0) // resolution
    b2 = offsets[contacts.chrom2] + np.maximum(contacts.pos2 - 1, 0) // resolution
    lo = np.minimum(b1, b2)
    hi = np.maximum(b1, b2)
    n = int(offsets[-1])
    keys, counts = np.unique(lo * n + hi, return_counts=True)
    return pd.DataFrame({"bin1_id": keys // n, "bin2_id": keys % n, "count": counts.astype(np.int64)})


def write_cool(path, chromsizes: dict[str, int], resolution: int, pixels: pd.DataFrame, metadata=None) -> None:
    """Write one cooler (caller handles atomicity)."""
    import cooler

    bins = make_bins(chromsizes, resolution)
    cooler.create_cooler(
        str(path), bins, pixels, ordered=True, symmetric_upper=True, metadata=metadata or {}, dtypes={"count": np.int64}
    )
