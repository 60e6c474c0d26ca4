"""The per-offset banded attention kernel, kept only as a benchmark baseline.

Until the blocked kernel (:func:`ampflow.model.attention.local_attention_banded`)
replaced it, the model ran this one: the same band math and the same saved
``(..., N, 2w + 1)`` probabilities, but each of the ``2w + 1`` band columns is its own
elementwise product, sum, slice assignment and ``addcmul_`` (about a dozen small
kernels per column and query chunk, forward and backward). On a GPU those launches,
not the FLOPs, set its time. ``scripts/bench_attention.py`` and ``scripts/bench_train.py``
time the model's kernel against it; ``tests/test_attention.py`` checks it still equals
full masked attention, so the baseline it gives is a correct one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import Tensor

try:
    from ampflow.model.attention import band_width, banded_arguments, local_attention_full
except ImportError:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    from ampflow.model.attention import band_width, banded_arguments, local_attention_full


def band_offsets(s: int, e: int, n: int, window: int) -> Iterator[tuple[int, int, int, int]]:
    """The diagonals of the band seen by query rows ``[s, e)``.

    Yields
    ------
    o, d, lo, hi : int
        Column ``o`` of the ``(.., N, band_width)`` score layout is the key offset
        ``d = j - i = o - w`` (``w`` clipped as in :func:`band_width`); the queries
        ``i`` in ``[lo, hi)`` (a subrange of ``[s, e)``) are those whose key ``i + d``
        exists. Offsets that no query of ``[s, e)`` reaches are skipped; the other rows
        of column ``o`` are outside ``[0, N)`` and get probability 0.
    """
    w = (band_width(n, window) - 1) // 2
    for o in range(2 * w + 1):
        d = o - w
        lo, hi = max(s, -d), min(e, n - d)
        if lo < hi:
            yield o, d, lo, hi


class _PerOffsetLocalAttention(torch.autograd.Function):
    """Banded attention one diagonal offset at a time, hand-written forward and backward.

    Scores live in a ``(..., N, 2w + 1)`` layout: column ``o`` holds ``q_i . k_{i+o-w}``.
    Each column is one elementwise product of a slice of the queries with the keys
    shifted by ``o - w`` and a sum over ``Dk``, so nothing ``(N, 2w + 1, D)`` (a gathered
    window) is ever built: the largest transients are one ``(..., rows, Dk)`` product
    and the ``(..., rows, 2w + 1)`` score block of a query chunk. The weighted sum of
    values and every gradient are in-place ``addcmul_`` over the same shifted slices,
    so the backward needs no scatter and no gradient buffer beyond the ``(..., N, D)``
    results. Saved for backward: the scaled queries, keys, values and the
    ``(..., N, 2w + 1)`` probabilities, no mask (out-of-range keys have probability
    exactly 0, so their gradient vanishes by itself). Inputs must share their leading
    dims.
    """

    @staticmethod
    def forward(ctx, q_s: Tensor, k: Tensor, v: Tensor, window: int, chunk: int, combine=None) -> Tensor:
        n = q_s.shape[-2]
        width = band_width(n, window)
        lead = q_s.shape[:-2]
        out = q_s.new_zeros(*lead, n, v.shape[-1])
        probs = q_s.new_empty(*lead, n, width)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            offsets = list(band_offsets(s, e, n, window))
            # Zeros, not -inf, before ``combine``: the ranks' partial sums must add up.
            scores = q_s.new_zeros(*lead, e - s, width)
            for o, d, lo, hi in offsets:
                prod = q_s[..., lo:hi, :] * k[..., lo + d : hi + d, :]
                scores[..., lo - s : hi - s, o] = prod.sum(dim=-1)
            if combine is not None:
                scores = combine(scores)
            # Rows of a column whose key lies outside [0, N): masked after the combine.
            reached = {o for o, *_ in offsets}
            for o in range(width):
                if o not in reached:
                    scores[..., o] = float("-inf")
            for o, _, lo, hi in offsets:
                scores[..., : lo - s, o] = float("-inf")
                scores[..., hi - s :, o] = float("-inf")
            p = torch.softmax(scores, dim=-1)
            probs[..., s:e, :] = p
            for o, d, lo, hi in offsets:
                out[..., lo:hi, :].addcmul_(p[..., lo - s : hi - s, o : o + 1], v[..., lo + d : hi + d, :])
        ctx.window, ctx.chunk, ctx.combine = window, chunk, combine
        ctx.save_for_backward(q_s, k, v, probs)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        q_s, k, v, probs = ctx.saved_tensors
        n, width = probs.shape[-2:]
        lead = probs.shape[:-2]
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        # new_*(shape) rather than *_like: inputs may be expanded (stride-0) views, and
        # the gradient buffers must be dense.
        dq = q_s.new_zeros(q_s.shape) if need_q else None
        dk = k.new_zeros(k.shape) if need_k else None
        dv = v.new_zeros(v.shape) if need_v else None
        for s in range(0, n, ctx.chunk):
            e = min(n, s + ctx.chunk)
            offsets = list(band_offsets(s, e, n, ctx.window))
            p = probs[..., s:e, :]
            if need_v:
                for o, d, lo, hi in offsets:
                    dv[..., lo + d : hi + d, :].addcmul_(p[..., lo - s : hi - s, o : o + 1], grad_out[..., lo:hi, :])
            if not (need_q or need_k):
                continue
            # dL/dp; columns and rows outside the band stay 0 (their p is 0 anyway)
            dp = grad_out.new_zeros(*lead, e - s, width)
            for o, d, lo, hi in offsets:
                dp[..., lo - s : hi - s, o] = (grad_out[..., lo:hi, :] * v[..., lo + d : hi + d, :]).sum(dim=-1)
            if ctx.combine is not None:  # dL/dp sums over every rank's value channels
                dp = ctx.combine(dp)
            # softmax backward: p * (dp - sum_j p_j dp_j)
            ds = dp.sub_((dp * p).sum(dim=-1, keepdim=True)).mul_(p)
            for o, d, lo, hi in offsets:
                col = ds[..., lo - s : hi - s, o : o + 1]
                if need_q:
                    dq[..., lo:hi, :].addcmul_(col, k[..., lo + d : hi + d, :])
                if need_k:
                    dk[..., lo + d : hi + d, :].addcmul_(col, q_s[..., lo:hi, :])
        return dq, dk, dv, None, None, None


def local_attention_per_offset(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window: int,
    chunk: int | None = None,
    scale: float | None = None,
    combine: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Exact sliding-window attention, one band column at a time (the former default).

    Same arguments and result as :func:`ampflow.model.attention.local_attention_banded`
    (``chunk``: query rows per block, ``None`` or ``0`` one block).
    """
    args = banded_arguments(q, k, v, window, chunk, scale)
    if args is None:
        return local_attention_full(q, k, v, int(window), scale)
    q_s, k, v, window, chunk = args
    chunk = chunk or q.shape[-2]
    return _PerOffsetLocalAttention.apply(q_s, k, v, window, chunk, combine)
