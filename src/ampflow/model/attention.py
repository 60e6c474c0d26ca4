"""Exact sliding-window (local) attention for the stratified Hi-C decoder.

Each query ``i`` attends to the keys ``j`` with ``|i - j| <= window`` (non-causal, both
sides). Two evaluations of the same math are provided:

* :func:`local_attention_banded`, the default (:func:`local_attention`): each query
  keeps only its own ``2w + 1`` scores, so work and saved activations are
  ``O(N * (2w + 1))`` per head (plus the ``O(N * D)`` inputs), whatever ``N``. The
  scores are computed by blocks of ``R`` queries against the ``R + 2w`` keys around
  them, one batched matrix product per group of blocks and head
  (:mod:`ampflow.contract.attention_blocks`), so the kernel count does not grow with ``w``
  or ``N`` (the per-offset kernel it replaced, one band column at a time, is kept as a
  benchmark baseline in ``scripts/attention_baselines.py``). Optional query chunks
  (strategy S3) bound its transient block scores to ``O(chunk * (R + 2w))``. Forward
  and backward are written by hand.
* :func:`local_attention_full` materialises the whole ``(..., N, N)`` score matrix and
  masks it. It is the reference in the tests, and the memory problem: its saved
  activations grow as ``N**2``.

The two kernels the model ran before, one band column at a time and by masked query
chunks, are benchmark baselines in ``scripts/attention_baselines.py``.

``scale`` is an explicit argument because under hidden parallelism (S5) each rank holds
a slice of ``Dk`` and must use the scale of the global ``Dk``; the banded
kernel also takes a ``combine`` hook that sums each block's partial scores over the
ranks before the softmax.

:class:`~ampflow.train.measured_memory.SavedTensorBytes` / :func:`~ampflow.train.measured_memory.saved_activation_bytes`
measure the bytes an autograd graph keeps for backward, on any device (the kernels'
saved bytes are checked with them); the memory model as a whole is checked against the
allocator's peak (:class:`~ampflow.train.measured_memory.AllocatorTrace`).

``flex_attention`` is not used: in torch 2.13 it has no backward on CPU and its default
block-mask builder evaluates the full ``N x N`` grid on CPU; the blocked kernel is plain
``bmm`` on every device.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from ..contract.attention_blocks import band_groups, band_width, block_rows

__all__ = [
    "band_groups",
    "band_width",
    "block_rows",
    "local_attention",
    "local_attention_banded",
    "local_attention_full",
]


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, window: int) -> int:
    """Validate shapes and the window; return the sequence length ``N``."""
    if q.dim() < 2 or k.dim() < 2 or v.dim() < 2:
        raise ValueError("q, k and v need at least 2 dims (..., N, D)")
    n = q.shape[-2]
    if k.shape[-2] != n or v.shape[-2] != n:
        raise ValueError(f"q, k, v must have the same length N, got {q.shape[-2]}, {k.shape[-2]}, {v.shape[-2]}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k need the same last dim, got {q.shape[-1]} and {k.shape[-1]}")
    if int(window) != window or window < 0:
        raise ValueError(f"window must be a non-negative integer, got {window!r}")
    return n


def _default_scale(q: Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _outside_band(rows: int, cols: int, offset: int, window: int, device) -> Tensor:
    """Boolean mask of the score block that lies outside the band.

    Row ``a`` of the block is query ``i = s + a`` and column ``b`` is key ``j = ks + b``
    with ``offset = s - ks``, so ``|i - j| <= window`` reads
    ``offset - window <= b - a <= offset + window``: two diagonals, which ``triu``/``tril``
    select without any integer index grid (an ``int64`` ``i - j`` grid would cost 8 bytes
    per score).

    Returns
    -------
    Tensor
        ``(rows, cols)`` bool, True where the score must be ``-inf``.
    """
    band = torch.ones(rows, cols, dtype=torch.bool, device=device)
    band.triu_(offset - window).tril_(offset + window)
    return band.logical_not_()


def _masked_block(q_s: Tensor, k_blk: Tensor, v_blk: Tensor, outside: Tensor) -> Tensor:
    """Softmax attention of one block of queries against one block of keys.

    Parameters
    ----------
    q_s : Tensor
        ``(..., R, Dk)`` queries, already multiplied by the scale.
    k_blk : Tensor
        ``(..., K, Dk)`` keys.
    v_blk : Tensor
        ``(..., K, Dv)`` values.
    outside : Tensor
        ``(R, K)`` bool, True where the key is outside the query's window.

    Returns
    -------
    Tensor
        ``(..., R, Dv)``.
    """
    # Reassigning ``scores`` lets each intermediate go as soon as the next one exists:
    # masked_fill saves only the mask and softmax only its output for backward.
    scores = q_s @ k_blk.transpose(-2, -1)
    scores = scores.masked_fill(outside, float("-inf"))
    scores = torch.softmax(scores, dim=-1)
    return scores @ v_blk


def local_attention_full(q: Tensor, k: Tensor, v: Tensor, window: int, scale: float | None = None) -> Tensor:
    """Exact sliding-window attention through the full masked score matrix.

    ``out[..., i, :] = sum_j softmax_j(scale * q_i . k_j) v_j`` over ``|i - j| <= window``.
    Builds ``(..., N, N)`` scores (plus an ``(N, N)`` bool mask), so memory is ``O(N**2)``;
    use it as the reference or for short sequences.

    Parameters
    ----------
    q : Tensor
        ``(..., N, Dk)`` queries; any leading dims (batch, heads) broadcast as in ``matmul``.
    k : Tensor
        ``(..., N, Dk)`` keys.
    v : Tensor
        ``(..., N, Dv)`` values.
    window : int
        Half-width ``w >= 0``: query ``i`` sees keys ``i - w .. i + w`` (clipped to
        ``[0, N)``); ``w = 0`` returns ``v``, ``w >= N - 1`` is plain full attention.
    scale : float, optional
        Multiplier of the dot products; default ``1 / sqrt(Dk)`` of the local ``Dk``.
        A caller that shards ``Dk`` passes the scale of the global ``Dk``.

    Returns
    -------
    Tensor
        ``(..., N, Dv)``.
    """
    n = _check_inputs(q, k, v, window)
    # Scaling q (N x Dk) rather than the scores (N x N) keeps the extra saved tensor small.
    q_s = q * _default_scale(q, scale)
    return _masked_block(q_s, k, v, _outside_band(n, n, 0, int(window), q.device))


def _blocks(t: Tensor, start: int, nb: int, step: int, length: int) -> Tensor:
    """View of ``nb`` row windows of ``t`` (``(..., M, D)``): window ``j`` is rows
    ``[start + j * step, start + j * step + length)``, shape ``(..., nb, length, D)``.
    No copy; windows overlap when ``length > step`` (read-only then)."""
    *lead, rows, cols = t.stride()
    return t.as_strided((*t.shape[:-2], nb, length, t.shape[-1]), (*lead, step * rows, rows, cols), t.storage_offset() + start * rows)


def _add_windows_(padded: Tensor, s: int, r: int, win: Tensor) -> None:
    """Overlap-add ``win`` (``(..., nb, R + 2w, D)``, window ``j`` starting at padded row
    ``s + j R``) into ``padded``: slices of ``R`` window rows land on disjoint rows of
    ``padded`` across the windows, so each slice is one in-place add (two at
    ``R >= 2w``; deterministic, no scatter, no atomics)."""
    nb, span = win.shape[-3], win.shape[-2]
    step = span if nb == 1 else r  # one window never overlaps itself
    for a in range(0, span, step):
        b = min(span, a + step)
        _blocks(padded, s + a, nb, r, b - a).add_(win[..., a:b, :])


def _strip(full: Tensor, width: int) -> Tensor:
    """The band of a block-layout score tensor, as a view.

    ``full`` is ``(..., nb, R, R + 2w)`` (contiguous), row ``a`` of a block scoring the
    keys ``a - w .. a + R + w`` of its window; the band of row ``a`` is its columns
    ``a .. a + 2w``: a diagonal strip, ``(..., nb, R, 2w + 1)`` with row stride
    ``R + 2w + 1``.
    """
    *lead, blk, row, col = full.stride()
    return full.as_strided((*full.shape[:-1], width), (*lead, blk, row + col, col), full.storage_offset())


def _to_strip(strip: Tensor, band: Tensor) -> None:
    """Copy ``(..., nb * R, width)`` rows into a ``(..., nb, R, width)`` strip view."""
    strip.copy_(band.unflatten(-2, strip.shape[-3:-1]))


def _edge_mask_(scores: Tensor, s: int, n: int, w: int) -> None:
    """Set to ``-inf`` the band scores of rows ``[s, s + rows)`` whose key
    ``i + o - w`` lies outside ``[0, n)`` (only the first and last ``w`` rows have any)."""
    rows = scores.shape[-2]
    for lo, hi in ((s, min(s + rows, w)), (max(s, n - w), s + rows)):
        if lo >= hi:
            continue
        i = torch.arange(lo, hi, device=scores.device).unsqueeze(-1)
        key = i + torch.arange(scores.shape[-1], device=scores.device) - w
        scores[..., lo - s : hi - s, :].masked_fill_((key < 0) | (key >= n), float("-inf"))


class _BandedLocalAttention(torch.autograd.Function):
    """Banded attention by blocks of queries, with a hand-written forward and backward.

    The queries are cut into blocks of ``R`` rows (:func:`block_rows`); block ``j``
    scores its rows against the ``R + 2w`` keys around it (the keys padded with ``w``
    zero rows at each end, so every block's window is in range). A group of blocks is
    one batched product for all heads at once: ``(..., nb, R, Dk) @ (..., nb, Dk, R +
    2w)``, the keys' windows an overlapping strided view that the product copies into
    one dense operand (about twice the keys' bytes, transient). Each row's ``2w + 1``
    band scores are a diagonal strip of its block (:func:`_strip`), copied out into the
    ``(..., N, 2w + 1)`` layout that the softmax, ``combine`` (S5) and the saved
    probabilities use. The weighted sum of values puts the probabilities back into a
    zeroed block and multiplies by the values' windows. So a group costs a fixed
    handful of kernels, whatever the heads, ``w`` or ``N`` (the per-offset kernel it
    replaced, ``scripts/attention_baselines.py``, launched about a dozen per band
    column), and the products run on the dense matmul units.

    The backward does the same in reverse; ``dk`` and ``dv`` come out per window and are
    added back into padded buffers in ``ceil((R + 2w) / R)`` (two, at ``R >= 2w``)
    slices whose windows do not overlap (:func:`_add_windows_`): no scatter, no atomic
    adds, deterministic on CUDA too. Saved for backward: the scaled queries, keys,
    values and the ``(..., N, 2w + 1)`` probabilities, no mask (out-of-range keys have
    probability exactly 0, so their gradient vanishes by itself). Transient: the padded
    keys and values, and per group its block scores, window copies and band copies
    (:func:`ampflow.amp.memory.terms.attention_transients`, checked against the
    allocator). Inputs must share their leading dims.
    """

    @staticmethod
    def forward(ctx, q_s: Tensor, k: Tensor, v: Tensor, window: int, chunk: int | None, combine=None) -> Tensor:
        out, probs = _banded_forward(q_s, k, v, window, chunk, combine)
        ctx.window, ctx.chunk, ctx.combine = window, chunk, combine
        ctx.save_for_backward(q_s, k, v, probs)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        q_s, k, v, probs = ctx.saved_tensors
        dq, dk, dv = _banded_backward(q_s, k, v, probs, grad_out, ctx.window, ctx.chunk, ctx.combine, ctx.needs_input_grad[:3])
        return dq, dk, dv, None, None, None


def _banded_forward(q_s: Tensor, k: Tensor, v: Tensor, window: int, chunk: int | None, combine=None) -> tuple[Tensor, Tensor]:
    """The banded kernel's forward (:class:`_BandedLocalAttention`): ``(out, probs)``."""
    n = q_s.shape[-2]
    width = band_width(n, window)
    w = (width - 1) // 2
    lead = q_s.shape[:-2]
    out = q_s.new_empty(*lead, n, v.shape[-1])
    probs = q_s.new_empty(*lead, n, width)
    # Zero rows beyond both ends: their scores are 0, not -inf, before ``combine``
    # (the ranks' partial sums must add up); they are masked after it.
    kp = torch.nn.functional.pad(k, (0, 0, w, w))
    vp = torch.nn.functional.pad(v, (0, 0, w, w))
    for s, nb, r in band_groups(n, window, chunk):
        rows, span = nb * r, r + 2 * w
        full = _blocks(q_s, s, nb, r, r) @ _blocks(kp, s, nb, r, span).transpose(-2, -1)
        scores = _strip(full, width).flatten(-3, -2)  # a copy: the strip is not a view-able shape
        if combine is not None:
            scores = combine(scores)
        _edge_mask_(scores, s, n, w)
        p = torch.softmax(scores, dim=-1)
        del scores
        probs[..., s : s + rows, :] = p
        _to_strip(_strip(full.zero_(), width), p)
        del p
        out[..., s : s + rows, :] = (full @ _blocks(vp, s, nb, r, span)).flatten(-3, -2)
        del full
    return out, probs


def _banded_backward(q_s, k, v, probs, grad_out, window: int, chunk: int | None, combine, needs) -> tuple:
    """The banded kernel's backward: ``(dq, dk, dv)``, None where ``needs`` says no."""
    n, width = probs.shape[-2:]
    w = (width - 1) // 2
    lead = probs.shape[:-2]
    need_q, need_k, need_v = needs
    # new_*(shape) rather than *_like: inputs may be expanded (stride-0) views, and
    # the gradient buffers must be dense. dk and dv are accumulated padded, like the
    # keys and values the forward read.
    dq = q_s.new_empty(q_s.shape) if need_q else None
    dkp = k.new_zeros(*lead, n + 2 * w, k.shape[-1]) if need_k else None
    dvp = v.new_zeros(*lead, n + 2 * w, v.shape[-1]) if need_v else None
    kp = torch.nn.functional.pad(k, (0, 0, w, w)) if need_q else None
    vp = torch.nn.functional.pad(v, (0, 0, w, w)) if (need_q or need_k) else None
    for s, nb, r in band_groups(n, window, chunk):
        rows, span = nb * r, r + 2 * w
        p = probs[..., s : s + rows, :]
        g = _blocks(grad_out, s, nb, r, r)
        full = p.new_zeros(*lead, nb, r, span)
        strip = _strip(full, width)
        _to_strip(strip, p)
        if need_v:
            _add_windows_(dvp, s, r, full.transpose(-2, -1) @ g)
        if not (need_q or need_k):
            continue
        # dL/dp on the band; the rest of each block is never read
        dp = g @ _blocks(vp, s, nb, r, span).transpose(-2, -1)
        dp = _strip(dp, width).flatten(-3, -2)
        if combine is not None:  # dL/dp sums over every rank's value channels
            dp = combine(dp)
        # softmax backward: p * (dp - sum_j p_j dp_j)
        ds = dp.sub_((dp * p).sum(dim=-1, keepdim=True)).mul_(p)
        _to_strip(strip, ds)
        del ds, dp
        if need_q:
            dq[..., s : s + rows, :] = (full @ _blocks(kp, s, nb, r, span)).flatten(-3, -2)
        if need_k:
            _add_windows_(dkp, s, r, full.transpose(-2, -1) @ _blocks(q_s, s, nb, r, r))
        del full
    dk = dkp[..., w : w + n, :] if need_k else None
    dv = dvp[..., w : w + n, :] if need_v else None
    return dq, dk, dv


def local_attention_banded(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window: int,
    chunk: int | None = None,
    scale: float | None = None,
    combine: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Exact sliding-window attention over each query's own window (the default kernel).

    Query ``i`` is scored against keys ``i - w .. i + w`` only (``2w + 1`` scores, fewer
    at the ends, whose missing keys get probability 0), so work is
    ``O(N * (2w + 1) * D)`` and the activations saved for backward are the scaled
    queries plus ``(..., N, 2w + 1)`` probabilities: linear in ``N`` and independent of
    ``chunk``. Same result as :func:`local_attention_full` up to summation order. The
    backward is written by hand (see :class:`_BandedLocalAttention`); it is once
    differentiable (no double backward).

    Parameters
    ----------
    q : Tensor
        ``(..., N, Dk)`` queries; leading dims (batch, heads) broadcast as in ``matmul``.
    k : Tensor
        ``(..., N, Dk)`` keys.
    v : Tensor
        ``(..., N, Dv)`` values.
    window : int
        Half-width ``w >= 0`` of the window, as in :func:`local_attention_full`;
        ``w >= N`` is clipped to ``N - 1`` (see :func:`band_width`).
    chunk : int, optional
        Strategy S3: query rows per block, ``C >= 1``; each block builds a
        ``(..., C, 2w + 1)`` score block instead of one for all ``N`` rows. ``None``
        or ``0``: one block. Saved bytes do not depend on it.
    scale : float, optional
        Multiplier of the dot products; default ``1 / sqrt(Dk)``.
    combine : callable, optional
        For callers that hold a slice of ``Dk`` and ``Dv`` (hidden parallelism, S5):
        applied to each block's partial ``(..., rows, 2w + 1)`` scores before the
        softmax, and in backward to the gradient of its probabilities (partial over the
        ``Dv`` slices). A sum over the ranks' slices serves both; every rank must walk
        the same blocks (same ``N``, ``window`` and ``chunk``). None: the plain
        computation.

    Returns
    -------
    Tensor
        ``(..., N, Dv)``.
    """
    args = banded_arguments(q, k, v, window, chunk, scale)
    if args is None:
        return local_attention_full(q, k, v, int(window), scale)
    if combine is None and torch.compiler.is_compiling():
        # under torch.compile the kernel is one opaque operator: traced, its strided views
        # of storage offsets break the graph, and the strata's breaks exhaust the
        # recompile limit (the loop index is guarded), leaving most strata uncompiled
        q_s, k, v, w, c = args
        return torch.ops.ampflow.banded_attention(q_s, k, v, w, c or 0)[0]
    return _BandedLocalAttention.apply(*args, combine)


@torch.library.custom_op("ampflow::banded_attention", mutates_args=())
def _banded_attention_op(q_s: Tensor, k: Tensor, v: Tensor, window: int, chunk: int) -> tuple[Tensor, Tensor]:
    """:func:`_banded_forward` as an operator (for torch.compile): ``(out, probs)``."""
    return _banded_forward(q_s, k, v, window, chunk or None)


@_banded_attention_op.register_fake
def _(q_s, k, v, window, chunk):
    n = q_s.shape[-2]
    return q_s.new_empty(*q_s.shape[:-2], n, v.shape[-1]), q_s.new_empty(*q_s.shape[:-2], n, band_width(n, window))


@torch.library.custom_op("ampflow::banded_attention_backward", mutates_args=())
def _banded_backward_op(q_s: Tensor, k: Tensor, v: Tensor, probs: Tensor, grad_out: Tensor, window: int, chunk: int) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`_banded_backward` as an operator: ``(dq, dk, dv)``, each dense (no view
    of another output)."""
    dq, dk, dv = _banded_backward(q_s, k, v, probs, grad_out.contiguous(), window, chunk or None, None, (True, True, True))
    return dq, dk.contiguous(), dv.contiguous()


@_banded_backward_op.register_fake
def _(q_s, k, v, probs, grad_out, window, chunk):
    return q_s.new_empty(q_s.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _banded_setup(ctx, inputs, output):
    q_s, k, v, window, chunk = inputs
    ctx.save_for_backward(q_s, k, v, output[1])
    ctx.window, ctx.chunk = window, chunk


def _banded_op_backward(ctx, grad_out, grad_probs):
    q_s, k, v, probs = ctx.saved_tensors
    dq, dk, dv = torch.ops.ampflow.banded_attention_backward(q_s, k, v, probs, grad_out, ctx.window, ctx.chunk)
    return dq, dk, dv, None, None


_banded_attention_op.register_autograd(_banded_op_backward, setup_context=_banded_setup)


def banded_arguments(q: Tensor, k: Tensor, v: Tensor, window: int, chunk: int | None, scale: float | None):
    """The checked arguments of a banded kernel: ``(q_s, k, v, window, chunk)`` with the
    queries scaled and all three expanded to their shared leading dims, ``chunk`` an
    int or None (one block); None for ``N = 0`` (the full kernel's empty result)."""
    n = _check_inputs(q, k, v, window)
    if chunk is not None and (int(chunk) != chunk or chunk < 0):
        raise ValueError(f"chunk must be a non-negative integer or None, got {chunk!r}")
    if n == 0:
        return None
    q_s = q * _default_scale(q, scale)
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    # expand() is a view; its backward sums the gradient back to each input's shape.
    q_s, k, v = (t.expand(*batch, *t.shape[-2:]) for t in (q_s, k, v))
    return q_s, k, v, int(window), int(chunk) if chunk else None


def local_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window: int,
    chunk: int | None = None,
    scale: float | None = None,
) -> Tensor:
    """Sliding-window attention as the model runs it: :func:`local_attention_banded`.

    Parameters
    ----------
    q, k : Tensor
        ``(..., N, Dk)``.
    v : Tensor
        ``(..., N, Dv)``.
    window : int
        Half-width ``w >= 0`` of the window.
    chunk : int, optional
        ``None`` or ``0``: all queries in one block; otherwise query rows per block
        (S3), which bounds the transient score block, not the saved activations.
    scale : float, optional
        Multiplier of the dot products; default ``1 / sqrt(Dk)``.

    Returns
    -------
    Tensor
        ``(..., N, Dv)``.
    """
    return local_attention_banded(q, k, v, window, chunk or None, scale)
