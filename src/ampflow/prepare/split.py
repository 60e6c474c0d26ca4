"""Held-out cells: which QC-passing cells nothing is fitted on, so scores can be taken on them.

:func:`split_cells` draws the split from the QC table (stratified by a label column when
there is one); :mod:`ampflow.io.split` keeps it as ``qc/split.tsv`` and lines it up with the
cells of a data file. The prepare steps that fit something on the cells (the HVG
choice, the strata feature filter) and the trainer use the training cells only.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pandas as pd

from ..base.errors import InputError
from ..contract.config import EvaluateConfig
from ..contract.layout import HELDOUT, SPLIT_COLUMN, TRAIN
from .qc import passing_cells

log = logging.getLogger(__name__)


def heldout_count(n: int, fraction: float) -> int:
    """Held-out cells of a group of ``n``: ``fraction * n`` rounded half up, at most
    ``n - 1`` so that every group keeps a training cell (a group of one stays whole)."""
    return max(0, min(math.floor(fraction * n + 0.5), n - 1))


def split_cells(qc: pd.DataFrame, fraction: float, seed: int = 0, label_key: str | None = None, path=None) -> pd.Series:
    """Assign every QC-passing cell of ``qc`` to ``train`` or ``heldout``.

    Parameters
    ----------
    qc
        The QC table (index ``cell_id``, a ``pass`` column, the sheet's metadata).
    fraction
        Share of the cells held out, in [0, 1); 0 holds out none.
    seed
        Seed of the draw: the same table and seed give the same split.
    label_key
        Column to stratify by: each label holds out ``round(fraction x its cells)``
        (see :func:`heldout_count`). None: one random draw over all passing cells.
    path
        The QC table's file, for messages.

    Returns
    -------
    Series
        ``split`` per passing cell (index ``cell_id``), in table order.

    Raises
    ------
    InputError
        ``fraction`` or ``seed`` out of range, ``label_key`` not a column of ``qc``, no
        passing cell, or fewer than two training cells left.
    """
    EvaluateConfig(holdout=fraction, seed=seed)  # validates both, naming the config keys
    if label_key is not None and label_key not in qc.columns:
        raise InputError(f"no such column in the QC table (columns: {', '.join(map(str, qc.columns))})", path=path, key="evaluate.label_key", value=label_key)
    cells = passing_cells(qc)
    if not cells:
        raise InputError("no cell passes QC; nothing to split", path=path)
    if label_key is None:
        labels = pd.Series("", index=pd.Index(cells, name="cell_id"))
    else:
        labels = qc.loc[cells, label_key].fillna("").astype(str)
    rng = np.random.default_rng(seed)
    heldout: set[str] = set()
    for label in sorted(set(labels)):
        # sorted ids: the draw does not depend on the sheet's row order
        members = sorted(labels.index[(labels == label).to_numpy()])
        k = heldout_count(len(members), fraction)
        heldout.update(members[i] for i in rng.choice(len(members), size=k, replace=False))
    split = pd.Series([HELDOUT if c in heldout else TRAIN for c in cells], index=pd.Index(cells, name="cell_id"), name=SPLIT_COLUMN)
    n_train = int((split == TRAIN).sum())
    if n_train < 2:
        raise InputError(f"{n_train} training cell(s) left of {len(cells)}; training needs at least two", path=path, key="evaluate.holdout", value=fraction)
    how = f"stratified by {label_key!r} over {labels.nunique()} label(s)" if label_key is not None else "random"
    log.info("split: %d training, %d held-out of %d passing cells (%s, seed %d)", n_train, len(heldout), len(cells), how, seed)
    return split
