"""Peak-memory measurement for training steps.

The peak of a step is the allocator's (:func:`measure_step`): everything allocated,
transients included. On CUDA, ``torch.cuda.max_memory_allocated`` (reset at each phase
of the step), with the allocator's requested peak (the bytes asked for, before the
caching allocator rounds each block up to a multiple of 512 B) and reserved peak (the
segments it holds, fragmentation included: what an out-of-memory error follows) from
``torch.cuda.memory_stats()`` beside it, and the bytes allocated when the step began
split into what the step holds (parameters, gradients, optimizer state, the batch) and
the rest: the persistent cuBLAS/cuBLASLt workspaces (allocated by the caching allocator
on the first matrix product of each handle and stream and kept) and the rounding of
the held tensors (:class:`StepMemory`, :mod:`ampflow.amp.memory.cuda`). On CPU, where no allocator keeps a peak, the profiler records every
allocation and free of the CPU allocator during the step (``profile_memory=True``);
summed in time order from the bytes held when the step began (parameters, buffers,
optimizer state, the batch: :func:`step_held_bytes`) they give the live-bytes curve and
its true peak (:class:`AllocatorTrace`). Tracing can slow a CPU step up to threefold, so
the trainer traces only its first steps (:data:`ampflow.train.trainer.MEASURED_STEPS`).

:class:`SavedTensorBytes` counts what autograd saves for backward (unique storages, via
``saved_tensors_hooks``): one term of the peak, used to check the attention kernels'
saved bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

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

    def __enter__(self) -> SavedTensorBytes:
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
    inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor) and _is_input(a)]
    if isinstance(fn, torch.nn.Module):
        inputs += [p for p in fn.parameters() if p.requires_grad]
    with SavedTensorBytes(exclude=inputs) as saved:
        fn(*args, **kwargs)
    return saved.nbytes


# ----------------------------------------------------------------------------------------
# The allocator's peak of a training step
# ----------------------------------------------------------------------------------------

#: The phases of a training step in order, as
#: :meth:`~ampflow.parallel.data_parallel.DataParallelStep.step` announces them
#: (``on_phase``); what comes before the first (``zero_grad``) is the phase ``"start"``.
PHASES = ("forward", "backward", "optimizer_step")
#: The mark a step's ``on_stratum`` leaves after each Hi-C stratum.
STRATUM = "stratum"
_MARK = "ampflow::mark::"


def held_bytes(*tensors: Tensor | None) -> int:
    """Bytes of the unique storages behind ``tensors`` (None entries skipped); views
    and aliases of one storage count once, at the storage's full size."""
    seen: dict[_StorageKey, int] = {}
    for t in tensors:
        if t is not None:
            seen.update(_storages(t))
    return sum(seen.values())


def step_held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *batch: Tensor) -> int:
    """What a training step finds allocated: the model's parameters and buffers, their
    gradients where they exist, the optimizer's state and the data batch (unique
    storages)."""
    tensors: list[Tensor | None] = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters()), *batch]
    if optimizer is not None:
        for st in optimizer.state.values():
            tensors += [v for v in st.values() if torch.is_tensor(v)]
    return held_bytes(*tensors)


class AllocatorTrace:
    """The CPU allocator's live bytes through a block, transients included.

    Inside the block ``torch.profiler`` records every allocation and free of the CPU
    allocator (``profile_memory=True``); on exit the ``[memory]`` events are summed in
    time order, starting from ``base`` (the bytes held when the block began, which the
    profiler does not see), into the live-bytes curve. Its maximum is the allocator's
    true peak: every tensor, saved or not, for as long as it lived.

    The profiler does not report the free of a block allocated before it started, so
    everything the block frees must have been allocated inside it (a training step
    frees its gradients first: call ``zero_grad`` before entering). It costs time: a
    few microseconds per operator, which in a step of many small operators (such as the
    per-offset attention baseline's loops) can make it up to three times slower.

    Parameters
    ----------
    base : int
        Bytes held when the block begins.

    Attributes
    ----------
    peak : int
        Largest live bytes (after the block).
    marks : list of (str, int)
        Each :meth:`mark` with the live bytes at that moment, in order.
    phase_peaks : dict of str to int
        The largest live bytes between each mark named in :data:`PHASES` (or
        ``"start"``: from the beginning) and the next such mark or the end.
    peak_phase : str
        The phase in which :attr:`peak` occurred.
    """

    def __init__(self, base: int = 0):
        self.base = int(base)
        self.peak = self.base
        self.marks: list[tuple[str, int]] = []
        self.phase_peaks: dict[str, int] = {}
        self.peak_phase = "start"
        self._prof = None

    def mark(self, label: str) -> None:
        """Leave a named mark at this moment (a zero-length profiler range)."""
        with torch.profiler.record_function(_MARK + str(label)):
            pass

    def at(self, label: str) -> list[int]:
        """Live bytes at every mark named ``label``, in order."""
        return [b for name, b in self.marks if name == label]

    def __enter__(self) -> AllocatorTrace:
        activity = torch.profiler.ProfilerActivity.CPU
        self._prof = torch.profiler.profile(activities=[activity], profile_memory=True, record_shapes=False, with_stack=False)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        prof, self._prof = self._prof, None
        prof.__exit__(*exc)
        if exc[0] is None:
            self._walk(prof.profiler.kineto_results.events())

    def _walk(self, events) -> None:
        timeline = []
        for e in events:
            name = e.name()
            if name == "[memory]":
                if e.device_type() == torch.autograd.DeviceType.CPU:
                    timeline.append((e.start_ns(), 1, int(e.nbytes()), None))
            elif name.startswith(_MARK):
                timeline.append((e.start_ns(), 0, 0, name[len(_MARK) :]))
        timeline.sort(key=lambda x: (x[0], x[1]))
        live = peak = self.base
        phase, phase_peaks, peak_phase = "start", {"start": self.base}, "start"
        for _, is_memory, nbytes, label in timeline:
            if is_memory:
                live += nbytes
                if live > phase_peaks[phase]:
                    phase_peaks[phase] = live
                if live > peak:
                    peak, peak_phase = live, phase
                continue
            self.marks.append((label, live))
            if label in PHASES:
                phase = label
                phase_peaks[phase] = max(phase_peaks.get(phase, live), live)
        self.peak, self.phase_peaks, self.peak_phase = peak, phase_peaks, peak_phase


@dataclass(frozen=True)
class StepMemory:
    """Memory of one training step on one device.

    Attributes
    ----------
    peak : int
        The allocator's peak (bytes): CPU, the live-bytes curve of
        :class:`AllocatorTrace`; CUDA, ``torch.cuda.max_memory_allocated``. Everything
        allocated counts: parameters, buffers, gradients, optimizer state, the data
        batch, saved activations and every transient.
    phases : dict of str to int
        The peak within each phase of the step (``"start"``, then :data:`PHASES`).
    peak_phase : str
        The phase holding :attr:`peak`.
    marks : tuple of int
        Bytes held after each Hi-C stratum of the forward pass.
    base : int
        Bytes held when the step began (its gradients already freed). On CUDA
        ``torch.cuda.memory_allocated()`` then: it includes the persistent cuBLAS
        workspaces (see :attr:`persistent`).
    source : str
        ``"allocator"`` (CPU profiler) or ``"cuda"``.
    requested : int or None
        CUDA only: the allocator's peak of requested bytes
        (``memory_stats()["requested_bytes.all.peak"]``, the largest over the phases):
        the bytes asked for, free of the 512 B block rounding. None on CPU, where
        :attr:`peak` already counts the bytes asked for.
    reserved : int or None
        CUDA only: the peak of reserved bytes (``"reserved_bytes.all.peak"``): the
        segments the caching allocator holds, its cache and fragmentation included.
    held : int or None
        CUDA only: the bytes of the tensors the step finds allocated
        (:func:`step_held_bytes`: parameters, buffers, gradients, optimizer state, the
        batch), counted from their storages. On CPU :attr:`base` is that count.
    base_requested : int or None
        CUDA only: requested bytes when the step began
        (``"requested_bytes.all.current"``).
    """

    peak: int
    phases: dict
    peak_phase: str
    marks: tuple
    base: int
    source: str
    requested: int | None = None
    reserved: int | None = None
    held: int | None = None
    base_requested: int | None = None

    @property
    def persistent(self) -> int:
        """Bytes allocated when the step began that are no tensor of the step (on CUDA
        ``base - held``: the cuBLAS/cuBLASLt workspaces, the 512 B rounding of the held
        tensors, anything else left allocated in the process); 0 on CPU."""
        return 0 if self.held is None else max(int(self.base) - int(self.held), 0)


def measure_step(run: Callable[..., Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer, *batch: Tensor) -> tuple[Any, StepMemory]:
    """Run one training step and measure its memory with the allocator.

    ``run(on_stratum=..., on_phase=...)`` runs the step: it must call
    ``optimizer.zero_grad(set_to_none=True)`` first (done here before measuring, so
    the gradients of the previous step are already gone when the trace starts), pass
    ``on_stratum`` to the model and call ``on_phase(name)`` as each phase of
    :data:`PHASES` begins. ``batch`` are the step's input tensors, held throughout.

    On CPU the step runs inside an :class:`AllocatorTrace` (the profiler's allocation
    timeline; slower than the bare step); on CUDA the peak statistics are reset at
    each phase and read with ``max_memory_allocated`` (no cost).

    Returns
    -------
    result
        What ``run`` returned.
    StepMemory
    """
    cuda = any(t.is_cuda for t in batch) or any(p.is_cuda for p in model.parameters())
    optimizer.zero_grad(set_to_none=True)
    if cuda:
        return _measure_cuda(run, step_held_bytes(model, optimizer, *batch))
    base = step_held_bytes(model, optimizer, *batch)
    with AllocatorTrace(base) as trace:
        result = run(on_stratum=lambda k: trace.mark(STRATUM), on_phase=trace.mark)
    memory = StepMemory(trace.peak, dict(trace.phase_peaks), trace.peak_phase, tuple(trace.at(STRATUM)), base, "allocator")
    return result, memory


#: The :func:`torch.cuda.memory_stats` keys read for a step (torch >= 2.1 has the
#: requested bytes; an older torch lacks the key and the field is None).
CUDA_STATS = ("allocated_bytes.all.peak", "requested_bytes.all.peak", "reserved_bytes.all.peak")


def _cuda_peaks() -> tuple[int, int | None, int | None]:
    """``(allocated, requested, reserved)`` peaks since the last reset."""
    st = torch.cuda.memory_stats()
    allocated = st.get(CUDA_STATS[0])
    allocated = int(torch.cuda.max_memory_allocated()) if allocated is None else int(allocated)
    requested, reserved = (st.get(k) for k in CUDA_STATS[1:])
    return allocated, None if requested is None else int(requested), None if reserved is None else int(reserved)


def _measure_cuda(run, held: int | None = None) -> tuple[Any, StepMemory]:
    """The step between peak resets at each phase; each phase's allocated peak, and
    the largest requested and reserved peaks over the phases (a reset clears every
    peak statistic, so each phase's are read before the next reset)."""
    torch.cuda.synchronize()
    base = int(torch.cuda.memory_allocated())
    base_requested = torch.cuda.memory_stats().get("requested_bytes.all.current")
    torch.cuda.reset_peak_memory_stats()
    phases: dict[str, int] = {}
    requested: list[int] = []
    reserved: list[int] = []
    marks: list[int] = []
    current = ["start"]

    def close_phase() -> None:
        allocated, req, res = _cuda_peaks()
        phases[current[0]] = allocated
        if req is not None:
            requested.append(req)
        if res is not None:
            reserved.append(res)

    def on_phase(name: str) -> None:
        close_phase()
        torch.cuda.reset_peak_memory_stats()
        current[0] = name

    result = run(on_stratum=lambda k: marks.append(int(torch.cuda.memory_allocated())), on_phase=on_phase)
    torch.cuda.synchronize()
    close_phase()
    peak_phase = max(phases, key=phases.get)
    memory = StepMemory(
        phases[peak_phase], phases, peak_phase, tuple(marks), base, "cuda",
        requested=max(requested) if requested else None,
        reserved=max(reserved) if reserved else None,
        held=held,
        base_requested=None if base_requested is None else int(base_requested),
    )  # fmt: skip
    return result, memory


def measured_step(model, optimizer, rna: Tensor, hic: Tensor, weights, generator=None, cond: Tensor | None = None,
                  hic_in: Tensor | None = None) -> tuple[dict, StepMemory]:  # fmt: skip
    """One optimisation step in train mode, as the trainer runs it in one process
    (``zero_grad``, forward, backward, ``optimizer.step()``), with its
    :class:`StepMemory` (:func:`measure_step`). The trainer, the memory-model benchmark
    and its tests all measure through :func:`measure_step`. ``hic_in``: the encoder's
    own Hi-C input (the model's), held through the step as the batch is.

    Returns
    -------
    terms : dict
        The loss terms.
    StepMemory
    """
    model.train()

    def run(on_stratum, on_phase):
        optimizer.zero_grad(set_to_none=True)
        on_phase("forward")
        terms = model(rna, hic, weights, generator=generator, on_stratum=on_stratum, cond=cond, hic_in=hic_in)
        on_phase("backward")
        terms["total"].backward()
        on_phase("optimizer_step")
        optimizer.step()
        return terms

    return measure_step(run, model, optimizer, *batch_tensors(rna, hic, hic_in))


def batch_tensors(*tensors: Tensor | None) -> tuple[Tensor, ...]:
    """The step's input tensors that exist (a copy the encoder reads may not)."""
    return tuple(t for t in tensors if t is not None)


def measured_dp_step(dp_step, model, optimizer, rna: Tensor, hic: Tensor, weights, rows: Tensor, batch_size: int,
                     generator, measure: bool = True, cond: Tensor | None = None, hic_in: Tensor | None = None,
                     ) -> tuple[dict, StepMemory | None]:  # fmt: skip
    """One rank's S1 data-parallel step
    (:meth:`~ampflow.parallel.data_parallel.DataParallelStep.step` on this rank's rows
    ``rna`` / ``hic``, batch indicators ``cond``, the encoder's own input ``hic_in``, of a batch of ``batch_size`` cells) with this rank's
    :class:`StepMemory`. ``measure=False`` runs the step unmeasured and returns None
    for the memory (on CUDA reading the allocator's peaks waits for the GPU)."""
    model.train()

    def run(on_stratum=None, on_phase=None):
        return dp_step.step(model, optimizer, rna, hic, weights, rows, batch_size=batch_size, generator=generator,
                            on_stratum=on_stratum, on_phase=on_phase, cond=cond, hic_in=hic_in)  # fmt: skip

    if measure:
        return measure_step(run, model, optimizer, *batch_tensors(rna, hic, hic_in))
    return run(), None
