"""Diagnose: from a profile, the device count and memory, to a deterministic plan.

Walks the strategy registry (:mod:`.strategies`) in order; signals come from the
signal registry (:mod:`.signals`); memory predictions from the memory model, step
times from the cost model (:mod:`ampflow.amp.cost.model`). Beyond the fixed mapping it chooses
the smallest tensor-parallel degree that fits (the remaining devices doing data
parallelism), the chunk size of S3 as the fastest candidate that fits, and recommends a
device count.

The chunk (S3's knob) is chosen among one block (no chunk) and the powers of two below
the anchor count, by predicted seconds per step among those whose bytes fit: the
predicted peak plus one query block's transient attention scores. For the banded
kernel a chunk saves only those transient bytes and costs a pass of its loop, so one
block is the fastest and is chosen whenever it fits; S3 is then not listed, and a
reason says why. Ties go to the candidate needing fewer bytes, then to the larger one.

What a plan says holds for the plan as written:

* a strategy that shards over the tensor-parallel group (S2, S5) is listed only when
  the mesh has ``tp >= 2``; one whose signal is raised but that the chosen ``tp = 1``
  leaves with nothing to shard is dropped, and a reason says why;
* ``recommended_devices`` is the device count to train on: the devices the mesh uses
  (``dp x tp``) when the plan fits, else the fewest with which it would fit;
  ``min_fitting_devices`` is the fewest (a power of two, or the devices given) with
  which it fits;
* ``peak_scope`` says what ``predicted_peak_bytes`` counts (the allocator's peak of a
  steady-state step: state, the data batch, saved activations, gradients and the
  transients of the backward pass and the optimizer step), the predicted peak of each
  phase, and what it leaves out.
* ``predicted_step_seconds`` and ``cost_model`` give the cost model's prediction for
  the plan, its constants and where they come from (a calibration file or the
  documented defaults), and every chunk candidate considered;
* ``device`` is where the plan trains (``cpu`` or ``cuda``), decided here and not at
  run time (:func:`plan_device`), since the budget, the ``cpu`` section and the job's
  allocation are all for that device;
* ``cpu``, for a run on CPU, gives the torch threads per process (the allocation's
  cores over the mesh's processes, or an explicit ``train.threads``) and checks the
  configured batch against the host's available memory (:mod:`.cpu`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from ...base.errors import InputError
from ...base.progress import human_bytes
from ...contract.config import TrainConfig
from ...contract.plan import PLAN_VERSION, MeshShape, Plan, PlanInputs, PlannedStrategy
from ...contract.plan_sections import ChunkCandidate, CostSection, CpuSection, PeakScope
from ...contract.profile import Profile, as_profile, model_config, train_settings
from ...contract.strategies import HIDDEN_PARALLEL
from ..cost.model import DEFAULT_CONSTANTS, SECONDS_DIGITS, CostConstants, cost_for_profile, describe, sig
from ..memory.cuda import DEFAULT_CAPABILITY, cuda_overheads, plan_budget
from ..memory.shapes import DTYPE_BYTES
from .cpu import cpu_plan, trains_on_cpu
from .signals import evaluate_signals
from .strategies import Context, ordered

MIN_CHUNK = 16
MAX_RECOMMENDED = 1024


def _chunk_candidates(n_anchors: int) -> list[int]:
    """Powers of two from the largest below ``n_anchors`` down to MIN_CHUNK."""
    out, c = [], MIN_CHUNK
    while c < n_anchors:
        out.append(c)
        c *= 2
    return sorted(out, reverse=True) or [max(1, n_anchors)]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Candidate:
    """One setting of the chunk (0: one block) on one mesh: the bytes it needs (the
    predicted peak plus one query block's transient attention scores), those scores,
    the predicted seconds per step (None without a Hi-C decoder) and whether it fits."""

    chunk: int
    need: int
    transient: int
    seconds: float | None
    fits: bool

    @property
    def label(self) -> str:
        return f"chunk {self.chunk}" if self.chunk else "one block (no chunk)"

    def to_contract(self) -> ChunkCandidate:
        return ChunkCandidate(self.chunk or None, self.seconds, self.need, self.transient, self.fits)


class _Planner:
    """Memory and cost of candidates, each computed once per diagnosis."""

    def __init__(self, profile, budget, estimate, constants):
        self.profile, self.budget, self._estimate, self.constants = profile, budget, estimate, constants
        self._est, self._cost = {}, {}

    def estimate(self, names, dp, tp, chunk):
        key = (tuple(names), dp, tp, chunk)
        if key not in self._est:
            self._est[key] = self._estimate(self.profile, tuple(names), dp, tp, chunk)
        return self._est[key]

    def transient(self, names, dp, tp, chunk) -> int:
        return int(getattr(self.estimate(names, dp, tp, chunk), "transient", {}).get("attention_scores", 0))

    def need(self, names, dp, tp, chunk) -> float:
        """Bytes a candidate needs: held at the peak, plus one query block's scores."""
        return self.estimate(names, dp, tp, chunk).total + self.transient(names, dp, tp, chunk)

    def cost(self, names, dp, tp, chunk):
        key = (tuple(names), dp, tp, chunk)
        if key not in self._cost:
            self._cost[key] = cost_for_profile(self.profile, names, dp, tp, chunk, self.constants)
        return self._cost[key]

    def candidates(self, names, dp, tp, chunks) -> list[Candidate]:
        out = []
        for c in chunks:
            cost = self.cost(names, dp, tp, c)
            need = self.need(names, dp, tp, c)
            seconds = None if cost is None else sig(cost.seconds, SECONDS_DIGITS)
            out.append(Candidate(c, int(need), self.transient(names, dp, tp, c), seconds, need <= self.budget))
        return out


def fastest(candidates: list[Candidate]) -> Candidate | None:
    """The fastest candidate that fits (ties: the one needing fewer bytes, then the
    earlier one); None when none fits."""
    fitting = [(c.seconds or 0.0, c.need, i, c) for i, c in enumerate(candidates) if c.fits]
    return min(fitting)[3] if fitting else None


def _ranked(candidates: list[Candidate]) -> list[Candidate]:
    return [c for *_, c in sorted((c.seconds or 0.0, c.need, i, c) for i, c in enumerate(candidates))]


@dataclass
class _Decision:
    names: list
    reasons: list
    mesh: dict
    chunk: int
    fits: bool
    est: object
    candidates: list = field(default_factory=list)  # at the chosen mesh, when S3 was considered
    chunk_reason: str = ""


def _chunk_reason(chosen: Candidate, cands: list[Candidate], budget: int, not_taken: bool = False) -> str:
    """Why this chunk: its predicted seconds and the runner-up's, and why faster ones are
    out. ``not_taken``: the sentence for S3 left out because one block is chosen."""
    ranked = _ranked(cands)
    if not chosen.fits:
        return (f"{chosen.label}: no candidate fits; the smallest has the least transient attention scores "
                f"({human_bytes(chosen.transient)} per query block), {_secs(chosen)} s/step predicted.")  # fmt: skip
    runner = next((c for c in ranked if c.fits and c is not chosen), None)
    if not_taken:
        text = f"{chosen.label} fits and is the fastest: {_secs(chosen)} s/step predicted"
    else:
        text = f"{chosen.label}: the fastest that fits, {_secs(chosen)} s/step predicted"
    if runner is not None:
        text += f" vs {_secs(runner)} s at {runner.label}"
    faster = [c for c in ranked[: ranked.index(chosen)] if not c.fits]
    if faster:
        f = faster[0]
        scores = f", of which {human_bytes(f.transient)} transient attention scores" if f.transient else ""
        text += f"; {f.label} ({_secs(f)} s) would need {human_bytes(f.need)}{scores}, over the budget {human_bytes(budget)}"
    elif chosen.transient:
        text += f"; its transient attention scores ({human_bytes(chosen.transient)}) fit beside the predicted peak"
    return text + "."


def _secs(c: Candidate) -> str:
    return "?" if c.seconds is None else f"{c.seconds:.3g}"


def _decide(profile, signals, devices, budget, planner: _Planner) -> _Decision:
    """Strategy names, reasons, mesh, chunk and estimate for ``devices`` devices."""
    hic = profile.hic
    chunks = _chunk_candidates(int(hic.n_anchors or 0)) if hic is not None else []
    options = [0, *chunks]  # one block first: the fastest when it fits
    strategies = {s.name: s for s in ordered()}

    ctx = Context(profile=profile, signals=signals, devices=devices, budget=budget, peak=planner.need)
    why_chosen = {}
    for st in ordered():
        if st.multi_process and devices < 2:
            continue
        why = st.rule(ctx)
        if not why:
            continue
        ctx.chosen.append(st.name)
        why_chosen[st.name] = why
        if st.knob == "chunk" and chunks:
            best = fastest(planner.candidates(ctx.chosen, devices, 1, options))
            ctx.best_chunk = best.chunk if best else chunks[-1]

    uses_chunk = any(strategies[n].knob == "chunk" for n in ctx.chosen) and chunks
    chunk_options = options if uses_chunk else [0]
    tp_options = _divisors(devices) if any(strategies[n].uses_tp for n in ctx.chosen) else [1]
    if HIDDEN_PARALLEL in ctx.chosen:  # every rank takes an equal share of every head
        cfg = model_config(profile)
        tp_options = [t for t in tp_options if (cfg.D // cfg.heads) % t == 0] or [1]
    choice = None
    for tp in tp_options:
        cands = planner.candidates(ctx.chosen, devices // tp, tp, chunk_options)
        best = fastest(cands)
        if best is not None:
            choice = (tp, best, cands, True)
            break
    if choice is None:
        tp = tp_options[-1]
        cands = planner.candidates(ctx.chosen, devices // tp, tp, chunk_options)
        choice = (tp, cands[-1], cands, False)
    tp, picked, cands, fits = choice
    chunk = picked.chunk
    names, reasons = [], []
    for name in ctx.chosen:
        st = strategies[name]
        raised = why_chosen[name].rstrip(".")
        if st.uses_tp and tp < 2:
            # with tp 1 a tensor-parallel strategy shards nothing: listing it would say
            # the plan does what it does not (the memory model divides nothing by 1 either)
            if fits:
                reasons.append(f"{st.id} {st.name} not taken: its signal is raised ({raised}), but the plan fits with tp 1, "
                               f"where it would shard nothing; all {devices} device(s) do data parallelism instead.")  # fmt: skip
            else:
                reasons.append(f"{st.id} {st.name} not taken: its signal is raised ({raised}), but no tensor-parallel "
                               f"degree >= 2 of {devices} device(s) suits this model, and with tp 1 it would shard nothing.")  # fmt: skip
            continue
        if st.knob == "chunk" and uses_chunk and not chunk:
            # one block is the plain kernel: a plan naming S3 without a chunk would say
            # the plan does what it does not
            reasons.append(f"{st.id} {st.name} not taken: its signal is raised ({raised}), but "
                           f"{_chunk_reason(picked, cands, budget, not_taken=True)}")  # fmt: skip
            continue
        names.append(name)
        reasons.append(f"{st.id} {st.name}: {why_chosen[name]}")
    chunk_reason = _chunk_reason(picked, cands, budget) if uses_chunk and chunk else ""
    est = planner.estimate(names, devices // tp, tp, chunk)
    return _Decision(names, reasons, {"dp": devices // tp, "tp": tp}, chunk, fits, est, cands if uses_chunk else [], chunk_reason)


def data_batch_bytes(profile: Profile | dict, dp: int) -> int:
    """Bytes of one device's input batch: ``ceil(B / dp) x (G + F)`` counts in the run's
    dtype, dense (as the trainer builds it; every tp rank holds all features of it), and
    ``F`` more where the Hi-C encoder reads its own thinned copy."""
    profile = as_profile(profile)
    train = train_settings(profile)
    copies = {"rna": 1, "hic": 2 if train.hic_encoder_copy else 1}
    width = sum(copies[k] * int(m.n_features or 0) for k, m in (("rna", profile.rna), ("hic", profile.hic)) if m is not None)
    return -(-int(train.batch_size) // int(dp)) * width * DTYPE_BYTES.get(train.dtype, 4)


def peak_scope(profile: Profile | dict, dp: int, est) -> PeakScope:
    """What ``predicted_peak_bytes`` counts, each phase's predicted peak and what the
    peak leaves out (:class:`~ampflow.contract.plan_sections.PeakScope`).

    It leaves out what no profile can tell
    (:data:`~ampflow.contract.plan_sections.PEAK_NOT_MODELLED`); the data batch is
    counted, and its bytes are given as ``data_batch_bytes``.
    """
    return PeakScope(
        phases={k: int(v) for k, v in (getattr(est, "phases", None) or {}).items()},
        peak_phase=str(getattr(est, "peak_phase", "")),
        data_batch_bytes=data_batch_bytes(profile, dp),
    )


def plan_device(train: TrainConfig | None, host: dict | None) -> tuple[str, str]:
    """The device a plan trains on and the reason the plan gives; ``("", "")`` with
    neither a train section nor a devices record (nothing to decide from: the run's
    ``train.device`` then decides, as for a plan before version 4).

    ``train.device`` ``cpu`` or ``cuda``: as set. ``auto``: ``cuda`` when ``devices.json``
    lists a GPU, else ``cpu``. That record is what the plan is made for: the devices job
    runs with the GPUs the train job will get (on SLURM, one node's share of
    ``amp.devices`` when the config trains on GPUs; locally, this host's), and
    ``--device-memory auto`` reads the memory from the same GPUs. Deciding here, not at
    run time, keeps a plan for GPUs from being run on CPU cores (or the reverse) where
    the run happens to see other devices.
    """
    if train is None and host is None:
        return "", ""
    setting = (train or TrainConfig()).device
    gpus = len((host or {}).get("devices") or [])
    device = "cpu" if trains_on_cpu(setting, host) else "cuda"
    listed = f"devices.json lists {gpus} GPU(s)" if gpus else "devices.json lists no GPU"
    if setting == "auto":
        return device, f"device: {device}: train.device is auto and {listed}."
    if device == "cpu":
        unused = f"; the {gpus} GPU(s) devices.json lists are left unused" if gpus else ""
        return device, f"device: cpu, as train.device sets{unused}."
    warn = "; devices.json lists no GPU, so this plan trains only where GPUs are visible" if host is not None and not gpus else ""
    return device, f"device: cuda, as train.device sets{warn}."


def _budget(device_memory: int, budget_fraction: float, device: str) -> tuple[int, str]:
    """Bytes the predicted peak may reach per device, and for a plan on CUDA the reason
    that states the margin (:func:`ampflow.amp.memory.cuda.plan_budget`: the context
    off the memory, the fragmentation allowance between the reserved and the allocated
    peak, the cuBLAS workspaces and the rounding bound off the allocated). The
    workspaces are taken at sm90's default, the largest, so that the plan does not
    depend on which GPU the diagnosis ran beside. Elsewhere ``device_memory *
    budget_fraction``, as before plans recorded their device."""
    if device != "cuda":
        return math.floor(device_memory * budget_fraction), ""
    o = cuda_overheads(capability=DEFAULT_CAPABILITY)
    budget = plan_budget(device_memory, budget_fraction, device, o)
    return budget, (
        f"budget on CUDA: (device memory {human_bytes(device_memory)} - context {human_bytes(o.context_bytes)}) x "
        f"{budget_fraction:g} / (1 + fragmentation {o.fragmentation:g}) - cuBLAS workspaces {human_bytes(o.workspace_bytes)} "
        f"- block rounding {human_bytes(o.rounding_bytes)} = {human_bytes(budget)} for the predicted peak."
    )


def diagnose(profile: Profile | dict, devices: int, device_memory: int, budget_fraction: float = 0.9, settings=None, estimate=None,
             constants: CostConstants | None = None, train: TrainConfig | None = None, host: dict | None = None) -> Plan:  # fmt: skip
    """The plan for running ``profile``'s configuration on ``devices`` devices.

    Parameters
    ----------
    profile : Profile or dict
        From :func:`ampflow.amp.profile.profile_data` (a JSON object is read as a
        :class:`~ampflow.contract.profile.Profile`; signals are re-evaluated here).
    devices : int
    device_memory : int
        Bytes per device.
    budget_fraction : float
        Share of ``device_memory`` the plan may use.
    settings : dict, optional
        Signal thresholds (e.g. ``dimensionality_ratio``).
    estimate : callable, optional
        ``estimate(profile, names, dp, tp, chunk) -> Estimate`` (``profile`` a
        :class:`~ampflow.contract.profile.Profile`); default the analytic
        memory model.
    constants : CostConstants, optional
        The cost model's constants (:func:`ampflow.amp.cost.model.read_calibration`);
        default :data:`~ampflow.amp.cost.model.DEFAULT_CONSTANTS`, and the plan says so.
    train : TrainConfig, optional
        ``device`` and ``threads`` of the run (default the defaults): whether it trains on
        CPU and where its threads come from.
    host : dict, optional
        ``devices.json`` (:func:`ampflow.devices.probe_devices`): its GPUs, CPU cores and
        host memory. With neither ``train`` nor ``host`` the plan has no ``cpu`` section
        and records no ``device`` (:func:`plan_device`).
    """
    from ..memory.predict import estimate_for_profile

    profile = as_profile(profile)  # an InputError names a missing or malformed section
    _check_arguments(devices, device_memory, budget_fraction)
    estimate = estimate or estimate_for_profile
    constants = (constants or DEFAULT_CONSTANTS).rounded()
    signals = evaluate_signals(profile, settings)
    device, device_reason = plan_device(train, host)
    budget, budget_reason = _budget(device_memory, budget_fraction, device)
    planner = _Planner(profile, budget, estimate, constants)
    dec = _decide(profile, signals, devices, budget, planner)
    fewest = _fewest_devices(profile, signals, devices, dec.fits, budget, planner)
    # what to train on: the mesh beside it when the plan fits (more devices than the
    # fewest means more data parallelism, i.e. faster steps), else the fewest that fit
    recommended = dec.mesh["dp"] * dec.mesh["tp"] if dec.fits else fewest
    step = planner.cost(dec.names, dec.mesh["dp"], dec.mesh["tp"], dec.chunk)
    seconds = None if step is None else sig(step.seconds, SECONDS_DIGITS)
    reasons = dec.reasons + _outcome_reasons(dec, planner, step, seconds, constants, budget, devices, fewest, recommended)
    cpu, cpu_reasons = _cpu_section(profile, dec, estimate, constants, train, host, budget_fraction)
    reasons += [r for r in (device_reason, budget_reason) if r] + cpu_reasons
    by_name = {s.name: s for s in ordered()}
    mesh, est = dec.mesh, dec.est
    return Plan(
        version=PLAN_VERSION,
        inputs=PlanInputs(
            profile_hash=profile.hash,
            devices=devices,
            device_memory_bytes=int(device_memory),
            budget_fraction=budget_fraction,
            budget_bytes=int(budget),
        ),
        signals=signals,
        strategies=tuple(PlannedStrategy(by_name[n].id, n, by_name[n].summary) for n in dec.names),
        mesh=MeshShape(mesh["dp"], mesh["tp"]),
        chunk_size=int(dec.chunk) or None,
        key_first=any(by_name[n].knob == "key_first" for n in dec.names),
        predicted_peak_bytes=int(est.total),
        M_base_bytes=int(est.base),
        M_stratum_bytes=int(est.per_stratum),
        n_strata=int(profile.hic.n_strata or 0) if profile.hic is not None else 0,
        memory_components={k: int(v) for k, v in sorted(est.components.items())},
        fits=bool(dec.fits),
        recommended_devices=recommended,
        min_fitting_devices=fewest,
        peak_scope=peak_scope(profile, mesh["dp"], est),
        predicted_step_seconds=seconds,
        cost_model=_cost_section(step, constants, dec),
        cpu=cpu,
        device=device,
        reasons=tuple(reasons),
    )


def _check_arguments(devices: int, device_memory: int, budget_fraction: float) -> None:
    if devices < 1:
        raise InputError("must be >= 1", key="devices", value=devices)
    if device_memory <= 0:
        raise InputError("must be > 0", key="device_memory", value=device_memory)
    if not 0 < budget_fraction <= 1:
        raise InputError("must be in (0, 1]", key="budget_fraction", value=budget_fraction)


def _fewest_devices(profile: Profile, signals: list, devices: int, fits: bool, budget: int, planner: _Planner) -> int | None:
    """The fewest devices with which a plan fits: powers of two, and the devices given
    when they fit (a count such as 6 may fit where 4 does not and 8 is more than given);
    None when no count up to :data:`MAX_RECOMMENDED` fits."""
    fewest = None
    d = 1
    while d <= MAX_RECOMMENDED:
        if fits if d == devices else _decide(profile, signals, d, budget, planner).fits:
            fewest = d
            break
        d *= 2
    if fits and (fewest is None or devices < fewest):
        fewest = devices
    return fewest


def _outcome_reasons(dec, planner: _Planner, step, seconds, constants: CostConstants, budget: int, devices: int,
                     fewest: int | None, recommended: int | None) -> list[str]:  # fmt: skip
    """The reasons after the strategies': the mesh, the chunk, the step time, whether the
    peak fits, and the device count recommended."""
    mesh, fits = dec.mesh, dec.fits
    reasons = []
    if not dec.names:
        reasons.append("no signal calls for a strategy: plain single-process training.")
    if mesh["tp"] > 1:
        reasons.append(f"mesh: tp {mesh['tp']} is the smallest tensor-parallel degree that fits; dp {mesh['dp']} uses the other devices.")
    if dec.chunk_reason:
        reasons.append(dec.chunk_reason)
    if step is not None:
        reasons.append(f"step time by the cost model: {seconds:.3g} s/step predicted for the Hi-C decoder on this mesh "
                       f"(its strata's attention and decode, forward and backward: the part the plan's knobs change); "
                       f"constants: {describe(constants)}.")  # fmt: skip
    scores = planner.transient(dec.names, mesh["dp"], mesh["tp"], dec.chunk)
    beside = f" (with {human_bytes(scores)} of transient attention scores beside it)" if scores else ""
    if fits:
        reasons.append(f"predicted peak {human_bytes(dec.est.total)} per device{beside} fits the budget {human_bytes(budget)}.")
        more = f"; {fewest} would fit too (fewer data-parallel groups, slower steps)" if fewest < recommended else ""
        reasons.append(f"recommended: {recommended} device(s), those this mesh uses (dp {mesh['dp']} x tp {mesh['tp']}){more}.")
    else:
        reasons.append(f"predicted peak {human_bytes(dec.est.total)} per device exceeds the budget {human_bytes(budget)} even with every applicable strategy.")
        if recommended is None:
            reasons.append(f"no device count up to {MAX_RECOMMENDED} fits this budget per device.")
        else:
            reasons.append(f"recommended: {recommended} device(s), the fewest with which the plan fits; this plan is for {devices} "
                           f"and does not fit: plan again with {recommended}.")  # fmt: skip
    return reasons


def _cpu_section(profile: Profile, dec, estimate, constants: CostConstants, train: TrainConfig | None, host: dict | None,
                 budget_fraction: float) -> tuple[CpuSection | None, list[str]]:  # fmt: skip
    """The plan's ``cpu`` section and its reasons (:func:`~.cpu.cpu_plan`); None without
    ``train`` and ``host``."""
    if train is None and host is None:
        return None, []
    dp, tp = dec.mesh["dp"], dec.mesh["tp"]

    def per_process(p: dict) -> int:
        # one process at its peak with profile p's batch (the predicted peak counts the
        # data batch) and one query block's scores beside it
        e = estimate(p, tuple(dec.names), dp, tp, dec.chunk)
        return int(e.total) + int(getattr(e, "transient", {}).get("attention_scores", 0))

    cpu, reasons = cpu_plan(profile, train or TrainConfig(), host, dp * tp, budget_fraction, per_process)
    timed = re.search(r"calibrated on cpu \((\d+) threads?\)", constants.source or "")
    if cpu and timed and int(timed.group(1)) != cpu.threads:
        reasons.append(f"the cost model's constants were timed with {timed.group(1)} thread(s) per process, this plan "
                       f"gives {cpu.threads}: calibrate again with these threads for step times that hold.")  # fmt: skip
    return cpu, reasons


def _cost_section(step, constants: CostConstants, dec) -> CostSection | None:
    """The plan's ``cost_model`` section: the constants and terms of the step time, and
    the chunk candidates weighed; None without a step time."""
    if step is None:
        return None
    return CostSection(
        constants=constants.to_dict(),
        source=constants.source,
        terms=step.to_dict(),
        candidates=tuple(c.to_contract() for c in dec.candidates),
    )
