"""The typed plan (``plan.json``): what the diagnosis decided and every later stage obeys.

:meth:`Plan.read` and :meth:`Plan.write` are the only code that reads or writes a plan's
JSON. The diagnosis (:mod:`ampflow.amp.decide.diagnose`) builds a :class:`Plan`;
:func:`ampflow.parallel.parallelize.parallelize` applies it to a built model (any world
size, one included); the launcher starts :attr:`Plan.world` processes; the reports show it.
Identical plans give identical bytes (:meth:`Plan.dumps`).

Format versions: 1, the strategies, mesh, chunk, memory prediction and reasons; 2 adds
``predicted_step_seconds`` and ``cost_model`` (the cost model's prediction, constants
and chunk candidates); 3 adds ``cpu`` (threads per process and the host-memory check of
the batch, for a run on CPU); 4 adds ``device``, the device the plan trains on (``cpu``
or ``cuda``), decided when the plan is made. All read: an older plan has the added keys
empty, and one without ``device`` trains where ``train.device`` says, as it always did.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..base.atomic import write_text_atomic
from ..base.errors import InputError, read_json
from .plan_sections import CostSection, CpuSection, PeakScope
from .strategies import BUILT_IN, KEY_FIRST_DECODE

PLAN_VERSION = 4
#: The devices a plan trains on; "" in a plan before version 4 (``train.device`` decides).
PLAN_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class PlannedStrategy:
    """One strategy of a plan: its S-number, name and one-line summary."""

    id: str
    name: str
    summary: str = ""

    def to_dict(self) -> dict:
        return {"id": self.id, "name": self.name, "summary": self.summary}


@dataclass(frozen=True)
class MeshShape:
    """The dp x tp degrees a plan trains on (the processes themselves are
    :class:`ampflow.parallel.mesh.Mesh`)."""

    dp: int = 1
    tp: int = 1

    def __post_init__(self):
        if self.dp < 1 or self.tp < 1:
            raise InputError("mesh degrees must be >= 1", key="mesh", value={"dp": self.dp, "tp": self.tp})

    @property
    def world(self) -> int:
        return self.dp * self.tp


@dataclass(frozen=True)
class PlanInputs:
    """What a plan was made for: the profile, the devices and the memory budget."""

    profile_hash: str = ""
    devices: int = 1
    device_memory_bytes: int = 0
    budget_fraction: float = 1.0
    budget_bytes: int = 0


@dataclass(frozen=True)
class Plan:
    """An AMP plan.

    Attributes
    ----------
    strategies : tuple of PlannedStrategy
        In the order the diagnosis chose them.
    mesh : MeshShape
        The dp x tp degrees: :attr:`world` = dp x tp is the process count, the one name
        for it (``inputs.devices`` are the devices the plan was made for).
    chunk_size : int or None
        Query chunk of the local attention (S3); None when S3 is not used.
    key_first : bool
        Key-first decode (S4).
    predicted_peak_bytes, M_base_bytes, M_stratum_bytes : int
        The memory model's per-device prediction for this plan.
    peak_scope : PeakScope or None
        What ``predicted_peak_bytes`` counts, each phase's predicted peak and what it
        leaves out (:class:`~.plan_sections.PeakScope`); None in a plan written without it.
    signals, memory_components : dict
        Evidence and the prediction's breakdown, as the diagnosis wrote them.
    fits : bool
        The predicted peak is within the budget on this mesh.
    recommended_devices : int or None
        The devices to train on: those the mesh uses (``dp x tp``) when the plan fits,
        else the fewest with which it would fit (None: none up to 1024).
    min_fitting_devices : int or None
        The fewest devices (a power of two, or the devices given) with which the plan
        fits; None when none up to 1024 does.
    predicted_step_seconds : float or None
        The cost model's seconds per step for this plan on one device (what it counts:
        :data:`~.plan_sections.COST_COUNTS`); None without a Hi-C decoder or in a version 1 plan.
    cost_model : CostSection or None
        The step time's counts, constants, source, terms and the chunk candidates
        weighed (:class:`~.plan_sections.CostSection`); None without a Hi-C decoder or
        in a version 1 plan.
    cpu : CpuSection or None
        For a run on CPU: threads per process and the host-memory check of the batch
        (:class:`~.plan_sections.CpuSection`, :mod:`ampflow.amp.decide.cpu`); None for a GPU
        run or in a plan before version 3.
    device : str
        ``"cpu"`` or ``"cuda"``: where the plan trains, decided with it (its budget, its
        ``cpu`` section and the job's allocation are for that device): ``train.device``
        ``cpu`` or ``cuda`` as set, ``auto`` CUDA when ``devices.json`` lists a GPU (see
        :func:`ampflow.amp.decide.diagnose.plan_device`). The trainer and the launcher obey it and
        refuse a plan for ``cuda`` where no GPU is visible. ``""``: not recorded (a plan
        before version 4, or one diagnosed without a train section or devices record):
        ``train.device`` decides, as before.
    path : str or None
        The file the plan was read from (errors name it); not part of the plan's JSON.
    """

    version: int = PLAN_VERSION
    inputs: PlanInputs = field(default_factory=PlanInputs)
    signals: dict = field(default_factory=dict)
    strategies: tuple[PlannedStrategy, ...] = ()
    mesh: MeshShape = field(default_factory=MeshShape)
    chunk_size: int | None = None
    key_first: bool = False
    predicted_peak_bytes: int = 0
    M_base_bytes: int = 0
    M_stratum_bytes: int = 0
    n_strata: int = 0
    memory_components: dict = field(default_factory=dict)
    fits: bool = True
    recommended_devices: int | None = None
    min_fitting_devices: int | None = None
    peak_scope: PeakScope | None = None
    predicted_step_seconds: float | None = None
    cost_model: CostSection | None = None
    cpu: CpuSection | None = None
    device: str = ""
    reasons: tuple[str, ...] = ()
    path: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.chunk_size is not None and self.chunk_size < 0:
            raise InputError("must be >= 0", key="chunk_size", value=self.chunk_size)
        if self.predicted_step_seconds is not None and not self.predicted_step_seconds >= 0:
            raise InputError("must be >= 0", key="predicted_step_seconds", value=self.predicted_step_seconds)
        if self.device not in ("", *PLAN_DEVICES):
            raise InputError(f"must be one of {', '.join(PLAN_DEVICES)}", key="device", value=self.device)

    # ------------------------------------------------------------ what it says
    @property
    def names(self) -> tuple[str, ...]:
        """The strategies' names, in plan order."""
        return tuple(s.name for s in self.strategies)

    def uses(self, name: str) -> bool:
        return name in self.names

    @property
    def world(self) -> int:
        """Processes that train this plan: dp x tp."""
        return self.mesh.world

    @property
    def chunk(self) -> int:
        """The attention chunk to run with (0: none). A plan that names S3 without a size
        runs unchunked, as the plain model does."""
        return int(self.chunk_size or 0)

    @property
    def uses_key_first(self) -> bool:
        return bool(self.key_first) or self.uses(KEY_FIRST_DECODE)

    def summary(self) -> str:
        """One log line: strategies, mesh, chunk, key-first."""
        return (
            f"plan: {', '.join(self.names) or 'no strategy'}; mesh dp {self.mesh.dp} x tp {self.mesh.tp}; "
            f"chunk {self.chunk or '-'}, key-first {self.uses_key_first}"
        )

    @property
    def threads(self) -> int | None:
        """Torch threads per process for a run on CPU; None when the plan gives none."""
        return self.cpu.threads if self.cpu else None

    @property
    def source(self) -> str:
        """The plan's file for messages (``plan.json`` when it was not read from one)."""
        return self.path or "plan.json"

    # ------------------------------------------------------------ conversion
    def to_dict(self) -> dict:
        return {
            "version": self.version,
            "inputs": dict(vars(self.inputs)),
            "signals": self.signals,
            "strategies": [s.to_dict() for s in self.strategies],
            "mesh": {"dp": self.mesh.dp, "tp": self.mesh.tp},
            "chunk_size": self.chunk_size,
            "key_first": self.key_first,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "M_base_bytes": self.M_base_bytes,
            "M_stratum_bytes": self.M_stratum_bytes,
            "n_strata": self.n_strata,
            "memory_components": self.memory_components,
            "fits": self.fits,
            "recommended_devices": self.recommended_devices,
            "min_fitting_devices": self.min_fitting_devices,
            "peak_scope": self.peak_scope.to_dict() if self.peak_scope else {},
            "predicted_step_seconds": self.predicted_step_seconds,
            "cost_model": self.cost_model.to_dict() if self.cost_model else {},
            "cpu": self.cpu.to_dict() if self.cpu else {},
            "device": self.device,
            "reasons": list(self.reasons),
        }

    @classmethod
    def from_dict(cls, d: dict, path=None) -> Plan:
        """A plan from its JSON object. Keys left out take their defaults (a hand-written
        plan may give only ``mesh`` and ``strategies``); a wrong type names the key."""
        if not isinstance(d, dict):
            raise InputError("a plan must be a JSON object", path=path, value=type(d).__name__)
        # ``path``: where it was read from, not a key; ``world_size``: written by plans
        # before one name for the process count (the mesh's dp x tp, :attr:`world`; the
        # devices given are ``inputs.devices``), read and ignored
        known = set(cls.__dataclass_fields__) - {"path"} | {"world_size"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise InputError(f"unknown plan key(s); known: {sorted(known)}", path=path, value=unknown)
        try:
            mesh = d.get("mesh") or {}
            strategies = tuple(PlannedStrategy(str(s.get("id", "")), str(s["name"]), str(s.get("summary", ""))) for s in d.get("strategies") or [])
            for i, s in enumerate(strategies):
                if s.name not in BUILT_IN:  # parallelize() could not apply it
                    raise InputError(f"unknown strategy; the trainer applies {', '.join(BUILT_IN)}", key=f"strategies[{i}].name", value=s.name)
            inputs = PlanInputs(**(d.get("inputs") or {}))
            kw = {k: d[k] for k in ("version", "signals", "chunk_size", "key_first", "predicted_peak_bytes",
                                     "M_base_bytes", "M_stratum_bytes", "n_strata", "memory_components", "fits",
                                     "recommended_devices", "min_fitting_devices", "predicted_step_seconds",
                                     "device") if k in d}  # fmt: skip
            # a section written empty (``{}``; ``null`` in some older plans) is absent
            sections = {"peak_scope": PeakScope, "cost_model": CostSection, "cpu": CpuSection}
            kw.update({k: section.from_dict(d[k]) for k, section in sections.items() if d.get(k)})
            if "device" in kw and kw["device"] is None:
                kw["device"] = ""
            return cls(
                inputs=inputs,
                strategies=strategies,
                mesh=MeshShape(int(mesh.get("dp", 1)), int(mesh.get("tp", 1))),
                reasons=tuple(d.get("reasons") or ()),
                path=None if path is None else os.fspath(path),
                **kw,
            )
        except InputError as e:
            raise InputError(e.message, path=path, key=e.key, value=e.value) from None
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise InputError(f"malformed plan ({type(e).__name__}: {e})", path=path) from None

    def dumps(self) -> str:
        """Canonical text: identical plans give identical bytes."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def write(self, path) -> Path:
        """Write atomically (nothing under ``path`` until complete)."""
        write_text_atomic(path, self.dumps())
        return Path(path)

    @classmethod
    def read(cls, path) -> Plan:
        """Read ``plan.json``; a missing file or bad JSON is an InputError naming it."""
        path = Path(path)
        return cls.from_dict(read_json(path, "plan"), path)
