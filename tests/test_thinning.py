"""Binomial thinning of the Hi-C counts a training step reads (``train.hic_keep_min``).

Referees: the binomial law (a count n kept with probability p has mean np and variance
np(1 - p)), the uniform law of the kept fraction (scipy's Kolmogorov-Smirnov test), the
whole batch's own draw (each cell thinned alone or in another batch or order gives the
same rows: what data parallelism relies on), the counts as given (keep_min 1), the hash
written out in Python's exact integers (the tensors' wrapping int32 arithmetic, and the
compiled loop's masked uint64 arithmetic), scipy's
rows of the CSR matrix for the device's padded rows, and the CPU allocator's peak for
the room the device keeps for thinning.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from scipy import stats

from ampflow.base.errors import InputError
from ampflow.contract.config import TrainConfig
from ampflow.train import thinning
from ampflow.train.thinning import FRACTION_KEY, THINNING_STREAM, cell_hashes, check_integer_counts, keep_fractions, thin_rows

GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(params=["tensors", "compiled"])
def host_path(request, monkeypatch):
    """:func:`thin_rows` by the tensor kernels (:func:`thin_entries`) or by the compiled
    loop (numba), whatever the batch's size."""
    if request.param == "compiled":
        pytest.importorskip("numba")
    monkeypatch.setattr(thinning, "COMPILE_ABOVE", 0 if request.param == "compiled" else float("inf"))
    monkeypatch.setattr(thinning.THIN_CSR, "_compiled", None)
    return request.param


def counts(n_cells=6, n_features=400, seed=0) -> sp.csr_matrix:
    rng = np.random.default_rng(seed)
    dense = rng.poisson(rng.uniform(0.2, 30, size=(n_cells, 1)) * rng.random((1, n_features)), size=(n_cells, n_features))
    return sp.csr_matrix(dense.astype(np.float32))


def test_keep_min_one_is_the_counts_as_given():
    rows = counts()
    assert thin_rows(rows, np.arange(6), 1.0, seed=0, step=5) is rows


def test_a_cells_draw_is_its_own_whatever_its_batch_or_order():
    """Row i of a batch is thinned by cell i's draws for the step alone: the batch
    of six, its two halves, and the six in reverse order give every cell the same row;
    another step or seed gives other rows."""
    rows, cells = counts(), np.array([11, 3, 7, 40, 2, 9])
    whole = thin_rows(rows, cells, 0.3, seed=4, step=17).toarray()
    halves = np.vstack([thin_rows(rows[:2], cells[:2], 0.3, 4, 17).toarray(), thin_rows(rows[2:], cells[2:], 0.3, 4, 17).toarray()])
    reverse = thin_rows(rows[::-1], cells[::-1], 0.3, 4, 17).toarray()[::-1]
    np.testing.assert_array_equal(whole, halves)
    np.testing.assert_array_equal(whole, reverse)
    for other in (thin_rows(rows, cells, 0.3, 4, 18), thin_rows(rows, cells, 0.3, 5, 17)):
        assert not np.array_equal(other.toarray(), whole)


def test_thinned_counts_are_whole_numbers_within_the_cells_own():
    rows = counts()
    thinned = thin_rows(rows, np.arange(6), 0.2, seed=1, step=0)
    a, b = rows.toarray(), thinned.toarray()
    assert (b >= 0).all() and (b <= a).all() and (b == np.floor(b)).all()
    assert thinned.dtype == rows.dtype and thinned.nnz == np.count_nonzero(b) and b.sum() < a.sum()
    assert rows.toarray().sum() == a.sum()  # the input is not touched


def test_each_count_is_binomial_given_the_cells_fraction():
    """One cell of 20,000 features holding 50 contacts each: the kept counts' variance is
    the binomial's n p (1 - p) at the kept fraction p, not 0 (every count scaled alike)
    nor that of a Poisson resampling (n p)."""
    n = 50
    rows = sp.csr_matrix(np.full((1, 20_000), n, dtype=np.float32))
    for step in range(5):
        kept = thin_rows(rows, np.array([0]), 0.1, seed=0, step=step).toarray().ravel()
        p = kept.mean() / n
        assert 0.1 <= p <= 1.0
        np.testing.assert_allclose(kept.var(), n * p * (1 - p), rtol=0.06)


def test_single_contacts_and_larger_counts_are_kept_at_the_same_rate():
    """Counts of 1 (drawn as uniforms below p) and counts of 50 (binomial draws) of one
    cell keep the same share p of their contacts: the two shares agree within four
    standard errors of the binomial law, on every step."""
    rows = sp.csr_matrix(np.concatenate([np.ones(40_000), np.full(800, 50.0)]).astype(np.float32)[None, :])
    for step in range(5):
        kept = thin_rows(rows, np.array([9]), 0.1, seed=3, step=step).toarray().ravel()
        ones, fifties = kept[:40_000], kept[40_000:]
        assert set(np.unique(ones)) <= {0.0, 1.0}
        p1, p50 = ones.mean(), fifties.sum() / (50 * 800)
        se = np.sqrt(p1 * (1 - p1) / 40_000 + p50 * (1 - p50) / 40_000)
        assert abs(p1 - p50) <= 4 * se + 1e-12, (step, p1, p50)


def test_the_kept_fraction_is_uniform_over_the_range():
    """Over 400 steps one cell's kept fraction follows U(keep_min, 1): Kolmogorov-Smirnov
    against that law passes, and against U(0, 1) fails."""
    rows = sp.csr_matrix(np.full((1, 2_000), 100, dtype=np.float32))
    total = rows.sum()
    fractions = np.array([thin_rows(rows, np.array([3]), 0.4, seed=2, step=s).sum() / total for s in range(400)])
    assert stats.kstest(fractions, stats.uniform(loc=0.4, scale=0.6).cdf).pvalue > 1e-3
    assert stats.kstest(fractions, stats.uniform(loc=0.0, scale=1.0).cdf).pvalue < 1e-6


def test_counts_that_are_not_whole_numbers_are_refused_by_cell():
    rows = counts(n_cells=3)
    check_integer_counts(rows, ["a", "b", "c"])
    rows = rows.tolil()
    rows[1, 5] = 2.5
    with pytest.raises(InputError, match=r"train.hic_keep_min: .*cell 'b' has one") as err:
        check_integer_counts(rows.tocsr(), ["a", "b", "c"], path="hic.h5ad")
    assert "(value: 2.5)" in str(err.value) and "hic.h5ad" in str(err.value)


@pytest.mark.parametrize("bad", [0, -0.5, 1.5, float("nan"), True, "0.5", None])
def test_bad_keep_min_names_the_key_and_value(bad):
    with pytest.raises(InputError, match="train.hic_keep_min") as err:
        TrainConfig(hic_keep_min=bad)
    assert bad is None or f"(value: {bad!r})" in str(err.value)


def fmix32(x: int) -> int:
    """MurmurHash3's 32-bit finaliser in Python's exact integers."""
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def mix(h: int, key: int) -> int:
    return fmix32(h ^ ((key & 0xFFFFFFFF) * 0x9E3779B1 & 0xFFFFFFFF))


def kept_by_hand(count: int, cell: int, col: int, keep_min: float, seed: int, step: int) -> int:
    """One stored count thinned with the hash written out: the cell's word from the
    stream, seed, step and cell; its fraction from that word; each contact's uniform from
    the cell's word, the feature and the contact's number (its first: the feature's word)."""
    h = THINNING_STREAM
    for word in (seed & 0xFFFFFFFF, seed >> 32, step & 0xFFFFFFFF, step >> 32, cell):
        h = mix(h, word)
    p = keep_min + (1 - keep_min) * (mix(h, FRACTION_KEY) >> 8) * 2.0**-24
    entry = mix(h, col)
    words = [entry] + [mix(entry, t) for t in range(1, count)]
    return sum((w >> 8) * 2.0**-24 < p for w in words)


def test_the_draws_are_the_hash_written_out_in_exact_integers(host_path):
    """The int32 tensors' wrapping products and masked shifts compute the same words as
    Python's unbounded integers, for seeds and steps past 32 bits too: every thinned count
    of 300 cells over 3 steps equals the count thinned by hand."""
    rows = counts(n_cells=300, n_features=40, seed=5)
    cells = np.arange(300) * 7919 + 3
    for seed, step in ((0, 0), (123456789012, 7), (3, 2**33 + 5)):
        got = thin_rows(rows, cells, 0.25, seed, step).toarray()
        coo = rows.tocoo()
        want = np.zeros(rows.shape, dtype=np.float32)
        for i, j, n in zip(coo.row, coo.col, coo.data):
            want[i, j] = kept_by_hand(int(n), int(cells[i]), int(j), 0.25, seed, step)
        np.testing.assert_array_equal(got, want)
    fractions = keep_fractions(cell_hashes(torch.as_tensor(cells), 1, 2), 0.25).numpy()
    assert fractions.min() >= 0.25 and fractions.max() < 1.0 and len(np.unique(fractions)) == 300


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
def test_the_devices_padded_rows_thin_as_the_host_rows(device, host_path):
    """Referee: the host's CSR rows thinned by :func:`thin_rows`, for rows of every length
    (empty ones and one with counts up to 60 included), in two batches and orders; the
    device reads nothing back to size its draws (they are summed on the host)."""
    from ampflow.train.device_cells import DeviceCells

    rng = np.random.default_rng(1)
    dense = rng.poisson(0.4, size=(40, 53)).astype(np.float32)
    dense[[4, 30]] = 0
    dense[9] = rng.integers(0, 60, size=53)
    mat = sp.csr_matrix(dense)
    cells = DeviceCells(mat, device, torch.bfloat16, thinned=True)
    for rows in ([9, 4, 0, 39, 30, 9, 12], list(range(40))[::-1]):
        out = torch.full((len(rows), 53), -1.0, device=device)
        cells.densify(torch.as_tensor(rows, device=device), out, (0.3, 11, 5), np.array(rows))
        np.testing.assert_array_equal(out.cpu().numpy(), thin_rows(mat[rows], np.array(rows), 0.3, 11, 5).toarray())
    plain = torch.empty(len(rows), 53, device=device)
    cells.densify(torch.as_tensor(rows, device=device), plain)
    np.testing.assert_array_equal(plain.cpu().numpy(), mat[rows].toarray())


def test_the_room_kept_for_thinning_holds_the_allocators_peak():
    """The device keeps room for thinning a batch (:func:`thinning_bytes`): the CPU
    allocator's peak while a batch is densified and thinned, above what was held before,
    stays within it, and above half of it (the room is not wasted), for single contacts and
    for counts drawn one by one."""
    from ampflow.train.device_cells import DeviceCells, thinning_bytes
    from ampflow.train.measured_memory import AllocatorTrace

    rng = np.random.default_rng(2)
    for lam in (0.05, 3.0):
        mat = sp.csr_matrix(rng.poisson(lam, size=(64, 20_000)).astype(np.float32))
        cells = DeviceCells(mat, "cpu", thinned=True)
        rows = np.arange(64)
        idx, out = torch.as_tensor(rows), torch.empty(64, 20_000)
        cells.densify(idx, out)  # the scratch row buffer, held between batches, allocated first
        with AllocatorTrace() as trace:
            cells.densify(idx, out, (0.3, 0, 0), rows)
        room = thinning_bytes(mat, 64)
        assert room == cells.thinning_bytes(rows)
        assert 0.5 * room <= trace.peak <= room, (lam, trace.peak, room)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
def test_thinning_on_the_device_reads_nothing_back(device):
    """The draws are sized on the host: densifying and thinning a batch dispatches no
    scalar read (``_local_scalar_dense``, what ``.item()`` and an unsized
    ``repeat_interleave`` or ``nonzero`` call on a GPU) and no copy to the host; referee:
    the same counter sees a scalar read."""
    from helpers import SyncCount

    from ampflow.train.device_cells import DeviceCells

    mat = sp.csr_matrix(np.random.default_rng(3).poisson(1.5, size=(30, 200)).astype(np.float32))
    cells = DeviceCells(mat, device, thinned=True)
    rows = np.array([4, 0, 29, 7])
    idx, out = torch.as_tensor(rows, device=device), torch.empty(4, 200, device=device)
    with SyncCount() as count:
        cells.densify(idx, out, (0.3, 0, 2), rows)
    assert not count.syncs, list(count.syncs)[:1]
    with SyncCount() as count:
        int(idx.sum())
    assert count.syncs
