"""The typed sections of a plan: what its peak counts (:class:`PeakScope`), the cost model's
prediction (:class:`CostSection`) and the figures of a run on CPU (:class:`CpuSection`).

Each reads its JSON object with :meth:`from_dict` (a wrong type or an unknown key names
the key under the plan's section) and writes it with :meth:`to_dict`; a plan written
without a section (an older version, a GPU run for ``cpu``) holds None for it and writes
``{}``, as plans always have.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ..base.errors import InputError, read_fields

#: What the predicted peak counts: the allocator's peak of a steady-state training step
#: (after the first optimizer step), what the trainer measures as ``peak_bytes``
#: (:mod:`ampflow.train.measured_memory`): the largest of the end of the forward pass, the
#: backward pass and the optimizer step.
PEAK_COUNTS = (
    "parameters and buffers", "optimizer state", "the data batch", "activations saved for backward",
    "gradients", "transients of the backward pass and of the optimizer step",
)  # fmt: skip
#: What it leaves out and no profile can tell: a device adds these on top of it.
PEAK_NOT_MODELLED = ("CUDA context and kernels (runtime)", "allocator caching and fragmentation", "communication buffers (NCCL)")
#: What the predicted step seconds count (:mod:`ampflow.amp.cost.model`).
COST_COUNTS = (
    "the Hi-C decoder's strata on one device, forward and backward: banded attention FLOPs, projection, "
    "feed-forward and decode FLOPs, a per-chunk overhead per attention call and query chunk, and the "
    "latency of the tp group's collectives; not the encoders, graph, likelihood or optimizer"
)


def _int_map(d) -> dict[str, int]:
    return {str(k): int(v) for k, v in dict(d).items()}


@dataclass(frozen=True)
class PeakScope:
    """What ``predicted_peak_bytes`` counts and leaves out.

    Attributes
    ----------
    counts : tuple of str
        :data:`PEAK_COUNTS`.
    phases : dict
        The predicted peak of each phase of the step (``end_of_forward``, ``backward``,
        ``optimizer_step``), bytes.
    peak_phase : str
        The phase that holds the peak.
    data_batch_bytes : int
        One device's dense input batch, included in the peak.
    not_modelled : tuple of str
        What it leaves out (:data:`PEAK_NOT_MODELLED`); JSON ``leaves_out.not_modelled``.
    left_out_batch_bytes : int or None
        A plan of an earlier version left the data batch out of the peak and gave its
        bytes here (JSON ``leaves_out.data_batch_bytes``); None since.
    left_out_transient_bytes : dict
        Likewise, the short-lived bytes it left out by name (JSON
        ``leaves_out.transient_bytes``); empty since.
    """

    counts: tuple[str, ...] = PEAK_COUNTS
    phases: dict[str, int] = field(default_factory=dict)
    peak_phase: str = ""
    data_batch_bytes: int = 0
    not_modelled: tuple[str, ...] = PEAK_NOT_MODELLED
    left_out_batch_bytes: int | None = None
    left_out_transient_bytes: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        leaves = {"not_modelled": list(self.not_modelled)}
        if self.left_out_batch_bytes is not None:
            leaves["data_batch_bytes"] = self.left_out_batch_bytes
        if self.left_out_transient_bytes:
            leaves["transient_bytes"] = dict(self.left_out_transient_bytes)
        return {
            "counts": list(self.counts),
            "phases": dict(self.phases),
            "peak_phase": self.peak_phase,
            "data_batch_bytes": self.data_batch_bytes,
            "leaves_out": leaves,
        }

    @classmethod
    def from_dict(cls, d: dict) -> PeakScope:
        if not isinstance(d, dict):
            raise InputError("must be a JSON object", key="peak_scope", value=type(d).__name__)
        d = dict(d)
        leaves = d.pop("leaves_out", None) or {}
        known = {"not_modelled": "not_modelled", "data_batch_bytes": "left_out_batch_bytes", "transient_bytes": "left_out_transient_bytes"}
        if not isinstance(leaves, dict) or set(leaves) - set(known):
            raise InputError(f"must be an object with keys among {sorted(known)}", key="peak_scope.leaves_out", value=leaves)
        d.update({known[k]: v for k, v in leaves.items()})
        return read_fields(cls, d, "peak_scope", counts=tuple, phases=_int_map, peak_phase=str, data_batch_bytes=int,
                        not_modelled=tuple, left_out_batch_bytes=int, left_out_transient_bytes=_int_map)  # fmt: skip


@dataclass(frozen=True)
class ChunkCandidate:
    """One chunk the cost model weighed (``chunk`` None: one block): the predicted seconds
    per step (None without a Hi-C decoder), the bytes it needs (the predicted peak plus
    one query block's transient attention scores), those scores, and whether it fits."""

    chunk: int | None = None
    seconds: float | None = None
    need_bytes: int = 0
    transient_bytes: int = 0
    fits: bool = False

    def to_dict(self) -> dict:
        return {"chunk": self.chunk, "seconds": self.seconds, "need_bytes": self.need_bytes, "transient_bytes": self.transient_bytes, "fits": self.fits}

    @classmethod
    def from_dict(cls, d: dict, i: int = 0) -> ChunkCandidate:
        return read_fields(cls, d, f"cost_model.candidates[{i}]", chunk=int, seconds=float, need_bytes=int, transient_bytes=int, fits=bool)


@dataclass(frozen=True)
class CostSection:
    """The cost model's prediction of the step time.

    Attributes
    ----------
    counts : str
        :data:`COST_COUNTS`.
    constants : dict
        Rates in FLOP/s, the per-chunk overhead and collective latency in seconds, the
        band width the overhead was measured at (:class:`ampflow.amp.cost.model.CostConstants`).
    source : str
        ``"defaults"`` or ``"calibrated on <device>"``.
    terms : dict
        The prediction by term (:class:`ampflow.amp.cost.model.StepCost`): ``seconds`` and
        its parts.
    candidates : tuple of ChunkCandidate
        Each chunk considered.
    """

    counts: str = COST_COUNTS
    constants: dict[str, float] = field(default_factory=dict)
    source: str = ""
    terms: dict[str, float] = field(default_factory=dict)
    candidates: tuple[ChunkCandidate, ...] = ()

    def to_dict(self) -> dict:
        return {
            "counts": self.counts,
            "constants": dict(self.constants),
            "source": self.source,
            "terms": dict(self.terms),
            "candidates": [c.to_dict() for c in self.candidates],
        }

    @classmethod
    def from_dict(cls, d: dict) -> CostSection:
        def candidates(v):
            return tuple(ChunkCandidate.from_dict(c, i) for i, c in enumerate(v))

        return read_fields(cls, d, "cost_model", counts=str, constants=dict, source=str, terms=dict, candidates=candidates)


#: Where a CPU run's threads per process come from.
THREADS_SOURCES = ("plan", "train.threads", "default")


@dataclass(frozen=True)
class CpuSection:
    """A run on CPU (:mod:`ampflow.amp.decide.cpu`): threads per process and the host-memory
    check of the batch.

    Attributes
    ----------
    cores : int or None
        The allocation's cores (``devices.json``); None where it records none.
    processes : int
        dp x tp.
    threads : int
        Torch threads per process.
    threads_source : str
        ``"plan"`` (cores / processes), ``"train.threads"`` (the explicit setting) or
        ``"default"`` (1, no cores known).
    batch_size, host_need_bytes : int
        The batch checked and the host bytes it needs over all processes.
    host_available_bytes, host_budget_bytes : int or None
        The host's available memory and the share of it allowed; None: not recorded.
    host_fits : bool or None
        None: not checked.
    largest_fitting_batch : int or None
        When it does not fit: the largest batch that would (None: none, or it fits).
    """

    cores: int | None = None
    processes: int = 1
    threads: int = 1
    threads_source: str = "default"
    batch_size: int = 0
    host_need_bytes: int = 0
    host_available_bytes: int | None = None
    host_budget_bytes: int | None = None
    host_fits: bool | None = None
    largest_fitting_batch: int | None = None

    def __post_init__(self):
        if self.threads_source not in THREADS_SOURCES:
            raise InputError(f"must be one of {', '.join(THREADS_SOURCES)}", key="cpu.threads_source", value=self.threads_source)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> CpuSection:
        ints = dict.fromkeys(("cores", "processes", "threads", "batch_size", "host_need_bytes", "host_available_bytes",
                              "host_budget_bytes", "largest_fitting_batch"), int)  # fmt: skip
        return read_fields(cls, d, "cpu", threads_source=str, host_fits=bool, **ints)
