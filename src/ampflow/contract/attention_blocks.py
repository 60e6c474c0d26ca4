"""The blocks of the banded attention kernel, torch-free: one description for the kernel
(:mod:`ampflow.model.attention`), the memory model and the cost model.

The kernel cuts the ``n`` queries into blocks of :func:`block_rows` rows and evaluates
the blocks in groups (:func:`band_groups`), one batched product per group and head; a
group's block scores, ``rows x (R + 2w)``, are its transient, the ``n x (2w + 1)``
band (:func:`band_width` per query) what it keeps.
"""

from __future__ import annotations

from collections.abc import Iterator


def band_width(n: int, window: int) -> int:
    """Scores per query of the banded kernel: ``2 * min(window, n - 1) + 1``.

    A window beyond ``n - 1`` adds only offsets no query can reach, so it is clipped
    (``window = 10**9`` is plain full attention at ``2n - 1`` scores per query, not
    ``2 * 10**9 + 1``). ``n = 0`` gives 1.
    """
    return 2 * min(int(window), max(int(n) - 1, 0)) + 1


#: Fewest query rows of a block: below this a block's product is too small to pay for
#: its launch (and on the CPU for its dispatch).
MIN_BLOCK_ROWS = 16


def block_rows(n: int, window: int, chunk: int | None = None) -> int:
    """Query rows ``R`` of one block of the banded kernel.

    A block of ``R`` queries sees the ``R + 2w`` keys around it, so it computes
    ``R (R + 2w)`` scores where ``R (2w + 1)`` are needed. ``R = max(2w, 16)`` keeps that
    waste under about twice and lets each block's window reach only its two
    neighbours (so the backward's overlap-add is two slices). A query chunk (S3)
    smaller than that caps it; ``R`` never exceeds ``n``.
    """
    w = (band_width(n, window) - 1) // 2
    rows = max(2 * w, MIN_BLOCK_ROWS)
    if chunk:
        rows = min(rows, int(chunk))
    return max(1, min(rows, int(n)))


def band_groups(n: int, window: int, chunk: int | None = None) -> Iterator[tuple[int, int, int]]:
    """The groups of blocks the banded kernel evaluates, one batched product each.

    Yields
    ------
    s, nb, r : int
        ``nb`` blocks of ``r`` query rows starting at row ``s`` (rows ``[s, s + nb r)``).
        Every group but the last holds the same number of full blocks of
        :func:`block_rows` rows, as many as fit in ``chunk`` rows (``None``: all of
        them); the rows left after the last full block form a group of one shorter
        block. Every rank of a sharded caller (S5) walks the same groups.
    """
    if n <= 0:
        return
    r = block_rows(n, window, chunk)
    full = n // r
    per = max(1, int(chunk) // r) if chunk else max(full, 1)
    for s in range(0, full * r, per * r):
        yield s, min(per, full - s // r), r
    if full * r < n:
        yield full * r, 1, n - full * r


def largest_group_rows(n: int, window: int, chunk: int | None = None) -> int:
    """Query rows of the largest group of :func:`band_groups` (0 for ``n = 0``)."""
    return max((nb * r for _, nb, r in band_groups(n, window, chunk)), default=0)
