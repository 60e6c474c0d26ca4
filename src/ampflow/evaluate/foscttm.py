"""FOSCTTM: fraction of samples closer than the true match, between two paired embeddings.

Row *i* of the trainer's ``X_rna`` and row *i* of its ``X_hic`` come from the same
cell, so the true cross-modal match of every cell is known. FOSCTTM counts, for each
cell, the other cells of the other modality that lie closer than its own match: 0 is
perfect alignment, about 0.5 is no better than chance. The distance matrix is
computed in row blocks so memory stays bounded at any number of cells.
"""

from __future__ import annotations

import numpy as np

#: Budget for one block of the distance matrix, in float64 entries (128 MiB).
_BLOCK_ENTRIES = 1 << 24


def foscttm_directions(x, y, block_size: int | None = None) -> tuple[float, float]:
    """FOSCTTM in both directions between two paired embeddings.

    Parameters
    ----------
    x, y
        Arrays of shape ``(n, d)``; row *i* of ``x`` and row *i* of ``y`` are the
        same sample seen two ways.
    block_size
        Rows of the distance matrix held in memory at once. By default enough rows
        to fill about 128 MiB of distances, whatever the number of samples.

    Returns
    -------
    x_to_y, y_to_x
        ``x_to_y``: for each *i*, the fraction of *j != i* with
        ``d(x_i, y_j) < d(x_i, y_i)``, averaged over *i*; ``y_to_x`` the same with
        the roles swapped (``d(y_i, x_j) < d(y_i, x_i)``). Euclidean distances.

    Raises
    ------
    ValueError
        If the shapes differ, there are fewer than two samples, or a value is not finite.
    """
    from scipy.spatial.distance import cdist

    # float64 so that near-ties are decided as a direct computation would decide them
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.ndim != 2 or x.shape != y.shape:
        raise ValueError(f"x and y must be 2-D arrays of the same shape, got {x.shape} and {y.shape}")
    n = x.shape[0]
    if n < 2:
        raise ValueError(f"FOSCTTM needs at least 2 samples, got {n}")
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError("x and y must be finite (NaN or inf found)")
    if block_size is None:
        block_size = max(1, _BLOCK_ENTRIES // n)

    # d(x_i, y_i) for all i; needed up front because the y -> x direction compares
    # each column of D = d(x_., y_.) against its diagonal entry.
    true = np.sqrt(((x - y) ** 2).sum(axis=1))
    closer_x_to_y = np.zeros(n, dtype=np.int64)
    closer_y_to_x = np.zeros(n, dtype=np.int64)
    for start in range(0, n, block_size):
        stop = min(start + block_size, n)
        rows = np.arange(start, stop)
        d = cdist(x[start:stop], y, metric="euclidean")  # d[r, j] = d(x_{start+r}, y_j)
        # The true match is never counted against itself: exclude it explicitly
        # rather than relying on two computations of the same distance agreeing.
        d[rows - start, rows] = np.inf
        # x -> y: row i of D against d(x_i, y_i)
        closer_x_to_y[start:stop] = (d < true[start:stop, None]).sum(axis=1)
        # y -> x: d(y_i, x_j) is D[j, i], so column i against d(y_i, x_i)
        closer_y_to_x += (d < true[None, :]).sum(axis=0)
    # per-cell fractions first, then their mean, exactly as the definition reads
    x_to_y = float((closer_x_to_y / (n - 1)).mean())
    y_to_x = float((closer_y_to_x / (n - 1)).mean())
    return x_to_y, y_to_x


def foscttm(x, y, block_size: int | None = None) -> float:
    """Fraction of samples closer than the true match, averaged over both directions.

    Parameters
    ----------
    x, y
        Arrays of shape ``(n, d)`` with row *i* of each from the same sample.
    block_size
        Rows of the distance matrix held in memory at once (see
        :func:`foscttm_directions`).

    Returns
    -------
    float
        Mean of the two directions of :func:`foscttm_directions`: 0 when every
        sample's true match is its nearest cross-modal neighbour, about 0.5 when
        the two embeddings are unrelated.
    """
    x_to_y, y_to_x = foscttm_directions(x, y, block_size=block_size)
    return (x_to_y + y_to_x) / 2.0
