"""The cell sheet: one row per cell with ``cell_id``, ``pairs`` and optional metadata."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pandas as pd

from ..base.errors import InputError, require_file
from .textfile import open_text

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
    header, rows, linenos = _read_rows(path, sep)
    if not rows:
        raise InputError("the cell sheet lists no cells", path=path)
    df = pd.DataFrame(rows, columns=header, dtype=str)
    lines = linenos[1:]
    for i, cid in enumerate(df["cell_id"]):
        if not CELL_ID.match(cid):
            raise InputError(
                "cell_id must be non-empty and use only letters, digits and _ . - : +",
                path=path,
                line=lines[i],
                key="cell_id",
                value=cid,
            )
    dup = df["cell_id"].duplicated(keep="first")
    if dup.any():
        i = int(dup.to_numpy().nonzero()[0][0])
        first = int((df["cell_id"] == df["cell_id"].iloc[i]).to_numpy().nonzero()[0][0])
        raise InputError(
            f"duplicate cell_id (first seen on line {lines[first]})",
            path=path,
            line=lines[i],
            key="cell_id",
            value=df["cell_id"].iloc[i],
        )
    if check_files:
        for i, p in enumerate(df["pairs"]):
            if not p or not Path(p).exists():
                raise InputError("pairs file does not exist", path=path, line=lines[i], key="pairs", value=p)
            if not Path(p).is_file():
                raise InputError("pairs path is not a file", path=path, line=lines[i], key="pairs", value=p)
    return df.set_index("cell_id", drop=False)


def _read_rows(path, sep: str) -> tuple[list[str], list[list[str]], list[int]]:
    """Header, rows and each one's 1-based line number; blank lines are skipped.

    Every row must have as many fields as the header (pandas would silently turn an
    extra field into the index and shift the columns).
    """
    header: list[str] | None = None
    rows: list[list[str]] = []
    linenos: list[int] = []
    with open_text(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            fields = next(csv.reader([line.rstrip("\n\r")], delimiter=sep))
            if header is None:
                header = [f.strip() for f in fields]
                missing = [c for c in REQUIRED if c not in header]
                if missing:
                    raise InputError(f"missing required column(s) {missing}", path=path, line=lineno, value=header)
            elif len(fields) != len(header):
                raise InputError(
                    f"{len(fields)} fields, the header has {len(header)}",
                    path=path,
                    line=lineno,
                    value=line.rstrip("\n\r"),
                )
            else:
                rows.append(fields)
            linenos.append(lineno)
    if header is None:
        raise InputError("the cell sheet is empty (expected a header line with cell_id and pairs)", path=path)
    return header, rows, linenos
