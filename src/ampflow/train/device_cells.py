"""The training counts where the step can read them without the host: held on the
device as padded rows and densified there, or densified on the host into pinned memory
and copied without waiting.

Padded rows (the ELLPACK layout): each cell's nonzero columns and values, padded to the
longest row with column ``F`` (one column past the last) and value 0. Gathering a batch
is then two ``index_select`` calls and one ``scatter_`` into a ``(B, F + 1)`` buffer whose
last column is dropped: fixed shapes, no host round-trip, capturable in a CUDA graph.
A cell's columns are distinct (CSR), so the scatter writes each place once; the padding
writes zeros into the dropped column only. With ``train.hic_keep_min`` the gathered
values are thinned there too (:mod:`.thinning`: counter-based draws, the host's own), the
sizes of the draws summed on the host from counts kept per cell, so nothing is read back.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch

from .thinning import THINNING_BYTES_PER_DRAW, THINNING_BYTES_PER_SLOT, cell_hashes, keep_fractions, thin_entries, thresholds


def padded_bytes(mat: sp.csr_matrix, value_bytes: int = 4) -> int:
    """Bytes :class:`DeviceCells` holds for ``mat``: (cells x longest row) of an int64
    column and a value each."""
    width = int(np.diff(mat.indptr).max()) if mat.shape[0] else 0
    return mat.shape[0] * max(width, 1) * (8 + value_bytes)


def thinning_bytes(mat: sp.csr_matrix, batch_size: int) -> int:
    """The most transient bytes :meth:`DeviceCells.densify` takes to thin a batch of
    ``batch_size`` rows of ``mat``: the rows with the most contacts drawn alone."""
    width = int(np.diff(mat.indptr).max()) if mat.shape[0] else 0
    extra = np.sort(row_sums(mat, np.maximum(mat.data - 1, 0)))[::-1][:batch_size]
    return _thinning_bytes(min(batch_size, mat.shape[0]), max(width, 1), int(extra.sum()))


def _thinning_bytes(n_rows: int, width: int, extra: int) -> int:
    return n_rows * width * THINNING_BYTES_PER_SLOT + extra * THINNING_BYTES_PER_DRAW


def row_sums(mat: sp.csr_matrix, values: np.ndarray) -> np.ndarray:
    """Per row of ``mat``, the sum (int64) of ``values`` given for its stored entries."""
    return np.add.reduceat(np.append(values.astype(np.int64), 0), mat.indptr[:-1]) * (np.diff(mat.indptr) > 0)


class DeviceCells:
    """The rows of a CSR count matrix on ``device`` as padded rows.

    Parameters
    ----------
    mat : (n_cells, F) CSR
    device, dtype : where and in what the densified batches are made; a matrix that is
        thinned keeps its counts in float32 (whole numbers exact to 2**24), whatever
        ``dtype``, since the draws are sized by the exact counts
    """

    def __init__(self, mat: sp.csr_matrix, device, dtype=torch.float32, thinned: bool = False):
        mat = sp.csr_matrix(mat)
        mat.sort_indices()
        n, F = mat.shape
        lengths = np.diff(mat.indptr)
        width = max(int(lengths.max()) if n else 0, 1)
        cols = np.full((n, width), F, dtype=np.int64)
        vals = np.zeros((n, width), dtype=np.float32)
        # position of each stored entry within its row
        rows = np.repeat(np.arange(n), lengths)
        within = np.arange(mat.nnz) - np.repeat(mat.indptr[:-1], lengths)
        cols[rows, within] = mat.indices
        vals[rows, within] = mat.data
        self.n_features = F
        self.width = width
        self.cols = torch.as_tensor(cols).to(device)
        self.vals = torch.as_tensor(vals).to(device, torch.float32 if thinned else dtype)
        # per cell, on the host: entries holding more than one contact, and the contacts
        # past each entry's first (what thinning draws one by one)
        self.n_big, self.extra = (row_sums(mat, v) for v in ((mat.data > 1), np.maximum(mat.data - 1, 0)))
        self._scratch: dict[int, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return self.cols.numel() * self.cols.element_size() + self.vals.numel() * self.vals.element_size()

    def thinning_bytes(self, rows: np.ndarray) -> int:
        """Transient bytes of thinning rows ``rows`` (host indices) in :meth:`densify`."""
        return _thinning_bytes(len(rows), self.width, int(self.extra[rows].sum()))

    def densify(self, idx: torch.Tensor, out: torch.Tensor, thinning: tuple[float, int, int] | None = None, rows: np.ndarray | None = None) -> torch.Tensor:
        """Rows ``idx`` ((B,) long, on the device) as dense counts into ``out`` (B, F);
        with ``thinning`` (keep_min, seed, step) thinned as :func:`~.thinning.thin_rows`
        thins them, ``rows`` (the same indices on the host) sizing the draws."""
        B = idx.shape[0]
        wide = self._scratch.get(B)
        if wide is None:
            wide = self._scratch[B] = torch.zeros(B, self.n_features + 1, dtype=out.dtype, device=out.device)
        wide.zero_()
        cols, vals = self.cols.index_select(0, idx), self.vals.index_select(0, idx)
        if thinning is not None:
            keep_min, seed, step = thinning
            hashes = cell_hashes(idx, seed, step)
            limits = thresholds(keep_fractions(hashes, keep_min))
            sizes = (int(self.n_big[rows].sum()), int(self.extra[rows].sum()))
            W = self.width
            vals = thin_entries(vals.reshape(-1), cols.reshape(-1), hashes.repeat_interleave(W), limits.repeat_interleave(W), sizes).view(B, W)
        wide.scatter_(1, cols, vals.to(out.dtype))
        out.copy_(wide[:, : self.n_features])
        return out


class PinnedCopy:
    """Host-densified batches copied to the device from pinned memory without waiting
    (the path where the counts do not fit on the device): the copy runs on the stream
    while the host prepares the next batch; the pinned buffer is reused once the copy
    that read it has finished (an event per buffer)."""

    def __init__(self):
        self._pinned: dict[tuple, tuple[torch.Tensor, torch.cuda.Event | None]] = {}

    def copy(self, host: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``host`` into ``out`` (same shape) through pinned memory; asynchronous on CUDA."""
        if not out.is_cuda:
            return out.copy_(host)
        key = (tuple(host.shape), host.dtype, out.data_ptr())
        buf, done = self._pinned.get(key, (None, None))
        if buf is None:
            buf = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
        elif done is not None:
            done.synchronize()  # the previous copy from this buffer has been read
        buf.copy_(host)
        out.copy_(buf, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pinned[key] = (buf, event)
        return out
