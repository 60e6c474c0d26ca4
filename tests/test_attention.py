"""Sliding-window attention: the banded kernel (the default) and the chunked one equal
full masked attention, alone and sharded over ranks (S5); the band semantics; saved
bytes linear in N; and the saved-activation byte counter used to validate the memory
model."""

from __future__ import annotations

import math
import random

import pytest
import torch
from conftest import load_script
from dist_helpers import run_world
from largest_output import LargestOutput
from torch.utils._python_dispatch import TorchDispatchMode

from ampflow.model.attention import (
    band_groups,
    band_width,
    block_rows,
    local_attention,
    local_attention_banded,
    local_attention_full,
)
from ampflow.parallel.collectives import group_sum
from ampflow.train.measured_memory import SavedTensorBytes, saved_activation_bytes

#: the kernels the model ran before (scripts/attention_baselines.py, benchmark baselines)
_baselines = load_script("attention_baselines")
chunk_blocks, local_attention_chunked = _baselines.chunk_blocks, _baselines.local_attention_chunked

F64 = torch.float64


def _inputs(n, heads, dk, dv, seed, dtype=F64, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(heads, n, dk, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(heads, n, dv, generator=g, dtype=dtype)
    # Non-unit scores so the softmax is far from uniform and errors in the band show.
    q, k = q * 2.0, k * 2.0
    grad_out = torch.randn(heads, n, dv, generator=g, dtype=dtype)
    for t in (q, k, v):
        t.requires_grad_(requires_grad)
    return q, k, v, grad_out


def _out_and_grads(fn, q, k, v, grad_out):
    out = fn(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    return (out.detach(), *grads)


def _random_cases(count=30, seed=1234):
    rng = random.Random(seed)
    return [
        (
            rng.randint(1, 300),  # N
            rng.randint(0, 80),  # window
            rng.randint(1, 120),  # chunk
            rng.randint(1, 3),  # heads
            rng.randint(1, 16),  # Dk
            rng.randint(1, 16),  # Dv
        )
        for _ in range(count)
    ]


EXPLICIT_CASES = [
    # (N, window, chunk, heads, Dk, Dv)
    (100, 5, 16, 2, 8, 4),  # N not divisible by C
    (257, 17, 64, 1, 5, 7),  # N not divisible by C, one-row last chunk
    (90, 40, 8, 2, 6, 6),  # w >= C
    (50, 60, 7, 3, 4, 3),  # w >= N
    (50, 49, 7, 1, 4, 3),  # w = N - 1: plain full attention
    (40, 3, 64, 2, 3, 5),  # C >= N
    (40, 3, 40, 1, 3, 5),  # C = N
    (120, 0, 16, 2, 8, 8),  # w = 0
    (1, 0, 1, 1, 1, 1),  # N = 1
    (1, 10, 5, 2, 3, 2),  # N = 1, w and C larger
    (64, 1, 1, 2, 4, 4),  # C = 1
]


@pytest.mark.parametrize("n,window,chunk,heads,dk,dv", EXPLICIT_CASES + _random_cases(), ids=str)
def test_chunked_equals_full_forward_and_gradients(n, window, chunk, heads, dk, dv):
    q, k, v, grad_out = _inputs(n, heads, dk, dv, seed=n * 1000 + window)
    full = _out_and_grads(lambda *a: local_attention_full(*a, window), q, k, v, grad_out)
    chunked = _out_and_grads(lambda *a: local_attention_chunked(*a, window, chunk), q, k, v, grad_out)
    for name, a, b in zip(("out", "dq", "dk", "dv"), full, chunked):
        assert a.shape == b.shape, name
        torch.testing.assert_close(b, a, atol=1e-10, rtol=0, msg=name)


def test_chunked_gradcheck():
    # The chunked backward is written by hand: check it against finite differences too.
    q, k, v, _ = _inputs(11, 1, 3, 2, seed=11)
    assert torch.autograd.gradcheck(lambda a, b, c: local_attention_chunked(a, b, c, 2, 3), (q, k, v))


def test_chunked_broadcast_leading_dims_and_partial_grads():
    g = torch.Generator().manual_seed(4)
    n, w, c = 45, 6, 8
    q = torch.randn(2, 3, n, 5, generator=g, dtype=F64, requires_grad=True)
    k = torch.randn(3, n, 5, generator=g, dtype=F64, requires_grad=True)
    v = torch.randn(1, 1, n, 4, generator=g, dtype=F64, requires_grad=True)
    grad_out = torch.randn(2, 3, n, 4, generator=g, dtype=F64)
    full = _out_and_grads(lambda *a: local_attention_full(*a, w), q, k, v, grad_out)
    chunked = _out_and_grads(lambda *a: local_attention_chunked(*a, w, c), q, k, v, grad_out)
    for a, b in zip(full, chunked):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, atol=1e-10, rtol=0)
    _one_input_grads_match(lambda *x: local_attention_chunked(*x, w, c), n, w, k, v, grad_out, g)


def _one_input_grads_match(kernel, n, w, k, v, grad_out, g):
    """Only one of q, k, v needs a gradient, q is a transposed (non-contiguous) input:
    ``kernel(q, k, v)``'s gradient equals full masked attention's (fp64, 1e-10)."""
    qt = torch.randn(n, 3, 5, generator=g, dtype=F64).transpose(0, 1)
    for wants in ("q", "k", "v"):
        ins = {"q": qt.clone(), "k": k.detach().clone(), "v": v.detach().clone()}
        ins[wants].requires_grad_(True)
        out_f = local_attention_full(ins["q"], ins["k"], ins["v"], w)
        (ref,) = torch.autograd.grad(out_f, ins[wants], grad_out[:1])
        (got,) = torch.autograd.grad(kernel(ins["q"], ins["k"], ins["v"]), ins[wants], grad_out[:1])
        torch.testing.assert_close(got, ref, atol=1e-10, rtol=0)


def test_chunk_blocks_cover_queries_and_windows():
    for n, w, c in [(10, 3, 4), (7, 20, 3), (5, 0, 9), (1, 0, 1)]:
        blocks = list(chunk_blocks(n, w, c))
        assert [s for s, *_ in blocks] == list(range(0, n, c))
        assert blocks[-1][1] == n
        for s, e, ks, ke in blocks:
            assert e - s == min(c, n - s)
            assert (ks, ke) == (max(0, s - w), min(n, e + w))


def _naive_reference(q, k, v, window, scale):
    """One query at a time over the explicit list of keys in its window."""
    n = q.shape[-2]
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    for i in range(n):
        lo, hi = max(0, i - window), min(n, i + window + 1)
        s = (q[..., i : i + 1, :] @ k[..., lo:hi, :].transpose(-2, -1)) * scale
        out[..., i, :] = (torch.softmax(s, dim=-1) @ v[..., lo:hi, :])[..., 0, :]
    return out


@pytest.mark.parametrize("window", [0, 1, 3, 11, 40])
def test_full_matches_naive_per_query_loop(window):
    q, k, v, _ = _inputs(23, 2, 5, 3, seed=7, requires_grad=False)
    ref = _naive_reference(q, k, v, window, 1 / math.sqrt(5))
    torch.testing.assert_close(local_attention_full(q, k, v, window), ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(local_attention_chunked(q, k, v, window, 4), ref, atol=1e-12, rtol=0)
    for chunk in (None, 4):
        torch.testing.assert_close(local_attention_banded(q, k, v, window, chunk), ref, atol=1e-12, rtol=0)


def test_window_zero_returns_values_and_huge_window_is_full_attention():
    q, k, v, _ = _inputs(30, 2, 4, 6, seed=3, requires_grad=False)
    torch.testing.assert_close(local_attention_chunked(q, k, v, 0, 7), v, atol=1e-15, rtol=0)
    plain = torch.softmax(q @ k.transpose(-2, -1) / 2.0, dim=-1) @ v
    torch.testing.assert_close(local_attention_chunked(q, k, v, 10**9, 7), plain)
    torch.testing.assert_close(local_attention_banded(q, k, v, 0, 7), v, atol=1e-15, rtol=0)
    torch.testing.assert_close(local_attention_banded(q, k, v, 0), v, atol=1e-15, rtol=0)
    # a huge window is clipped to N - 1 (2N - 1 scores per query), not 2 * 10**9 + 1
    torch.testing.assert_close(local_attention_banded(q, k, v, 10**9, 7), plain)
    torch.testing.assert_close(local_attention_banded(q, k, v, 10**9), plain)


def test_scale_argument_and_dispatch():
    q, k, v, _ = _inputs(37, 2, 4, 4, seed=5, requires_grad=False)
    # A caller that shards Dk passes the global scale; here Dk = 4 but scale of Dk = 16.
    ref = local_attention_full(q * (0.25 / 0.5), k, v, 6)
    torch.testing.assert_close(local_attention_full(q, k, v, 6, scale=0.25), ref)
    torch.testing.assert_close(local_attention_chunked(q, k, v, 6, 5, scale=0.25), ref)
    torch.testing.assert_close(local_attention_banded(q, k, v, 6, 5, scale=0.25), ref)
    # the model's entry point is the banded kernel, chunked (S3) or not
    assert torch.equal(local_attention(q, k, v, 6), local_attention_banded(q, k, v, 6))
    assert torch.equal(local_attention(q, k, v, 6, chunk=0), local_attention_banded(q, k, v, 6))
    assert torch.equal(local_attention(q, k, v, 6, chunk=8), local_attention_banded(q, k, v, 6, 8))
    torch.testing.assert_close(local_attention(q, k, v, 6, chunk=8), local_attention_full(q, k, v, 6))


def test_leading_dims_and_float32():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 70, 8, generator=g) for _ in range(3))
    out = local_attention_chunked(q, k, v, 9, 16)
    assert out.shape == (2, 3, 70, 8) and out.dtype == torch.float32
    torch.testing.assert_close(out, local_attention_full(q, k, v, 9), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(window=-1, chunk=4), "window"),
        (dict(window=2.5, chunk=4), "window"),
        (dict(window=2, chunk=0), "chunk"),
        (dict(window=2, chunk=-3), "chunk"),
    ],
)
def test_invalid_arguments(kwargs, match):
    q, k, v, _ = _inputs(10, 1, 2, 2, seed=0, requires_grad=False)
    with pytest.raises(ValueError, match=match):
        local_attention_chunked(q, k, v, **kwargs)


def test_shape_mismatch_is_rejected():
    q, k, v, _ = _inputs(10, 1, 2, 2, seed=0, requires_grad=False)
    with pytest.raises(ValueError, match="same length"):
        local_attention_full(q, k[..., :9, :], v, 2)
    with pytest.raises(ValueError, match="last dim"):
        local_attention_chunked(q, k[..., :1], v, 2, 4)


def test_chunked_never_builds_an_n_by_n_tensor():
    n, w, c, heads, d = 600, 10, 32, 2, 4
    q, k, v, grad_out = _inputs(n, heads, d, d, seed=1, dtype=torch.float32)
    with LargestOutput() as seen:
        out = local_attention_chunked(q, k, v, w, c)
        out.backward(grad_out)
    # Forward and backward alike: nothing beyond one score block or one (H, N, D) tensor.
    assert seen.largest <= max(heads * c * (c + 2 * w), heads * n * d)
    assert seen.largest < n * n
    with LargestOutput() as seen_full:
        local_attention_full(q, k, v, w).backward(grad_out)
    assert seen_full.largest >= heads * n * n  # the check above can see an N x N tensor


def test_saved_bytes_chunked_below_full():
    n, w, c, d, heads = 2048, 32, 128, 16, 2
    q, k, v, _ = _inputs(n, heads, d, d, seed=2, dtype=torch.float32)
    full = saved_activation_bytes(local_attention_full, q, k, v, w)
    chunked = saved_activation_bytes(local_attention_chunked, q, k, v, w, c)
    # Both save the scaled q (H N Dk fp32); k and v are the inputs (not counted).
    # Full: the (H, N, N) fp32 softmax and the (N, N) bool mask.
    assert full == 4 * heads * n * d + 4 * heads * n * n + n * n
    # Chunked: each block's (H, e - s, ke - ks) fp32 softmax, nothing else.
    blocks = sum((e - s) * (ke - ks) for s, e, ks, ke in chunk_blocks(n, w, c))
    assert blocks <= n * (c + 2 * w)
    assert chunked == 4 * heads * n * d + 4 * heads * blocks
    assert full / chunked > 10


def test_saved_bytes_known_ops():
    n = 1000
    x = torch.randn(n, dtype=F64, requires_grad=True)  # a leaf that requires grad
    const = torch.randn(n, dtype=torch.float32)  # a leaf without grad
    with SavedTensorBytes() as s:
        y = x.exp()  # saves its output y: 8 n bytes
        z = y * y  # saves y twice: same storage, nothing new
        t = y[: n // 2].sin()  # saves a view of y: same storage, nothing new
        u = x * x  # saves x (an input leaf): not counted
        w = x.sin()  # saves x: not counted
        m = x * const  # saves const (needed for dx): 4 n bytes
        (z.sum() + t.sum() + u.sum() + w.sum() + m.sum()).backward()
    assert s.nbytes == 8 * n + 4 * n
    assert s.n_storages == 2
    assert s.n_saved >= 7

    # A saved view keeps its whole storage alive: counted at full size.
    with SavedTensorBytes() as s2:
        a = x * 2.0  # a mul by a Python number saves no tensor
        a[:10].sin()  # saves a 10-element view of the 1000-element a
    assert s2.nbytes == 8 * n

    # Explicit exclusion (e.g. the data batch) and the one-call helper.
    with SavedTensorBytes(exclude=[const]) as s3:
        x * const
    assert s3.nbytes == 0
    assert saved_activation_bytes(torch.exp, x) == 8 * n
    assert saved_activation_bytes(lambda a, b: a * b, x, x.detach().clone()) == 8 * n
    # A non-view alias of an input (detach) shares its storage: the helper knows its
    # arguments and excludes it; the bare context manager needs it in ``exclude``.
    assert saved_activation_bytes(lambda a: a * a.detach(), x) == 0
    with SavedTensorBytes() as s4:
        x * x.detach()
    assert s4.nbytes == 8 * n
    with SavedTensorBytes(exclude=[x]) as s5:
        x * x.detach()
    assert s5.nbytes == 0

    # Linear saves its input (the non-leaf x * 1.0: counted) and its weight (3 n
    # float64 parameters: not counted).
    lin = torch.nn.Linear(n, 3, dtype=F64)
    assert saved_activation_bytes(lambda a: lin(a * 1.0), x) == 8 * n
    assert saved_activation_bytes(lin, x * 1.0) == 8 * n


def test_saved_bytes_sparse_tensor():
    n = 50
    idx = torch.tensor([[0, 1, 2], [1, 2, 3]])
    adj = torch.sparse_coo_tensor(idx, torch.ones(3, dtype=F64), (n, n), check_invariants=True).coalesce()
    h = torch.randn(n, 4, dtype=F64, requires_grad=True)
    with SavedTensorBytes() as s:
        torch.sparse.mm(adj, h * 1.0)
    assert s.nbytes >= 3 * 8 + 2 * 3 * 8  # values + int64 indices of adj are counted


# ----------------------------------------------------------------- banded kernel
BANDED_CASES = [
    # (N, window, chunk, heads, Dk, Dv); primes for N, chunk and window where it matters
    (101, 5, None, 2, 8, 4),  # one block
    (101, 5, 16, 2, 8, 4),  # N not a multiple of C
    (257, 17, 64, 1, 5, 7),  # one-row last chunk
    (97, 13, 7, 2, 6, 6),  # w > C, all prime
    (53, 61, 7, 3, 4, 3),  # w >= N
    (53, 61, None, 3, 4, 3),  # w >= N, one block
    (53, 52, 11, 1, 4, 3),  # w = N - 1: plain full attention
    (41, 3, 64, 2, 3, 5),  # C >= N
    (127, 0, 16, 2, 8, 8),  # w = 0
    (127, 0, None, 1, 3, 2),  # w = 0, one block
    (1, 0, 1, 1, 1, 1),  # N = 1
    (1, 10, None, 2, 3, 2),  # N = 1, w larger
    (2, 1, 1, 1, 2, 2),  # N = 2
    (67, 1, 1, 2, 4, 4),  # C = 1
    (89, 2, 3, 2, 4, 4),  # C = w + 1
]


def _banded_random_cases(count=20, seed=4321):
    rng = random.Random(seed)
    return [
        (rng.randint(1, 300), rng.randint(0, 80), rng.choice([None, rng.randint(1, 120)]),
         rng.randint(1, 3), rng.randint(1, 16), rng.randint(1, 16))
        for _ in range(count)
    ]  # fmt: skip


@pytest.mark.parametrize("n,window,chunk,heads,dk,dv", BANDED_CASES + _banded_random_cases(), ids=str)
def test_banded_equals_full_forward_and_gradients(n, window, chunk, heads, dk, dv):
    q, k, v, grad_out = _inputs(n, heads, dk, dv, seed=n * 1000 + window + 7)
    full = _out_and_grads(lambda *a: local_attention_full(*a, window), q, k, v, grad_out)
    banded = _out_and_grads(lambda *a: local_attention_banded(*a, window, chunk), q, k, v, grad_out)
    for name, a, b in zip(("out", "dq", "dk", "dv"), full, banded):
        assert a.shape == b.shape, name
        torch.testing.assert_close(b, a, atol=1e-10, rtol=0, msg=name)


@pytest.mark.parametrize("n,window,chunk", [(11, 2, 3), (11, 2, None), (7, 0, 2), (5, 9, 2), (8, 3, 1), (9, 8, 4)])
def test_banded_gradcheck(n, window, chunk):
    # Forward and backward are written by hand: check them against finite differences.
    q, k, v, _ = _inputs(n, 2, 3, 2, seed=n + window)
    assert torch.autograd.gradcheck(lambda a, b, c: local_attention_banded(a, b, c, window, chunk), (q, k, v))


def test_banded_broadcast_leading_dims_and_partial_grads():
    g = torch.Generator().manual_seed(4)
    n, w, c = 47, 6, 8
    q = torch.randn(2, 3, n, 5, generator=g, dtype=F64, requires_grad=True)
    k = torch.randn(3, n, 5, generator=g, dtype=F64, requires_grad=True)
    v = torch.randn(1, 1, n, 4, generator=g, dtype=F64, requires_grad=True)
    grad_out = torch.randn(2, 3, n, 4, generator=g, dtype=F64)
    full = _out_and_grads(lambda *a: local_attention_full(*a, w), q, k, v, grad_out)
    for chunk in (None, c):
        banded = _out_and_grads(lambda *a, chunk=chunk: local_attention_banded(*a, w, chunk), q, k, v, grad_out)
        for a, b in zip(full, banded):
            assert a.shape == b.shape
            torch.testing.assert_close(b, a, atol=1e-10, rtol=0)
    _one_input_grads_match(lambda *x: local_attention_banded(*x, w, c), n, w, k, v, grad_out, g)


def test_banded_float32():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 71, 8, generator=g) for _ in range(3))
    out = local_attention_banded(q, k, v, 9, 16)
    assert out.shape == (2, 3, 71, 8) and out.dtype == torch.float32
    torch.testing.assert_close(out, local_attention_full(q, k, v, 9), atol=1e-5, rtol=1e-5)


def test_band_groups_cover_every_query_once():
    for n, w, c in [(10, 3, 4), (7, 20, 3), (5, 0, 9), (1, 0, 1), (13, 4, 13), (300, 8, None), (301, 8, 40), (64, 40, 7)]:
        r = block_rows(n, w, c)
        assert 1 <= r <= n and (c is None or r <= c)
        rows = []
        for s, nb, rr in band_groups(n, w, c):
            assert nb == 1 or rr == r  # only the last, shorter block stands alone
            assert c is None or nb * rr <= max(c, r)  # a chunk bounds a group's rows
            rows.extend(range(s, s + nb * rr))
        assert rows == list(range(n))


def test_banded_kernel_count_does_not_grow_with_the_window():
    """The point of the blocked kernel: the ops of forward + backward do not depend on
    w (the per-offset baseline's grow as 2w + 1); only the edge masks and the
    overlap-add slices are extra, a handful."""

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += not func.is_view  # views launch nothing
            return func(*args, **(kwargs or {}))

    baseline = load_script("attention_baselines")
    ops = {}
    for name, fn in (("blocked", local_attention_banded), ("per_offset", baseline.local_attention_per_offset)):
        for w, heads in ((2, 2), (8, 2), (32, 2), (8, 8)):
            q, k, v, grad_out = _inputs(4096, heads, 8, 8, seed=w, dtype=torch.float32)
            with Count() as seen:
                fn(q, k, v, w).backward(grad_out)
            ops[name, w] = ops.get((name, w), seen.n)
            ops[name, w, heads] = seen.n
    # one batched product per group for all heads: the count depends on neither
    assert ops["blocked", 2] == ops["blocked", 8] == ops["blocked", 32] == ops["blocked", 8, 8], ops
    assert ops["per_offset", 32] > 2 * ops["per_offset", 8] > 2 * ops["blocked", 8], ops


def test_the_per_offset_baseline_is_exact_and_covers_the_window():
    """scripts/attention_baselines.py: the former kernel, still the same math, so the
    benchmarks time a correct baseline."""
    baseline = load_script("attention_baselines")
    for n, w, c in [(10, 3, 4), (7, 20, 3), (5, 0, 9), (1, 0, 1), (13, 4, 13)]:
        pairs = set()
        for s in range(0, n, c):
            e = min(n, s + c)
            for o, d, lo, hi in baseline.band_offsets(s, e, n, w):
                assert s <= lo < hi <= e and o - d == (band_width(n, w) - 1) // 2
                pairs |= {(i, i + d) for i in range(lo, hi)}
        assert pairs == {(i, j) for i in range(n) for j in range(n) if abs(i - j) <= w}
    for n, w, c in [(53, 5, 7), (40, 61, None), (89, 2, 3)]:
        q, k, v, grad_out = _inputs(n, 2, 4, 3, seed=n)
        full = _out_and_grads(lambda *a, w=w: local_attention_full(*a, w), q, k, v, grad_out)
        old = _out_and_grads(lambda *a, w=w, c=c: baseline.local_attention_per_offset(*a, w, c), q, k, v, grad_out)
        for a, b in zip(full, old):
            torch.testing.assert_close(b, a, atol=1e-10, rtol=0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(window=-1, chunk=4), "window"),
        (dict(window=2.5, chunk=4), "window"),
        (dict(window=2, chunk=-3), "chunk"),
        (dict(window=2, chunk=1.5), "chunk"),
    ],
)
def test_banded_invalid_arguments(kwargs, match):
    q, k, v, _ = _inputs(10, 1, 2, 2, seed=0, requires_grad=False)
    with pytest.raises(ValueError, match=match):
        local_attention_banded(q, k, v, **kwargs)


def test_banded_never_builds_anything_n_by_window_by_d():
    n, w, c, heads, d = 600, 10, 32, 2, 4
    q, k, v, grad_out = _inputs(n, heads, d, d, seed=1, dtype=torch.float32)
    for chunk in (None, c):
        with LargestOutput() as seen:
            local_attention_banded(q, k, v, w, chunk).backward(grad_out)
        # nothing beyond one (H, N + 2w, D) padded tensor or the (H, N, R + 2w) block
        # scores (R = block_rows <= max(2w, 16), so at most twice the probabilities):
        # no gathered (N, 2w + 1, D) window, no N x N
        r = block_rows(n, w, chunk)
        assert seen.largest <= max(heads * (n + 2 * w) * d, heads * n * (r + 2 * w))
        assert r + 2 * w <= 2 * (2 * w + 1)


@pytest.mark.parametrize("chunk", [None, 128, 37])
def test_banded_saved_bytes_are_linear_in_n_and_match_the_formula(chunk):
    w, d, heads = 8, 16, 4
    measured = {}
    for n in (1500, 3000, 6000):
        q, k, v, _ = _inputs(n, heads, d, d, seed=n, dtype=torch.float32)
        measured[n] = saved_activation_bytes(local_attention_banded, q, k, v, w, chunk)
        # the scaled q (H N Dk fp32) and the (H, N, 2w + 1) fp32 probabilities; k and v
        # are the inputs (not counted); no mask
        assert measured[n] == 4 * heads * n * d + 4 * heads * n * (2 * w + 1)
    assert measured[3000] == 2 * measured[1500] and measured[6000] == 2 * measured[3000]


def test_saved_bytes_banded_below_chunked_below_full():
    n, w, c, d, heads = 2048, 32, 128, 16, 2
    q, k, v, _ = _inputs(n, heads, d, d, seed=2, dtype=torch.float32)
    full = saved_activation_bytes(local_attention_full, q, k, v, w)
    chunked = saved_activation_bytes(local_attention_chunked, q, k, v, w, c)
    banded = saved_activation_bytes(local_attention_banded, q, k, v, w, c)
    assert banded == 4 * heads * n * d + 4 * heads * n * (2 * w + 1)
    # the probabilities alone: (C + 2w) / (2w + 1) fewer than chunked, N / (2w + 1) than full
    probs = banded - 4 * heads * n * d
    assert (chunked - 4 * heads * n * d) / probs > (c + 2 * w) / (2 * w + 1) * 0.9
    assert full > chunked > banded


def _sharded_banded_worker(rank, world, n, window, chunk, heads, dk, dv):
    """Each rank holds an equal slice of Dk and Dv (as S5 splits every head) and sums
    its partial scores over the group before the softmax, with the global scale."""
    q, k, v, grad_out = _inputs(n, heads, dk, dv, seed=99)
    sk, sv = slice(rank * dk // world, (rank + 1) * dk // world), slice(rank * dv // world, (rank + 1) * dv // world)
    ql, kl, vl = (t.detach()[..., sl].clone().requires_grad_(True) for t, sl in ((q, sk), (k, sk), (v, sv)))
    group = torch.distributed.group.WORLD
    out = local_attention_banded(ql, kl, vl, window, chunk, 1 / math.sqrt(dk), lambda t: group_sum(t, group))
    grads = torch.autograd.grad(out, (ql, kl, vl), grad_out[..., sv])
    return {"sk": sk, "sv": sv, "out": out.detach(), "grads": grads}


@pytest.mark.dist
@pytest.mark.parametrize("world,n,window,chunk", [(2, 53, 5, 7), (2, 29, 40, None), (4, 61, 3, None)])
def test_sharded_banded_equals_full(tmp_path, world, n, window, chunk):
    heads, dk, dv = 2, 8, 12
    results = run_world(_sharded_banded_worker, world, tmp_path, n, window, chunk, heads, dk, dv)
    q, k, v, grad_out = _inputs(n, heads, dk, dv, seed=99)
    out, dq, dk_, dv_ = _out_and_grads(lambda *a: local_attention_full(*a, window), q, k, v, grad_out)
    for r in results:
        sk, sv = r["sk"], r["sv"]
        torch.testing.assert_close(r["out"], out[..., sv], atol=1e-10, rtol=0)
        for got, ref in zip(r["grads"], (dq[..., sk], dk_[..., sk], dv_[..., sv])):
            torch.testing.assert_close(got, ref, atol=1e-10, rtol=0)


_CUDA = torch.cuda.is_available()
_DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not _CUDA, reason="needs a CUDA GPU")]),
]


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,window,chunk", [(2737, 8, None), (1000, 32, 256), (300, 8, 37)])
def test_banded_numerics_no_worse_than_full_attention_in_the_same_dtype(device, dtype, n, window, chunk):
    """The kernel in fp32 and bf16 (on the GPU where there is one) against full masked
    attention in fp64 on the same (rounded) inputs: output and every gradient no further
    from it than full masked attention run in the same dtype on the same device (twice
    its error, or 1e-5 of the largest magnitude, whichever is larger)."""
    q, k, v, grad_out = _inputs(n, 4, 8, 8, seed=n + window)
    low = [t.detach().to(device, dtype).requires_grad_(True) for t in (q, k, v)]
    g_low = grad_out.to(device, dtype)
    exact = [t.detach().double().cpu().requires_grad_(True) for t in low]
    ref = _out_and_grads(lambda *a: local_attention_full(*a, window), *exact, g_low.double().cpu())
    got = _out_and_grads(lambda *a: local_attention_banded(*a, window, chunk), *low, g_low)
    peer = _out_and_grads(lambda *a: local_attention_full(*a, window), *low, g_low)
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), ref, got, peer):
        assert b.dtype == dtype and b.device.type == device, name
        err, peer_err = ((x.double().cpu() - a).abs().max().item() for x in (b, c))
        assert err <= max(2 * peer_err, 1e-5 * a.abs().max().item()), (name, err, peer_err)
