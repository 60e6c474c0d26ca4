"""Reading cells of a ``.scool`` (and single ``.cool`` / ``.mcool`` levels): a damaged file
is an InputError naming it, never an h5py traceback.

The ``try`` blocks hold only the h5py/cooler calls and catch the types HDF5 reports damage
with (:data:`~.h5ad.HDF5_ERRORS`). What does decode is checked too: HDF5 keeps no checksum
of uncompressed data, so a flipped byte in a bin id would otherwise index past the bin
table later on.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..base.errors import InputError, require_file
from .h5ad import HDF5_ERRORS
from .h5ad import damaged as _damaged


def scool_cells(path) -> list[str]:
    """Names of the cells in a ``.scool`` (without the ``/cells/`` prefix), in file order."""
    import cooler

    path = require_file(path, ".scool file")
    try:
        cells = cooler.fileops.list_scool_cells(str(path))
    except HDF5_ERRORS as e:
        raise _damaged(path, e) from None
    if not cells:
        raise InputError("no cells in the .scool file", path=path)
    return [c.rsplit("/", 1)[-1] for c in cells]


def _cooler(path, cell: str | None):
    import cooler

    uri = str(path) if cell is None else f"{path}::/cells/{cell}"
    try:
        return cooler.Cooler(uri)
    except HDF5_ERRORS as e:
        raise _damaged(path, e, "cannot open" if cell is None else f"cannot open cell {cell!r}") from None


def cell_bins(path, cell: str | None = None) -> tuple[pd.DataFrame, int]:
    """Bin table (``chrom, start, end``) and bin size of one cell (``cell=None``: of a
    ``.cool`` or a ``file.mcool::resolutions/N`` URI given as ``path``).

    Raises
    ------
    InputError
        A damaged file, a bin table with negative or empty bins, or no fixed bin size.
    """
    clr = _cooler(path, cell)
    try:
        bins = clr.bins()[["chrom", "start", "end"]][:]
        binsize = clr.binsize
    except HDF5_ERRORS as e:
        raise _damaged(path, e, "cannot read the bin table") from None
    starts, ends = bins["start"].to_numpy(), bins["end"].to_numpy()
    if len(bins) == 0 or (starts < 0).any() or (ends <= starts).any() or bins["chrom"].isna().any():
        raise InputError(
            "bin table is damaged (empty, negative or zero-length bins)",
            path=path,
            key=cell,
        )
    if not binsize or binsize <= 0:
        raise InputError("not a fixed-bin-size cooler", path=path, key=cell, value=binsize)
    return bins, int(binsize)


def cell_pixels(path, cell: str | None, n_bins: int) -> pd.DataFrame:
    """Pixels (``bin1_id, bin2_id, count``) of one cell, checked against ``n_bins``.

    Raises
    ------
    InputError
        A damaged file, a bin id outside ``[0, n_bins)`` or below the diagonal, or a
        count that is negative or not finite.
    """
    clr = _cooler(path, cell)
    try:
        px = clr.pixels()[:]
    except HDF5_ERRORS as e:
        raise _damaged(
            path,
            e,
            "cannot read pixels" if cell is None else f"cannot read pixels of cell {cell!r}",
        ) from None
    missing = [c for c in ("bin1_id", "bin2_id", "count") if c not in px.columns]
    if missing:
        raise InputError(f"pixel table lacks column(s) {missing}", path=path, key=cell)
    b1, b2 = px["bin1_id"].to_numpy(), px["bin2_id"].to_numpy()
    bad = (b1 < 0) | (b2 < b1) | (b2 >= n_bins)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise InputError(
            f"pixel {k}: bin ids outside the {n_bins}-bin table or below the diagonal",
            path=path, key=cell, value=(int(b1[k]), int(b2[k])),
        )  # fmt: skip
    counts = px["count"].to_numpy()
    bad = ~np.isfinite(counts) | (counts < 0)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise InputError(
            f"pixel {k}: count is negative or not finite",
            path=path,
            key=cell,
            value=counts[k].item(),
        )
    return px
