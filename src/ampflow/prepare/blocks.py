"""Blocks of cells: how a sheet is cut into binning jobs, and how their per-block
.scool files and contact tables are gathered into the dataset's.

A block is a run of consecutive sheet rows, ``block_cells`` long (the last may be
shorter). New cells appended to a sheet change only its last block (or add blocks),
so only those are binned again.
"""

from __future__ import annotations

import hashlib
import logging

import numpy as np
import pandas as pd

from ..base.atomic import atomic_path
from ..base.errors import InputError
from ..base.progress import Progress

log = logging.getLogger(__name__)


def block_names(n_cells: int, block_cells: int) -> list[str]:
    """``0000``, ``0001``, ... one per block of ``block_cells`` sheet rows."""
    if block_cells < 1:
        raise InputError("must be >= 1", key="prepare.block_cells", value=block_cells)
    return [f"{i:04d}" for i in range(-(-n_cells // block_cells))]


def block_rows(block: str, block_cells: int) -> slice:
    """The sheet rows (0-based, header excluded) of a block."""
    i = int(block)
    return slice(i * block_cells, (i + 1) * block_cells)


def block_digest(cells, pairs) -> str:
    """Digest of a block's (cell_id, pairs) rows: the workflow passes it as a parameter,
    so that Snakemake re-runs a block when its rows change, and the job checks it
    against the sheet it reads."""
    h = hashlib.sha256()
    for c, p in zip(cells, pairs):
        h.update(f"{c}\t{p}\n".encode())
    return h.hexdigest()[:16]


def gather_scool(blocks: list[str], out) -> int:
    """Copy every cell of the block .scool files into one .scool, atomically.

    The cells' pixel and index datasets are copied as stored (HDF5 copies the
    compressed chunks); each cell hard-links the root bins and chroms, as cooler's own
    ``create_scool`` does. Every block must have the same bins. Returns the cell count.
    """
    import h5py

    n = 0
    total = 0
    for path in blocks:
        with h5py.File(path, "r") as f:
            total += len(f["cells"])
    progress = Progress(total, "cells", log, verb="gathered")
    with atomic_path(out) as tmp, h5py.File(tmp, "w") as dst:
        for path in blocks:
            with h5py.File(path, "r") as src:
                if n == 0:
                    for name in ("chroms", "bins"):
                        src.copy(src[name], dst, name)
                    dst.attrs.update(src.attrs)
                    dst.create_group("cells")
                else:
                    _check_same_bins(src, dst, path)
                for cell, grp in src["cells"].items():
                    if cell in dst["cells"]:
                        raise InputError("cell in two blocks", path=path, key="cell_id", value=cell)
                    g = dst["cells"].create_group(cell)
                    g.attrs.update(grp.attrs)
                    for name in ("pixels", "indexes"):
                        src.copy(grp[name], g, name)
                    g["chroms"] = dst["chroms"]
                    g["bins"] = dst["bins"]
                    n += 1
                    progress.update()
        dst.attrs["ncells"] = n
    return n


def _check_same_bins(src, dst, path) -> None:
    for table, col in (("chroms", "name"), ("chroms", "length"), ("bins", "start")):
        a, b = src[table][col][:], dst[table][col][:]
        if a.shape != b.shape or not np.array_equal(a, b):
            raise InputError(f"its bins differ from the first block's ({table}/{col})", path=path)


def gather_stats(blocks: list[str], out) -> pd.DataFrame:
    """Concatenate the blocks' contact tables, in block order, atomically."""
    table = pd.concat([pd.read_csv(p, sep="\t", index_col="cell_id", dtype={"cell_id": str}) for p in blocks])
    with atomic_path(out) as tmp:
        table.to_csv(tmp, sep="\t")
    return table
