"""Peak-memory measurement for training steps.

On GPU: ``torch.cuda.max_memory_allocated``. On CPU, where no allocator keeps a
peak, the bytes held at the peak of a step (end of forward) are counted exactly:
tensors saved for backward (unique storages, via ``saved_tensors_hooks``) plus
parameters, gradients and optimizer state.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import torch
from torch import Tensor


def tensor_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Parameters + gradients (one per parameter, whether allocated yet or not) +
    optimizer state, in bytes."""
    n = 2 * sum(tensor_bytes(p) for p in model.parameters())
    if optimizer is not None:
        for st in optimizer.state.values():
            n += sum(tensor_bytes(v) for v in st.values() if torch.is_tensor(v))
    return n


# ----------------------------------------------------------------------------------------
# Measuring saved activations
# ----------------------------------------------------------------------------------------

_StorageKey = tuple[str, int]


def _storages(t: Tensor) -> Iterator[tuple[_StorageKey, int]]:
    """``((device, address), nbytes)`` of every storage backing ``t``."""
    if t.layout == torch.strided:
        parts: Iterable[Tensor] = (t,)
    elif t.layout == torch.sparse_coo:
        parts = (t._indices(), t._values())
    elif t.layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = (t.crow_indices(), t.col_indices(), t.values())
    elif t.layout in (torch.sparse_csc, torch.sparse_bsc):
        parts = (t.ccol_indices(), t.row_indices(), t.values())
    else:  # pragma: no cover - e.g. jagged layouts: count the logical size, never dedup
        yield ("id", id(t)), t.numel() * t.element_size()
        return
    for p in parts:
        st = p.untyped_storage()
        yield (str(p.device), st.data_ptr()), st.nbytes()


def _is_input(t: Tensor) -> bool:
    """True for a leaf that requires grad (a parameter or a differentiated input) or a
    view of one: such tensors exist whether or not a graph saves them."""
    root = t._base if t._base is not None else t
    return root.is_leaf and root.requires_grad


class SavedTensorBytes:
    """Context manager counting the bytes autograd saves for backward inside it.

    Every tensor that an operation saves for its backward pass (through
    ``torch.autograd.graph.saved_tensors_hooks``: built-in ops and
    ``ctx.save_for_backward`` of custom Functions) is reduced to the storage(s) backing
    it, and each storage is counted once, at its full ``nbytes``:

    * views (slices, transposes, reshapes) of one storage count once, and count the whole
      storage, because a saved view keeps all of it alive;
    * storages of leaf tensors that require grad (parameters, inputs being
      differentiated), and of views of them, are not counted: they exist without the
      graph. Neither are storages of the tensors passed as ``exclude`` (e.g. the data
      batch, which is a leaf without grad and would otherwise count). A non-view alias of
      such a leaf (``p.detach()``) is recognised only when the leaf itself is saved in the
      block or is passed in ``exclude``;
    * everything else counts, including saved constants created inside the block
      (masks, index tensors) and leaves without grad that are not excluded.

    The result is the saved-activation footprint at the end of the forward pass, i.e.
    what stays alive until backward, not the transient peak of the forward itself.
    Tensors stored on ``ctx`` as plain attributes are invisible to the hooks, and a
    storage freed during the block (a discarded branch of the graph) whose address is
    reused could be under-counted. The hooks pass tensors through unchanged, so results
    and memory are those of the unhooked run.

    Parameters
    ----------
    exclude : iterable of Tensor, optional
        Tensors whose storages are not counted.

    Attributes
    ----------
    nbytes : int
        Bytes of unique counted storages (valid inside and after the block).
    n_storages : int
        Number of unique counted storages.
    n_saved : int
        Number of save events seen (with repeats and excluded ones).

    Examples
    --------
    >>> x = torch.randn(1000, dtype=torch.float64, requires_grad=True)
    >>> with SavedTensorBytes() as saved:
    ...     y = x.exp()  # saves its output: 8000 bytes
    ...     z = y * y  # saves y twice: same storage, no more bytes
    >>> saved.nbytes
    8000
    """

    def __init__(self, exclude: Iterable[Tensor] = ()):
        self._excluded: set[_StorageKey] = {key for t in exclude for key, _ in _storages(t)}
        self._seen: dict[_StorageKey, int] = {}
        self.n_saved = 0
        self.marks: list[int] = []
        self._hooks = None

    def mark(self, *_: Any) -> None:
        """Record :attr:`nbytes` so far (e.g. after each Hi-C stratum) in :attr:`marks`."""
        self.marks.append(self.nbytes)

    def _pack(self, t: Tensor) -> Tensor:
        self.n_saved += 1
        keys = _storages(t)
        if _is_input(t):
            # Remember the storage rather than skipping the event, so a non-view alias
            # of an input seen earlier or later (e.g. ``p.detach()``) is excluded too.
            self._excluded.update(key for key, _ in keys)
        else:
            self._seen.update(keys)
        return t

    @staticmethod
    def _unpack(t: Tensor) -> Tensor:
        return t

    @property
    def nbytes(self) -> int:
        return sum(b for key, b in self._seen.items() if key not in self._excluded)

    @property
    def n_storages(self) -> int:
        return sum(1 for key in self._seen if key not in self._excluded)

    def __enter__(self) -> "SavedTensorBytes":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None


def saved_activation_bytes(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """Bytes saved for backward by ``fn(*args, **kwargs)``.

    Runs the call inside :class:`SavedTensorBytes` (see there for exactly what counts)
    and returns :attr:`SavedTensorBytes.nbytes`; the result of ``fn`` is discarded.
    Tensor arguments that are leaves requiring grad, and the parameters of ``fn`` when it
    is an ``nn.Module``, are passed as ``exclude``, so aliases of them never count.

    Parameters
    ----------
    fn : callable
        Any forward computation.
    *args, **kwargs
        Passed to ``fn``.

    Returns
    -------
    int
        Bytes of unique storages the graph saved.
    """
    inputs = [
        a for a in (*args, *kwargs.values()) if isinstance(a, Tensor) and _is_input(a)
    ]
    if isinstance(fn, torch.nn.Module):
        inputs += [p for p in fn.parameters() if p.requires_grad]
    with SavedTensorBytes(exclude=inputs) as saved:
        fn(*args, **kwargs)
    return saved.nbytes


def measured_step(model, optimizer, rna: Tensor, hic: Tensor, weights, generator=None) -> tuple[dict, int, list[int]]:
    """One optimisation step in train mode, with its memory peak.

    Returns the loss terms, the peak bytes and the bytes after each Hi-C stratum. On
    CUDA these are ``max_memory_allocated`` and ``memory_allocated``; on CPU the
    bytes saved for backward (:class:`SavedTensorBytes`, the batch excluded) plus
    :func:`state_bytes`. The trainer, the memory-model benchmark and its tests all
    measure through this one function.
    """
    cuda = rna.is_cuda
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    model.train()
    optimizer.zero_grad(set_to_none=True)
    meter = SavedTensorBytes(exclude=[rna, hic])
    marks_cuda: list[int] = []
    on_stratum = (lambda k: marks_cuda.append(torch.cuda.memory_allocated())) if cuda else meter.mark
    with meter:
        terms = model(rna, hic, weights, generator=generator, on_stratum=on_stratum)
    terms["total"].backward()
    optimizer.step()
    if cuda:
        return terms, int(torch.cuda.max_memory_allocated()), marks_cuda
    base = state_bytes(model, optimizer)
    return terms, base + meter.nbytes, [base + m for m in meter.marks]


def measured_dp_step(dp_step, model, optimizer, rna: Tensor, hic: Tensor, weights, rows: Tensor, batch_size: int,
                     generator) -> tuple[dict, int, list[int]]:  # fmt: skip
    """:func:`measured_step` for one rank of an S1 data-parallel step
    (:meth:`~ampflow.parallel.data_parallel.DataParallelStep.step` on this rank's rows
    ``rna`` / ``hic`` of a batch of ``batch_size`` cells). The peak is this rank's."""
    cuda = rna.is_cuda
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    model.train()
    meter = SavedTensorBytes(exclude=[rna, hic])
    marks_cuda: list[int] = []
    on_stratum = (lambda k: marks_cuda.append(torch.cuda.memory_allocated())) if cuda else meter.mark
    with meter:  # backward saves nothing new: the count is the forward's
        terms = dp_step.step(model, optimizer, rna, hic, weights, rows, batch_size=batch_size, generator=generator, on_stratum=on_stratum)
    if cuda:
        return terms, int(torch.cuda.max_memory_allocated()), marks_cuda
    base = state_bytes(model, optimizer)
    return terms, base + meter.nbytes, [base + m for m in meter.marks]
