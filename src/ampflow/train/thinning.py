"""Binomial thinning of the Hi-C counts a training step reads (``train.hic_keep_min``).

Each training step reads each of its cells as if sequenced less deeply: the cell keeps
each of its contacts with a probability p, drawn per cell and step uniformly from
``[keep_min, 1]``, so a feature's count n becomes a Binomial(n, p) draw. A cell is then
never seen twice with the same counts, and the encoder cannot place a training cell by
its own exact contacts, which cells of a new batch (sequenced to another depth) do not
share. The decoder reconstructs the thinned counts: a thinned cell is a shallower
sample of the same cell, and the decoder's means scale with the cell's own contacts per
stratum.

The draws of a cell depend only on (seed, step, cell row), never on which other cells
share its batch or its process: each data-parallel rank thins its own rows exactly as
one process thins the whole batch, and a resumed run repeats the uninterrupted one's
draws (the step count is in the checkpoint). Validation, the encoder input's fit
(:meth:`~ampflow.model.encoders.HiCInput.fit`) and the embeddings read the counts as
they are.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from ..base.errors import InputError

#: Entropy word that keeps these draws apart from every other stream seeded from train.seed.
THINNING_STREAM = 0x7448494E  # "tHIN"


def check_integer_counts(hic: sp.csr_matrix, cell_ids, path=None) -> None:
    """Thinning draws Binomial(n, p): every count must be a whole number >= 0; else an
    error naming the first such cell and its value."""
    data = hic.data
    bad = np.flatnonzero((data < 0) | (data != np.floor(data)))
    if len(bad):
        row = int(np.searchsorted(hic.indptr, bad[0], side="right") - 1)
        raise InputError(
            f"thinning (< 1) draws Binomial(n, p) of each Hi-C count n, which must be a whole number >= 0: cell {cell_ids[row]!r} "
            f"has one that is not ({len(bad)} such count(s) over {hic.shape[0]} cells)",
            path=path, key="train.hic_keep_min", value=float(data[bad[0]]),
        )  # fmt: skip


def thin_rows(rows: sp.csr_matrix, cells: np.ndarray, keep_min: float, seed: int, step: int) -> sp.csr_matrix:
    """``rows`` (len(cells), F) integer counts thinned: row i kept with a probability drawn
    uniformly from [keep_min, 1] by cell ``cells[i]``'s own generator for ``step``
    (``keep_min`` 1: the rows, unchanged)."""
    if keep_min >= 1.0:
        return rows
    out = sp.csr_matrix(rows, copy=True)
    for i, cell in enumerate(np.asarray(cells)):
        rng = np.random.default_rng([THINNING_STREAM, int(seed), int(step), int(cell)])
        p = rng.uniform(keep_min, 1.0)
        row = out.data[out.indptr[i] : out.indptr[i + 1]]  # a view: written in place
        # most single-cell counts are 1, where Binomial(1, p) is a uniform draw below p:
        # cheaper than numpy's binomial sampler (a row of mostly ones thins about twice
        # as fast)
        one = row == 1
        row[one] = rng.random(int(one.sum())) < p
        many = ~one & (row > 0)
        row[many] = rng.binomial(row[many].astype(np.int64), p)
    out.eliminate_zeros()
    return out
