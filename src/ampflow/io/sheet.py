"""The cell sheet: one row per cell with ``cell_id``, ``pairs`` and optional metadata."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from .errors import InputError, require_file

REQUIRED = ("cell_id", "pairs")
CELL_ID = re.compile(r"^[A-Za-z0-9_.\-:+]+$")


def read_sheet(path, check_files: bool = True) -> pd.DataFrame:
    """Read and validate a TSV (or CSV) cell sheet.

    Relative ``pairs`` paths are taken relative to the working directory (where
    Snakemake runs), like every other path in the config.

    Raises
    ------
    InputError
        Missing columns, empty sheet, duplicate or malformed ``cell_id`` (with its
        line), or a ``pairs`` file that does not exist (with its line).
    """
    path = require_file(path, "cell sheet")
    sep = "," if str(path).endswith(".csv") else "\t"
    df = pd.read_csv(path, sep=sep, dtype=str, comment=None, keep_default_na=False)
    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        raise InputError(f"missing required column(s) {missing}", path=path, line=1, value=list(df.columns))
    if df.empty:
        raise InputError("the cell sheet lists no cells", path=path)
    for i, cid in enumerate(df["cell_id"]):
        if not CELL_ID.match(cid):
            raise InputError(
                "cell_id must be non-empty and use only letters, digits and _ . - : +",
                path=path,
                line=i + 2,
                key="cell_id",
                value=cid,
            )
    dup = df["cell_id"].duplicated(keep="first")
    if dup.any():
        i = int(dup.to_numpy().nonzero()[0][0])
        first = int((df["cell_id"] == df["cell_id"].iloc[i]).to_numpy().nonzero()[0][0])
        raise InputError(
            f"duplicate cell_id (first seen on line {first + 2})",
            path=path,
            line=i + 2,
            key="cell_id",
            value=df["cell_id"].iloc[i],
        )
    if check_files:
        for i, p in enumerate(df["pairs"]):
            if not p or not Path(p).is_file():
                raise InputError("pairs file does not exist", path=path, line=i + 2, key="pairs", value=p)
    return df.set_index("cell_id", drop=False)
