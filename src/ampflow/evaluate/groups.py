"""Which cells are scored together: held-out and training cells apart, or all cells as one.

When training holds cells out, ``obs["split"]`` of ``embeddings.h5ad`` (and of the
data folder's ``rna.h5ad`` / ``hic.h5ad``) says ``"train"`` or ``"heldout"`` per cell.
Scores on training cells say how well the model fits what it saw; scores on held-out
cells say how well it generalises, so the two are reported apart and the held-out
ones are the headline. Without the column every cell is in one group, ``"all"``.
"""

from __future__ import annotations

import anndata as ad
import numpy as np
import pandas as pd

from ..base.errors import InputError
from ..contract.layout import HELDOUT, SPLIT_COLUMN, TRAIN

#: ``obs`` column naming each cell's part of the split (the data folder's contract).
SPLIT_KEY = SPLIT_COLUMN

#: The values of :data:`SPLIT_KEY`, in the order groups are reported.
SPLIT_VALUES = (HELDOUT, TRAIN)

#: The one group when there is no split.
ALL = "all"


def split_labels(obs: pd.DataFrame, path=None) -> pd.Series | None:
    """The split column as strings, or None when ``obs`` has none.

    Parameters
    ----------
    obs
        A cells table.
    path
        The file ``obs`` came from, named in errors.

    Returns
    -------
    pandas.Series or None
        ``"train"`` or ``"heldout"`` per cell, indexed like ``obs``.

    Raises
    ------
    InputError
        If a value is missing or not one of :data:`SPLIT_VALUES`.
    """
    if SPLIT_KEY not in obs.columns:
        return None
    col = obs[SPLIT_KEY]
    text = pd.Series([None if pd.isna(v) else str(v) for v in col], index=obs.index, dtype=object)
    bad = ~text.isin(SPLIT_VALUES)
    if bad.any():
        first = text.index[np.argmax(bad.to_numpy())]
        raise InputError(
            f"{int(bad.sum())} cells have a split other than {' or '.join(SPLIT_VALUES)}",
            path=path,
            key=f"obs/{SPLIT_KEY}",
            value=f"{first}: {text[first]}",
        )
    return text


def cell_groups(adata: ad.AnnData, path=None) -> dict[str, np.ndarray]:
    """Row indices of each group of cells to score, in report order.

    Parameters
    ----------
    adata
        Embeddings (or any AnnData) with an optional ``obs["split"]``.
    path
        The file ``adata`` came from, named in errors.

    Returns
    -------
    dict
        ``{"heldout": rows, "train": rows}`` when the split exists (a part with no
        cells is left out), else ``{"all": rows}``; rows are sorted int arrays.
    """
    split = split_labels(adata.obs, path)
    if split is None:
        return {ALL: np.arange(adata.n_obs)}
    values = split.to_numpy()
    return {g: np.flatnonzero(values == g) for g in SPLIT_VALUES if (values == g).any()}


def headline_group(groups) -> str:
    """The group whose joint scores are the top-level ``ari``, ``nmi`` and ``foscttm``:
    held-out cells when there are any, else ``"all"`` (or training cells, for a split
    that held nothing out)."""
    for g in (HELDOUT, ALL, TRAIN):
        if g in groups:
            return g
    raise ValueError("no group of cells to score")


def fit_mask(cells: pd.Index, split: pd.Series | None, data_split: pd.Series | None, path=None) -> np.ndarray:
    """Which cells of a data file a baseline may learn from: training cells only.

    Parameters
    ----------
    cells
        The data file's cell ids.
    split
        The embeddings' split (``"train"`` / ``"heldout"`` per embedded cell), or None.
    data_split
        The data file's own split column, or None; where both exist they must agree.
    path
        The data file, named in errors.

    Returns
    -------
    numpy.ndarray
        Boolean, one per cell of ``cells``: True for training cells, all True when
        neither file has a split. A cell missing from the embeddings counts as not
        training, so that nothing the model did not train on steers a baseline.

    Raises
    ------
    InputError
        If the two splits disagree on a cell.
    """
    if split is None and data_split is None:
        return np.ones(len(cells), dtype=bool)
    if split is not None and data_split is not None:
        shared = split.index.intersection(data_split.index)
        differ = split[shared] != data_split[shared]
        if differ.any():
            cell = shared[np.argmax(differ.to_numpy())]
            raise InputError(
                f"{int(differ.sum())} cells have a different split here than in the embeddings",
                path=path,
                key=f"obs/{SPLIT_KEY}",
                value=f"{cell}: {data_split[cell]} here, {split[cell]} in the embeddings",
            )
    ref = split if split is not None else data_split
    return (ref.reindex(cells) == TRAIN).to_numpy()
