"""Batches of sequences, and running them so that one out-of-memory batch does not end a job.

:func:`plan_batches` picks the batch rule of a device: on a GPU length-sorted batches under
a token budget and an attention budget; on the CPU batches of short, near-equal
sequences only (see :data:`CPU_SHORT_TOKENS` for why). :func:`embed_with_backoff` runs
a plan and halves any batch that runs out of GPU memory, down to one sequence.
:func:`plan_packed` and :func:`pack_rows` plan packed batches instead (several sequences
per row, ``extract.models.pack``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..base.errors import InputError

# ESM-2's longest input in tokens (1022 residues + <cls> + <eos>). The default attention
# budget is tokens_per_batch x this: a batch of ESM-2 sequences (S <= 1024) has
# B x S^2 <= B x S x 1024 <= tokens_per_batch x 1024, so the token budget alone decides
# every ESM-2 batch, as before; only longer sequences (DNABERT-S reads 10,000 letters,
# ~2,000 tokens) are cut down to the attention memory of the largest ESM-2 batch.
REFERENCE_TOKENS = 1024

# Why batching loses on the CPU: a forward pass costs a fixed ~2-3 ms (Python, kernel
# launches, reading the weights) plus work proportional to the tokens, and a call with a
# hundred token rows already runs the matrix products near full speed, so a batch saves
# only the fixed part while it pays for every padded position (in the products and in
# the B x heads x S^2 attention) and for activations that no longer fit in the cache.
# Measured on this project's 2-core machine (32 MiB cache), 1 thread:
# - ESM-2 (transformers EsmModel), esm2_t6 shape, the 181 Prodigal proteins of
#   scripts/bench_extract.py: 4096-token sorted batches run at 0.72-0.85x one sequence at
#   a time; batches of <= 256 tokens of near-equal proteins at 0.915x on their members
#   (pairs of 117 tokens, no padding at all: 0.87x; t12 shape 0.94x); only sequences of
#   <= 48 tokens win (4 of 38-42 tokens: 1.26x, t12 1.06x; 8 of 32: 1.3x; of 16: 1.5-1.8x).
# - DNABERT-S (our ALiBi model, 768 wide, 12 blocks), 4 equal-length sequences: 1.2x at
#   48 tokens, 1.1x at 128, 1.02x at 256, 0.96x at 512; the 10 reads of 77-86 tokens of
#   virnucpro_sample_viral_test.fasta in batches of <= 256 tokens: 1.14-1.21x.
# So the CPU batches only sequences of at most this many tokens (per model kind; the
# smallest for a model not named), ...
CPU_SHORT_TOKENS = {"esm2": 48, "dnabert_s": 128}
# ... at most this many padded tokens a batch (16 of 16 tokens, 5 of 48, 2 of 128), ...
CPU_TOKENS_PER_BATCH = 256
# ... and only members of at least this share of the batch's padded length (padding
# <= 1/8 of each member), so that the saved fixed cost is not spent on padding.
CPU_MIN_SHARE = 7 / 8


def _sorted_batches(lengths: list[int], fits: Callable[[int, int, int], bool]) -> list[list[int]]:
    """Indices longest first (ties in input order), a batch closed when ``fits(padded
    length, size with the next member, next member's length)`` is false.

    Longest first: a batch that does not fit in memory fails at the start of a chunk, not
    at its end; sorted, a batch's padded length is that of its first member. A sequence
    that fits no batch is a batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and not fits(lengths[cur[0]], len(cur) + 1, lengths[i]):
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def token_budget_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices grouped longest first so that ``padded length x batch size <= budget``."""
    return _sorted_batches(lengths, lambda s, b, _: s * b <= budget)


def plan_batches(lengths: list[int], device: str, tokens_per_batch: int, attention_per_batch: int | None = None, kind: str | None = None) -> list[list[int]]:
    """Batches of indices into ``lengths`` (tokens per sequence), one model call each.

    GPU (any device but ``cpu``): longest first, ties in input order, every batch of more
    than one sequence within ``B x S <= tokens_per_batch`` (activations) and
    ``B x S^2 <= attention_per_batch`` (attention scores and DNABERT-S's bias are
    B x heads x S x S), S the padded length. ``attention_per_batch`` None:
    ``tokens_per_batch x`` :data:`REFERENCE_TOKENS`, which leaves ESM-2 batches as the
    token budget makes them and narrows long DNA ones.

    CPU: the same order, but only sequences of at most :data:`CPU_SHORT_TOKENS` tokens
    (of the model ``kind``: ``esm2``, ``dnabert_s``, None = the smallest) share batches, of near-equal lengths (:data:`CPU_MIN_SHARE`) and at most
    ``min(tokens_per_batch,`` :data:`CPU_TOKENS_PER_BATCH` ``)`` padded tokens; longer
    ones run alone, which is never slower there.
    ``tokens_per_batch: 1`` gives one sequence per batch on either device.
    """
    if device == "cpu":
        budget = min(tokens_per_batch, CPU_TOKENS_PER_BATCH)
        short = CPU_SHORT_TOKENS.get(kind, min(CPU_SHORT_TOKENS.values()))
        return _sorted_batches(lengths, lambda s, b, n: s <= short and s * b <= budget and n >= CPU_MIN_SHARE * s)
    if attention_per_batch is None:
        attention_per_batch = tokens_per_batch * REFERENCE_TOKENS
    return _sorted_batches(lengths, lambda s, b, _: s * b <= tokens_per_batch and s * s * b <= attention_per_batch)


def fixed_batches(n: int, size: int) -> list[list[int]]:
    """``size`` sequences per batch in input order (the naive alternative)."""
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


def padding_fraction(lengths: list[int], batches: list[list[int]]) -> float:
    """Share of the computed token positions that are padding."""
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    return 1.0 - sum(lengths) / padded if padded else 0.0


def is_out_of_memory(e: BaseException) -> bool:
    """torch's OutOfMemoryError, or a RuntimeError saying "out of memory" (how older torch
    and the MPS backend report it)."""
    import torch

    # torch.cuda.OutOfMemoryError is torch.OutOfMemoryError (the latter only from torch 2.5)
    return isinstance(e, torch.cuda.OutOfMemoryError) or (isinstance(e, RuntimeError) and "out of memory" in str(e).lower())


def _free_cache() -> None:
    """Give the failed batch's cached blocks back so that its halves find them."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def embed_with_backoff(
    batches: list[list[int]],
    embed_batch: Callable[[list[int]], np.ndarray],
    lengths: list[int],
    dim: int | None,
    on_batch: Callable[[list[int]], None] | None = None,
    on_split: Callable[[dict], None] | None = None,
) -> tuple[np.ndarray | None, list[dict]]:
    """Run ``embed_batch(indices) -> (len(indices), dim)`` over a plan; the vectors in
    input order (``(len(lengths), dim)`` float32, row i = index i) and the split records.
    With ``dim`` None, ``embed_batch`` keeps its results itself (several products, the
    :class:`~ampflow.extract.models.Embedder`'s case) and the vectors returned are None.

    A batch that runs out of memory is halved (longest half first, length order kept) and
    each half tried again, down to one sequence: the plan's limits are estimates, and one
    batch too many for this GPU (or for what else runs on it) should cost a retry, not the
    job. Each split is recorded as ``{"batch": k, "sequences": n, "padded_tokens": n x S,
    "depth": d}`` (k = the planned batch, d = 0 for it, 1 for its halves, ...), passed to
    ``on_split`` when it happens and returned for the chunk's report. ``on_batch(indices)``
    follows every call that succeeded. A sequence that does not fit alone is an
    :class:`InputError` naming its index and length (nothing smaller can be tried); any
    other exception propagates unchanged.
    """
    out = None if dim is None else np.empty((len(lengths), dim), dtype=np.float32)
    splits: list[dict] = []

    def run(k: int, b: list[int], depth: int) -> None:
        try:
            got = embed_batch(b)
            if out is not None:
                out[b] = got
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            oom = str(e).splitlines()[0] if str(e) else type(e).__name__
        else:
            if on_batch is not None:
                on_batch(b)
            return
        # outside the except block: the exception's frames (and the tensors they hold)
        # are gone before the cache is emptied
        _free_cache()
        if len(b) == 1:
            raise InputError(
                f"sequence {b[0]} ({lengths[b[0]]} tokens) does not fit in memory even alone ({oom}); "
                "set extract.fasta.too_long: window or a smaller extract.models.max_length"
            )
        record = {"batch": k, "sequences": len(b), "padded_tokens": len(b) * max(lengths[i] for i in b), "depth": depth}
        splits.append(record)
        if on_split is not None:
            on_split(record)
        half = (len(b) + 1) // 2
        run(k, b[:half], depth + 1)
        run(k, b[half:], depth + 1)

    for k, b in enumerate(batches):
        run(k, b, 0)
    return out, splits


# ---------------------------------------------------------------- packing
# Row length of a packed batch on a GPU: ESM-2's longest input, so a row's attention
# (row^2 per head, masked across sequences but still computed) is at most that of one
# ESM-2 sequence of full length, and the attention budget bounds rows as it bounds rows
# of a padded batch.
PACK_ROW_TOKENS = REFERENCE_TOKENS


def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: positions into ``lengths`` grouped into rows of at most
    ``max(capacity, longest)`` tokens, each row's members longest first (ties in input
    order). Padding is left only at the end of rows, where nothing else fit."""
    cap = max([capacity, *lengths]) if lengths else capacity
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, room in enumerate(free):
            if lengths[i] <= room:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(cap - lengths[i])
    return rows


def packed_padded_tokens(lengths: list[int], rows: list[list[int]]) -> int:
    """Token positions a packed batch computes: rows x its longest row."""
    return len(rows) * max(sum(lengths[i] for i in r) for r in rows) if rows else 0


def plan_packed(
    lengths: list[int], device: str, tokens_per_batch: int, attention_per_batch: int | None = None, kind: str | None = None
) -> tuple[list[list[int]], int]:
    """Batches of indices into ``lengths`` for packed rows, and the row length: each batch
    is later packed by :func:`pack_rows` (so that a half of a batch that ran out of
    memory is packed again on its own).

    GPU: length-sorted, a batch closed when its sequences would fill more than
    ``tokens_per_batch`` tokens in rows of :data:`PACK_ROW_TOKENS`, or its rows more than
    ``attention_per_batch`` (default ``tokens_per_batch x`` :data:`REFERENCE_TOKENS`)
    attention elements per head; sequences longer than a row have rows of their own.
    CPU: only sequences of at most :data:`CPU_SHORT_TOKENS` share a row (one row a
    batch, at most ``min(tokens_per_batch,`` :data:`CPU_TOKENS_PER_BATCH` ``)`` tokens):
    longer ones run alone, which is never slower there (see the measurements above).
    """
    if device == "cpu":
        row = min(tokens_per_batch, CPU_TOKENS_PER_BATCH)
        short = CPU_SHORT_TOKENS.get(kind, min(CPU_SHORT_TOKENS.values()))
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        batches: list[list[int]] = []
        cur: list[int] = []
        for i in order:
            if cur and not (lengths[i] <= short and sum(lengths[j] for j in cur) + lengths[i] <= row and lengths[cur[0]] <= short):
                batches.append(cur)
                cur = []
            cur.append(i)
        if cur:
            batches.append(cur)
        return batches, row
    row = PACK_ROW_TOKENS
    if attention_per_batch is None:
        attention_per_batch = tokens_per_batch * REFERENCE_TOKENS
    # Members come longest first, so first-fit decreasing of a batch plus its next
    # member is the batch's packing plus that member in the first row with room: the
    # rows are kept as they grow (what pack_rows would give each batch, in O(rows)).
    batches = []
    cur: list[int] = []
    free: list[int] = []
    fill: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        if cur:
            r = next((r for r, room in enumerate(free) if n <= room), len(free))
            rows = len(free) + (r == len(free))
            s = max(max(fill), n if r == len(free) else fill[r] + n)
            if rows * s <= tokens_per_batch and rows * s * s <= attention_per_batch:
                if r == len(free):
                    free.append(max(row, lengths[cur[0]]) - n)
                    fill.append(n)
                else:
                    free[r] -= n
                    fill[r] += n
                cur.append(i)
                continue
            batches.append(cur)
        cur, free, fill = [i], [max(row, n) - n], [n]
    if cur:
        batches.append(cur)
    return batches, row


# ---------------------------------------------------------------- packed without mask
# The most tokens of one packed batch on a GPU: at 16k tokens ESM-2's products are already
# large enough to run near the card's matmul rate (virnucpro-broad packs ESM-2 3B to
# 16,384); larger batches only hold more memory and make the last batch's tail longer.
VARLEN_MAX_TOKENS = 32768
# ... and the fewest: one ESM-2 sequence of full length
VARLEN_MIN_TOKENS = REFERENCE_TOKENS
# the share of the device's free memory the activations of one batch may take (the
# rest: the allocator's rounding and blocks held by the caching allocator)
VARLEN_MEMORY_SHARE = 0.5


def packed_token_budget(free_bytes: int, hidden: int, inner: int, dtype_bytes: int, layers: int = 1) -> int:
    """Tokens of one packed batch whose activations fit ``VARLEN_MEMORY_SHARE`` of
    ``free_bytes``, between :data:`VARLEN_MIN_TOKENS` and :data:`VARLEN_MAX_TOKENS`.

    Per token, what one block holds at once in inference (nothing is kept for a
    backward): the residual, its layer norm, q, k, v and the attention output
    (``6 x hidden``) and the feed-forward's inner activation before and after its
    nonlinearity (``2 x inner``) in the compute dtype; the float32 rotation of q and k
    (``4 x hidden`` float32); and each asked layer's float32 copy for pooling. The
    variable-length kernels need no ``T x T`` scores.
    """
    per_token = dtype_bytes * (6 * hidden + 2 * inner) + 4 * (4 * hidden) + 4 * hidden * layers
    fit = int(VARLEN_MEMORY_SHARE * free_bytes // per_token)
    return max(VARLEN_MIN_TOKENS, min(VARLEN_MAX_TOKENS, fit))


def plan_varlen(lengths: list[int], device: str, budget: int, kind: str | None = None) -> list[list[int]]:
    """Batches of indices into ``lengths`` for packing without mask (one sequence after
    another, :mod:`~ampflow.extract.varlen`).

    GPU: first-fit decreasing into batches of at most ``budget`` tokens (a longer
    sequence is a batch of its own), longest batch first; no padding at all, and
    attention memory linear in the tokens, so the token count alone bounds a batch.
    CPU: the CPU's packed rule (:func:`plan_packed`): only short sequences share a batch.
    """
    if device == "cpu":
        return plan_packed(lengths, device, budget, kind=kind)[0]
    return pack_rows(lengths, budget)
