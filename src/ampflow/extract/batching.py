"""Batches of sequences: length-sorted under a token budget, or fixed-size in input order."""

from __future__ import annotations


def token_budget_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices grouped longest first so that ``padded length x batch size <= budget``.

    A sequence longer than the budget gets a batch of its own. Longest first: a batch
    that does not fit in memory fails at the start of a chunk, not at its end. Ties keep
    input order, so the batches are the same on every run.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        # sorted longest first: the batch's padded length is that of its first member
        if cur and lengths[cur[0]] * (len(cur) + 1) > budget:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def fixed_batches(n: int, size: int) -> list[list[int]]:
    """``size`` sequences per batch in input order (the naive alternative)."""
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


def padding_fraction(lengths: list[int], batches: list[list[int]]) -> float:
    """Share of the computed token positions that are padding."""
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    return 1.0 - sum(lengths) / padded if padded else 0.0


def plan_batches(lengths, device, tokens_per_batch, attention_per_batch=None):
    return token_budget_batches(lengths, tokens_per_batch)


def embed_with_backoff(batches, run, lengths):
    import torch

    splits = []

    def go(b, depth):
        try:
            run(b)
        except torch.OutOfMemoryError:
            if len(b) == 1:
                raise
            splits.append({"sequences": len(b), "padded_tokens": len(b) * max(lengths[i] for i in b), "depth": depth})
            h = len(b) // 2
            go(b[:h], depth + 1)
            go(b[h:], depth + 1)

    for b in batches:
        go(b, 0)
    return splits
