"""The held-out split's file, ``qc/split.tsv``: ``cell_id<TAB>split`` with a header, split in
``train`` / ``heldout`` (drawn by :func:`ampflow.prepare.split.split_cells`).

:func:`write_split` / :func:`read_split` keep it, and :func:`split_of` lines it up with the
cells of a data file. The prepare steps that fit something on the cells and the trainer
read it through here.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..base.atomic import atomic_path
from ..base.errors import InputError
from ..contract.layout import SPLIT_COLUMN, SPLIT_VALUES


def write_split(path, split: pd.Series) -> None:
    """Write ``split`` as ``cell_id<TAB>split`` lines with a header, atomically."""
    with atomic_path(path) as tmp:
        split.rename(SPLIT_COLUMN).rename_axis("cell_id").to_frame().to_csv(tmp, sep="\t")


def read_split(path) -> pd.Series:
    """The split written by :func:`write_split`: ``split`` per ``cell_id``.

    Raises InputError for a missing column, a duplicate cell id or a value other than
    ``train`` / ``heldout`` (with its line).
    """
    df = pd.read_csv(path, sep="\t", dtype=str, keep_default_na=False)
    for col in ("cell_id", SPLIT_COLUMN):
        if col not in df.columns:
            raise InputError(f"missing column {col!r} (columns: {', '.join(df.columns)})", path=path, line=1)
    bad = ~df[SPLIT_COLUMN].isin(SPLIT_VALUES)
    if bad.any():
        i = int(np.argmax(bad.to_numpy()))
        raise InputError(f"split must be one of {', '.join(SPLIT_VALUES)}", path=path, line=i + 2, value=df[SPLIT_COLUMN].iloc[i])
    dup = df["cell_id"].duplicated()
    if dup.any():
        i = int(np.argmax(dup.to_numpy()))
        raise InputError("cell id listed twice", path=path, line=i + 2, value=df["cell_id"].iloc[i])
    return pd.Series(df[SPLIT_COLUMN].to_numpy(), index=pd.Index(df["cell_id"], name="cell_id"), name=SPLIT_COLUMN)


def split_of(cells: list[str], split: pd.Series, path=None) -> np.ndarray:
    """``split`` of each of ``cells`` (the rows of a data file), in their order.

    Raises InputError when the split does not list exactly these cells (it was drawn
    from another QC table).
    """
    missing = [c for c in cells if c not in split.index]
    extra = sorted(set(split.index) - set(cells))
    if missing or extra:
        raise InputError(
            f"the split lists other cells than the passing cells of the QC table ({len(missing)} missing, {len(extra)} extra); draw it again from this table",
            path=path,
            value=(missing or extra)[:5],
        )
    return split.loc[cells].to_numpy().astype(str)
