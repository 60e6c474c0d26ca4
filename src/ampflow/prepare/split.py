"""Held-out cells: which QC-passing cells nothing is fitted on, so scores can be taken on them.

:func:`split_cells` assigns each cell from its own id and the seed (:func:`heldout_draw`),
so new or removed cells move no other cell and a cell held out once stays held out;
:mod:`ampflow.io.split` keeps the split as ``qc/split.tsv`` and lines it up with the cells
of a data file. The prepare steps that fit something on the cells (the HVG choice, the
strata feature filter) and the trainer use the training cells only.
"""

from __future__ import annotations

import hashlib
import logging
import math

import pandas as pd

from ..base.errors import InputError
from ..contract.config import EvaluateConfig
from ..contract.layout import HELDOUT, SPLIT_COLUMN, TRAIN
from .qc import passing_cells

log = logging.getLogger(__name__)

#: Bits of the hash kept: as many as a float64 holds exactly, so the draw is k / 2**53.
_DRAW_BITS = 53


def heldout_draw(cell_id: str, seed: int) -> float:
    """The cell's draw in [0, 1): BLAKE2b of ``"{seed}:{cell_id}"`` (UTF-8), its first
    53 bits over 2**53. A cell is held out when its draw is below ``evaluate.holdout``.

    The same id and seed give the same draw on every machine and Python (unlike ``hash()``,
    which is salted per process); the seed is digits only, so the first ``:`` separates it
    from the id.
    """
    digest = hashlib.blake2b(f"{seed}:{cell_id}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> (64 - _DRAW_BITS)) / 2.0**_DRAW_BITS


def binomial_tolerance(n: int, fraction: float, sds: float = 3.0) -> float:
    """How far the held-out share of a label of ``n`` cells may stray from ``fraction``
    and still be what :func:`split_cells` gives: ``sds`` binomial standard deviations,
    ``sds * sqrt(fraction * (1 - fraction) / n)`` (3: all but about 0.3% of labels)."""
    return sds * math.sqrt(fraction * (1 - fraction) / n)


def split_cells(qc: pd.DataFrame, fraction: float, seed: int = 0, label_key: str | None = None, path=None) -> pd.Series:
    """Assign every QC-passing cell of ``qc`` to ``train`` or ``heldout``.

    A cell is held out when its own draw (:func:`heldout_draw`, a hash of its id and
    ``seed``) is below ``fraction``. The draw depends on nothing else: not on the other
    cells in the table, their order or their labels. Adding cells (to old labels or new
    ones) or removing cells therefore moves no other cell between ``train`` and
    ``heldout``, apart from the guard below, so scores before and after new data are
    taken on the same held-out cells, and a held-out cell is not trained on later.

    Each label's held-out count is binomial, ``Binomial(n, fraction)`` for a label of
    ``n`` cells (less one where the guard acts), not ``fraction * n`` exactly: its share
    lies within ``3 * sqrt(fraction * (1 - fraction) / n)`` of ``fraction`` for all but
    about 0.3% of labels (:func:`binomial_tolerance`; at 0.2, +-0.18 for 45 cells, +-0.085
    for 200, +-0.027 for 2,000).

    The guard, the one place where other cells matter: a label whose cells all draw below
    ``fraction`` keeps the one with the highest draw (ties: the larger id) in training, so
    that every label has a training cell. At 0.2 a label of ``n`` cells is such a label
    with probability 0.2**n (a label of one cell: 0.2; of five: 0.0003), and the guard
    then moves that one cell. It can move a cell that was there before only where it is
    in force before or after the change:

    - cells added to a label it held up send the kept cell to ``heldout`` if one of them
      draws ``train`` or draws higher: a cell trained on before is then held out;
    - removing a label's training cells can leave one whose cells all drew held out: its
      highest draw then moves from ``heldout`` to ``train``.

    A ``qc/split.tsv`` written by an earlier version (one seeded draw of
    ``round(fraction * n)`` cells per label) stays as it is until the rule runs again.
    Snakemake re-runs ``split_cells`` when ``qc/cells.tsv`` is remade (new cells, other QC
    thresholds) or an ``evaluate`` value changes, not when only ampflow is upgraded; the
    file is then drawn this way, which moves earlier cells that one time.
    ``--forcerun split_cells`` switches a results folder over at once.

    Parameters
    ----------
    qc
        The QC table (index ``cell_id``, a ``pass`` column, the sheet's metadata).
    fraction
        Expected share of the cells held out, in [0, 1); 0 holds out none.
    seed
        Seed of the draws: the same cell and seed give the same draw, whatever the table.
    label_key
        Column whose labels each keep a training cell (the guard). The draws do not read
        it: a relabelled cell keeps its draw. None: the guard keeps one training cell of
        all the passing cells.
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
    index = pd.Index(cells, name="cell_id")
    if label_key is None:
        labels = pd.Series("", index=index)
    else:
        labels = qc.loc[cells, label_key].fillna("").astype(str)
    draws = pd.Series([heldout_draw(c, seed) for c in cells], index=index)
    held = draws < fraction
    for label, members in held.groupby(labels.to_numpy(), sort=True):
        if members.all():
            # a new cell of this label moves the kept one only by drawing higher:
            # the highest draw makes that least likely
            kept = max(members.index, key=lambda c: (draws[c], c))
            held[kept] = False
            log.info("split: all %d cell(s) of label %r drew held-out; %s kept for training", len(members), label, kept)
    split = pd.Series([HELDOUT if h else TRAIN for h in held], index=index, name=SPLIT_COLUMN)
    n_train = int((split == TRAIN).sum())
    if n_train < 2:
        raise InputError(f"{n_train} training cell(s) left of {len(cells)}; training needs at least two", path=path, key="evaluate.holdout", value=fraction)
    how = f"a draw per cell, a training cell kept in each of {labels.nunique()} {label_key!r} label(s)" if label_key is not None else "a draw per cell"
    log.info("split: %d training, %d held-out of %d passing cells (%s, seed %d)", n_train, len(cells) - n_train, len(cells), how, seed)
    return split
