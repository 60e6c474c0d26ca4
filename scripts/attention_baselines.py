"""The two local-attention kernels the model ran before the blocked one, kept only as
benchmark baselines: the per-offset banded kernel (:func:`local_attention_per_offset`)
and the masked chunked one (:func:`local_attention_chunked`), with the probabilities the
latter keeps (:func:`chunked_score_elements`).

The per-offset kernel:

Until the blocked kernel (:func:`ampflow.model.attention.local_attention_banded`)
replaced it, the model ran this one: the same band math and the same saved
``(..., N, 2w + 1)`` probabilities, but each of the ``2w + 1`` band columns is its own
elementwise product, sum, slice assignment and ``addcmul_`` (about a dozen small
kernels per column and query chunk, forward and backward). On a GPU those launches,
not the FLOPs, set its time. ``scripts/bench_attention.py`` and ``scripts/bench_train.py``
time the model's kernel against it; ``tests/test_attention.py`` checks it still equals
full masked attention, so the baseline it gives is a correct one.

The chunked kernel, S3's first kernel: queries are processed in chunks ``[s, e)`` of
``chunk`` rows against the keys ``[max(0, s - window), min(N, e + window))`` only, the
only keys any query of the chunk can see, with the band masked inside each block. Scores
and saved activations are ``O(N * (chunk + 2 * window))``: it computes ``chunk + 2w``
scores per query where ``2w + 1`` are needed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import Tensor

try:
    import ampflow  # noqa: F401
except ImportError:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from ampflow.model.attention import (  # noqa: E402
    _check_inputs,
    _default_scale,
    _outside_band,
    band_width,
    banded_arguments,
    local_attention_full,
)


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


# ---------------------------------------------------------------- the chunked kernel
def chunk_blocks(n: int, window: int, chunk: int) -> Iterator[tuple[int, int, int, int]]:
    """The blocks of the chunked evaluation.

    Yields
    ------
    s, e, ks, ke : int
        Query rows ``[s, e)`` (``e - s = chunk``, the last block may be shorter) and the
        only keys they can see, ``[max(0, s - window), min(n, e + window))``. Exposed so
        that sharded variants (S5) walk the same blocks.
    """
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        yield s, e, max(0, s - window), min(n, e + window)


class _ChunkedLocalAttention(torch.autograd.Function):
    """Chunked band attention with a hand-written backward.

    Differentiating the chunk loop with plain autograd ops is correct but slow: the
    backward of every slice ``k[..., ks:ke, :]`` allocates and zero-fills a full
    ``(..., N, Dk)`` gradient, so the backward costs ``O(N**2 * D / C)``. Here the
    backward accumulates each block's gradient into one ``(..., N, D)`` buffer instead,
    linear in ``N`` (N = 27,000, D = 128, w = 128, C = 256, one CPU thread: 0.31 s
    instead of 0.86 s forward + backward). What is saved for backward is what autograd
    would save: the scaled queries, keys, values and each block's softmax
    probabilities, but no mask (masked probabilities are exactly 0, so their gradient
    vanishes by itself). Inputs must already share their leading dims.
    """

    @staticmethod
    def forward(ctx, q_s: Tensor, k: Tensor, v: Tensor, window: int, chunk: int, combine=None) -> Tensor:
        n = q_s.shape[-2]
        out = q_s.new_empty(*q_s.shape[:-1], v.shape[-1])
        # Interior blocks share one mask shape and offset: build it once.
        masks: dict[tuple[int, int, int], Tensor] = {}
        probs = []
        for s, e, ks, ke in chunk_blocks(n, window, chunk):
            key = (e - s, ke - ks, s - ks)
            if key not in masks:
                masks[key] = _outside_band(*key, window, q_s.device)
            scores = q_s[..., s:e, :] @ k[..., ks:ke, :].transpose(-2, -1)
            if combine is not None:
                scores = combine(scores)
            p = torch.softmax(scores.masked_fill_(masks[key], float("-inf")), dim=-1)
            out[..., s:e, :] = p @ v[..., ks:ke, :]
            probs.append(p)
        ctx.window, ctx.chunk, ctx.combine = window, chunk, combine
        ctx.save_for_backward(q_s, k, v, *probs)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        q_s, k, v, *probs = ctx.saved_tensors
        n = q_s.shape[-2]
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        # new_*(shape) rather than *_like: inputs may be expanded (stride-0) views, and
        # the gradient buffers must be dense.
        dq = q_s.new_empty(q_s.shape) if need_q else None
        dk = k.new_zeros(k.shape) if need_k else None
        dv = v.new_zeros(v.shape) if need_v else None
        for (s, e, ks, ke), p in zip(chunk_blocks(n, ctx.window, ctx.chunk), probs):
            g = grad_out[..., s:e, :]
            if need_v:
                dv[..., ks:ke, :] += p.transpose(-2, -1) @ g
            if not (need_q or need_k):
                continue
            dp = g @ v[..., ks:ke, :].transpose(-2, -1)
            if ctx.combine is not None:  # dL/dp sums over every rank's value channels
                dp = ctx.combine(dp)
            # softmax backward: p * (dp - sum_j p_j dp_j)
            ds = dp.sub_((dp * p).sum(dim=-1, keepdim=True)).mul_(p)
            if need_q:
                dq[..., s:e, :] = ds @ k[..., ks:ke, :]
            if need_k:
                dk[..., ks:ke, :] += ds.transpose(-2, -1) @ q_s[..., s:e, :]
        return dq, dk, dv, None, None, None


def local_attention_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window: int,
    chunk: int,
    scale: float | None = None,
    combine: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Exact sliding-window attention by query chunks (strategy S3).

    Queries ``[s, e)`` (``e - s = chunk``, the last chunk may be shorter) are scored only
    against keys ``[max(0, s - w), min(N, e + w))`` with the band ``|i - j| <= w`` masked
    inside that block, and the chunk outputs are written side by side (see
    :func:`chunk_blocks`). Same result as :func:`local_attention_full` up to summation
    order; nothing ``N x N`` is built: the largest intermediate is
    ``(..., chunk, chunk + 2w)``, and the activations saved for backward are the scaled
    queries plus ``O(N * (chunk + 2w))`` probabilities. The backward is linear in ``N``
    (see :class:`_ChunkedLocalAttention`); it does not modify any tensor autograd keeps,
    and it is once differentiable (no double backward).

    Parameters
    ----------
    q : Tensor
        ``(..., N, Dk)`` queries; leading dims (batch, heads) broadcast as in ``matmul``.
    k : Tensor
        ``(..., N, Dk)`` keys.
    v : Tensor
        ``(..., N, Dv)`` values.
    window : int
        Half-width ``w >= 0`` of the window, as in :func:`local_attention_full`.
    chunk : int
        Query rows per block, ``C >= 1``. ``C >= N`` gives one block (the full
        computation over keys ``[0, N)``).
    scale : float, optional
        Multiplier of the dot products; default ``1 / sqrt(Dk)``.
    combine : callable, optional
        For callers that hold a slice of ``Dk`` and ``Dv`` (hidden parallelism, S5):
        applied to each block's partial scores before the softmax, and in backward to
        the gradient of each block's probabilities (partial over the ``Dv`` slices).
        A sum over the ranks' slices serves both. None: the plain computation.

    Returns
    -------
    Tensor
        ``(..., N, Dv)``.
    """
    n = _check_inputs(q, k, v, window)
    if int(chunk) != chunk or chunk < 1:
        raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
    window, chunk = int(window), int(chunk)
    if n == 0:
        return local_attention_full(q, k, v, window, scale)
    # Same first step as the full version (q scaled, N x Dk) so the two differ only in
    # which keys each block multiplies.
    q_s = q * _default_scale(q, scale)
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    # expand() is a view; its backward sums the gradient back to each input's shape.
    q_s, k, v = (t.expand(*batch, *t.shape[-2:]) for t in (q_s, k, v))
    return _ChunkedLocalAttention.apply(q_s, k, v, window, chunk, combine)


def chunked_score_elements(n: int, window: int, chunk: int) -> int:
    """Probabilities per head kept by the older chunked kernel
    (:func:`local_attention_chunked`, not used by the model):
    ``sum (e - s) * (ke - ks)`` over the blocks of
    :func:`chunk_blocks` (query rows ``[s, e)`` of ``chunk``,
    keys ``[max(0, s - w), min(n, e + w))``)."""
    total = 0
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        total += (e - s) * (min(n, e + window) - max(0, s - window))
    return total
