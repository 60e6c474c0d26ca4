"""Parquet tables (the graph's ``nodes.parquet`` / ``edges.parquet``): a damaged file is an
InputError naming it; required columns are checked for presence and kind.

Parquet checksums only the footer's framing, not every page (pages written without
CRC decode whatever bytes they hold), so float columns are also checked to be finite.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..base.errors import InputError, require_file

KINDS = {"int": "iu", "float": "f", "number": "iuf", "string": "OSU"}


def _arrow_errors() -> tuple[type[BaseException], ...]:
    import pyarrow as pa

    # ArrowException covers ArrowInvalid (a ValueError), ArrowIOError (an OSError) and
    # the wrapped codec errors; OSError: a corrupt compressed page ("Corrupt snappy ...");
    # ValueError/KeyError/TypeError: pandas metadata in the schema that no longer decodes
    return (pa.ArrowException, OSError, ValueError, KeyError, TypeError)


def read_parquet_table(path, columns: dict[str, str], what: str = "table") -> pd.DataFrame:
    """Read a parquet file; ``columns`` maps each required column to ``int``, ``float``,
    ``number`` (either) or ``string``.

    Raises
    ------
    InputError
        Missing or damaged file, a missing column, a column of another kind, or a float
        that is not finite; naming the file, the column and the value.
    """
    import pyarrow.parquet as pq

    path = require_file(path, what)
    try:
        df = pq.read_table(path).to_pandas()
    except _arrow_errors() as e:
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InputError(
            f"cannot be read as parquet (damaged?): {type(e).__name__}: {detail}",
            path=path,
        ) from None
    if len(df) == 0:
        raise InputError(f"{what} has no rows", path=path)
    for col, kind in columns.items():
        if col not in df.columns:
            raise InputError(
                f"{what} lacks column {col!r}",
                path=path,
                key=col,
                value=list(df.columns),
            )
        values = df[col].to_numpy()
        if values.dtype.kind not in KINDS[kind]:
            raise InputError(f"column is {values.dtype}, expected {kind}", path=path, key=col)
        if values.dtype.kind == "f":
            bad = ~np.isfinite(values)
            if bad.any():
                k = int(np.flatnonzero(bad)[0])
                raise InputError(
                    f"row {k}: not a finite number",
                    path=path,
                    key=col,
                    value=values[k].item(),
                )
        if kind == "string" and pd.isna(df[col]).any():
            k = int(np.flatnonzero(pd.isna(df[col]).to_numpy())[0])
            raise InputError(f"row {k}: missing value", path=path, key=col)
    return df
