"""Bin contacts into upper-triangle pixel tables and write (single-cell) coolers."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..base.jit import LazyJit
from ..io.genome import bin_offsets, make_bins
from ..io.pairs import Contacts


def _pixel_keys(chrom1, pos1, chrom2, pos2, offsets, resolution, n):
    """lo * n + hi for every contact, lo <= hi being the two global bin ids."""
    out = np.empty(len(pos1), np.int64)
    for i in range(len(pos1)):
        a = offsets[chrom1[i]] + max(pos1[i] - 1, 0) // resolution
        b = offsets[chrom2[i]] + max(pos2[i] - 1, 0) // resolution
        out[i] = a * n + b if a <= b else b * n + a
    return out


PIXEL_KEYS = LazyJit(_pixel_keys)
COMPILE_ABOVE = 2_000_000  # contacts; below, numpy is quicker than loading the loop


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
    n = int(offsets[-1])
    compiled = PIXEL_KEYS.get() if PIXEL_KEYS.loaded or len(contacts) >= COMPILE_ABOVE else None
    if compiled is not None:
        keys = compiled(contacts.chrom1, contacts.pos1, contacts.chrom2, contacts.pos2, offsets, resolution, n)
    else:
        b1 = offsets[contacts.chrom1] + np.maximum(contacts.pos1 - 1, 0) // resolution
        b2 = offsets[contacts.chrom2] + np.maximum(contacts.pos2 - 1, 0) // resolution
        keys = np.minimum(b1, b2) * n + np.maximum(b1, b2)
    keys, counts = np.unique(keys, return_counts=True)
    return pd.DataFrame({"bin1_id": keys // n, "bin2_id": keys % n, "count": counts.astype(np.int64)})


def write_cool(path, chromsizes: dict[str, int], resolution: int, pixels: pd.DataFrame, metadata=None) -> None:
    """Write one cooler (caller handles atomicity)."""
    import cooler

    bins = make_bins(chromsizes, resolution)
    cooler.create_cooler(str(path), bins, pixels, ordered=True, symmetric_upper=True, metadata=metadata or {}, dtypes={"count": np.int64})
