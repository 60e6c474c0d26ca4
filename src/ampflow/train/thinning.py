"""Binomial thinning of the Hi-C counts a training step reads (``train.hic_keep_min``).

Each training step reads each of its cells as if sequenced less deeply: the cell keeps
each of its contacts with a probability p, drawn per cell and step uniformly from
``[keep_min, 1]``, so a feature's count n becomes a Binomial(n, p) draw. A cell is then
never seen twice with the same counts, and the encoder cannot place a training cell by
its own exact contacts, which cells of a new batch (sequenced to another depth) do not
share. The decoder reconstructs the thinned counts: a thinned cell is a shallower
sample of the same cell, and the decoder's means scale with the cell's own contacts per
stratum.

The draws are counter-based: every uniform is a hash of (seed, step, cell, feature,
which of the feature's contacts), never the state of a generator. So a cell's draws
depend on nothing but those keys: not on which other cells share its batch or its
process (each data-parallel rank thins its own rows exactly as one process thins the
whole batch), not on how its counts are stored (host CSR rows or the device's padded
rows give the same counts), and not on the device: the hash is integer arithmetic,
exact in torch on CPU and CUDA alike, so a GPU thins its resident counts itself with
the same result as the host, in a fixed number of kernels and no host round-trip. The
host thins a deep batch's CSR rows in one compiled loop over the same words
(:func:`_thin_csr`, numba): the tensor kernels hold every contact's draw, and a real
cortex cell's diagonal carries tens of thousands of contacts (the shared Lee cells at 1
Mb: 2.6 million draws a batch of 32, 47 ms by the kernels, 3 ms by the loop). A
resumed run repeats the uninterrupted one's draws (the step count is in the
checkpoint). Validation, the encoder input's fit
(:meth:`~ampflow.model.encoders.HiCInput.fit`) and the embeddings read the counts as
they are.

The hash is MurmurHash3's 32-bit finaliser (a bijection of 32-bit words with full
avalanche), applied after each key word, multiplied by the golden ratio's word, is
mixed in. The words are int32 tensors whose products wrap modulo 2**32 (two's
complement, on CPU and CUDA alike); a test holds them to the same hash in Python's
exact integers.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch

from ..base.errors import InputError
from ..base.jit import LazyJit

#: Entropy word that keeps these draws apart from every other stream seeded from train.seed.
THINNING_STREAM = 0x7448494E  # "tHIN"
#: Key word of a cell's kept fraction, apart from every feature's contact draws.
FRACTION_KEY = 0xFFFFFFFF
#: Transient bytes of thinning, per stored entry (a padded slot on the device) and per
#: further contact drawn alone: the device's room for it beside its padded rows
#: (held to the CPU allocator's peak by a test).
THINNING_BYTES_PER_SLOT = 40
THINNING_BYTES_PER_DRAW = 60

_M32 = 0xFFFFFFFF


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


def _signed32(c: int) -> int:
    """The int32 whose bits are the 32-bit word ``c``."""
    c &= _M32
    return c - (1 << 32) if c >= 1 << 31 else c


_C1, _C2, _GOLDEN = _signed32(0x85EBCA6B), _signed32(0xC2B2AE35), _signed32(0x9E3779B1)


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's finaliser of 32-bit words held in int32 (``x`` is overwritten):
    products wrap modulo 2**32 and right shifts are made logical by a mask."""
    x ^= (x >> 16) & 0xFFFF
    x *= _C1
    x ^= (x >> 13) & 0x7FFFF
    x *= _C2
    x ^= (x >> 16) & 0xFFFF
    return x


def _mix(h: torch.Tensor, key) -> torch.Tensor:
    """Hash words ``h`` (int32) with one more key word (an int or an integer tensor; its
    low 32 bits), a new tensor."""
    if isinstance(key, int):  # a scalar: nothing copied to the device
        return _fmix32(h ^ _signed32((key & _M32) * 0x9E3779B1))
    return _fmix32(key.to(torch.int32) * _GOLDEN ^ h)


def _uniform(h: torch.Tensor) -> torch.Tensor:
    """Hash words as uniforms in [0, 1) (float64, their top 24 bits)."""
    return ((h >> 8) & 0xFFFFFF).to(torch.float64) * 2.0**-24


def thresholds(fractions: torch.Tensor) -> torch.Tensor:
    """Kept fractions p as int32 thresholds: a hash word's uniform k * 2**-24
    (:func:`_uniform`) is under p exactly when k < ceil(p * 2**24)."""
    return torch.ceil(fractions * 2.0**24).to(torch.int32)


def _below(h: torch.Tensor, limits: torch.Tensor) -> torch.Tensor:
    """Whether each hash word's uniform is under its fraction (given as :func:`thresholds`)."""
    return ((h >> 8) & 0xFFFFFF) < limits


def cell_hashes(cells: torch.Tensor, seed: int, step: int) -> torch.Tensor:
    """One hash word per cell (int32) keyed by (seed, step, cell)."""
    h = torch.full_like(cells, THINNING_STREAM, dtype=torch.int32)
    seed = int(seed)
    for word in (seed & _M32, (seed >> 32) & _M32, int(step) & _M32, (int(step) >> 32) & _M32):
        h = _mix(h, word)
    return _mix(h, cells)


def keep_fractions(hashes: torch.Tensor, keep_min: float) -> torch.Tensor:
    """Each cell's kept fraction (float64), uniform over [keep_min, 1)."""
    return keep_min + (1.0 - keep_min) * _uniform(_mix(hashes, FRACTION_KEY))


def thin_entries(counts: torch.Tensor, cols: torch.Tensor, hashes: torch.Tensor, limits: torch.Tensor, sizes: tuple[int, int]) -> torch.Tensor:
    """Binomial draws of stored counts (N,) (whole numbers, any dtype; 0 for padding) at
    feature ``cols`` (N,) of the cells whose ``hashes`` and kept fractions (``limits``,
    :func:`thresholds`) (N,) are given: each of an entry's n contacts is kept when its
    uniform, the hash of the cell, the feature and the contact's number, is under the
    fraction. ``sizes`` (:func:`draw_sizes`), known on the host, sizes the draws without
    reading the device. Returns the kept counts in ``counts``' dtype.

    Most single-cell counts are 1: an entry's first contact is drawn from the entry's own
    hash, and only the further contacts of the larger counts are spread out, one per draw."""
    n_big, extra = sizes
    h = _mix(hashes, cols)
    kept = (_below(h, limits) & (counts > 0)).to(torch.int64)
    if extra:
        big = torch.nonzero_static(counts > 1, size=n_big).squeeze(1)
        more = counts.index_select(0, big).to(torch.int64) - 1
        ends = torch.cumsum(more, 0)
        entry = torch.repeat_interleave(torch.arange(n_big, device=big.device), more, output_size=extra)
        which = torch.arange(1, extra + 1, device=big.device) - (ends - more).index_select(0, entry)
        at = big.index_select(0, entry)
        hit = _below(_mix(h.index_select(0, at), which), limits.index_select(0, at))
        # kept contacts per entry from a running count: integer, exact and deterministic
        # (no atomic adds), an entry's draws being contiguous
        running = torch.cat([torch.zeros(1, dtype=torch.int64, device=big.device), torch.cumsum(hit.to(torch.int64), 0)])
        kept.index_add_(0, big, running.index_select(0, ends) - running.index_select(0, ends - more))
    return kept.to(counts.dtype)


def draw_sizes(values: np.ndarray) -> tuple[int, int]:
    """(entries with more than one contact, contacts beyond each entry's first) of the
    stored counts ``values``: the sizes :func:`thin_entries` draws."""
    big = values[values > 1]
    return len(big), int((big - 1).sum(dtype=np.float64))


def _thin_csr(data, indices, indptr, hashes, limits):
    """:func:`thin_entries` of CSR rows as one loop (compiled by numba): row r's entries
    drawn with its cell's hash word ``hashes[r]`` and threshold ``limits[r]`` (int64),
    the words held in uint64 and masked to 32 bits. Returns the kept counts (int64)."""
    m, golden = np.uint64(0xFFFFFFFF), np.uint64(0x9E3779B1)

    def mix(h, key):  # _mix: MurmurHash3's finaliser of h ^ key * golden
        x = h ^ ((np.uint64(key) * golden) & m)
        x ^= x >> np.uint64(16)
        x = (x * np.uint64(0x85EBCA6B)) & m
        x ^= x >> np.uint64(13)
        x = (x * np.uint64(0xC2B2AE35)) & m
        return x ^ (x >> np.uint64(16))

    out = np.empty(len(data), np.int64)
    for r in range(len(indptr) - 1):
        cell, limit = np.uint64(hashes[r] & 0xFFFFFFFF), limits[r]
        for e in range(indptr[r], indptr[r + 1]):
            h = mix(cell, indices[e])
            kept = 0
            for t in range(int(data[e])):  # the first contact's word is the entry's own
                w = h if t == 0 else mix(h, t)
                kept += 1 if int((w >> np.uint64(8)) & np.uint64(0xFFFFFF)) < limit else 0
            out[e] = kept
    return out


THIN_CSR = LazyJit(_thin_csr)
#: contacts beyond their entry's first above which :func:`thin_rows` runs the compiled
#: loop: below, loading it costs more than the tensor kernels take
COMPILE_ABOVE = 100_000


def thin_rows(rows: sp.csr_matrix, cells: np.ndarray, keep_min: float, seed: int, step: int) -> sp.csr_matrix:
    """``rows`` (len(cells), F) integer counts thinned: row i keeps each contact with a
    probability drawn uniformly from [keep_min, 1) for cell ``cells[i]`` and ``step``
    (``keep_min`` 1: the rows, unchanged)."""
    if keep_min >= 1.0:
        return rows
    rows = sp.csr_matrix(rows)
    hashes = cell_hashes(torch.as_tensor(np.ascontiguousarray(cells, dtype=np.int64)), seed, step)
    limits = thresholds(keep_fractions(hashes, keep_min))
    sizes = draw_sizes(rows.data)
    compiled = THIN_CSR.get() if THIN_CSR.loaded or sizes[1] >= COMPILE_ABOVE else None
    if compiled is not None:  # one pass, no tensor of every contact's draw (deep cells: ~10x faster)
        kept = compiled(rows.data, rows.indices, rows.indptr, hashes.numpy().astype(np.int64), limits.numpy().astype(np.int64)).astype(rows.data.dtype)
    else:  # the entries' own cell words and thresholds, one per stored entry
        lengths = torch.as_tensor(np.diff(rows.indptr))
        kept = thin_entries(torch.as_tensor(rows.data), torch.as_tensor(rows.indices), hashes.repeat_interleave(lengths), limits.repeat_interleave(lengths),
                            sizes).numpy()  # fmt: skip
    out = sp.csr_matrix((kept, rows.indices.copy(), rows.indptr.copy()), shape=rows.shape)
    out.eliminate_zeros()
    return out
