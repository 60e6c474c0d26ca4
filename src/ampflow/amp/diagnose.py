"""Diagnose: from a profile, the device count and memory, to a deterministic plan.

Walks the strategy registry (:mod:`.strategies`) in order; signals come from the
signal registry (:mod:`.signals`); predictions from the memory model. Beyond the
fixed mapping it chooses the largest chunk size that fits and the smallest
tensor-parallel degree that fits (the remaining devices doing data parallelism), and
recommends a device count.

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
"""

from __future__ import annotations

import math

from ..io.errors import InputError
from ..progress import human_bytes
from ..spec.plan import PEAK_COUNTS, PEAK_NOT_MODELLED, PLAN_VERSION, MeshShape, Plan, PlanInputs, PlannedStrategy
from ..spec.profile import model_config, profile_hash, train_settings
from ..spec.strategies import HIDDEN_PARALLEL
from .memory_spec import DTYPE_BYTES
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


def _check_profile(profile: dict) -> None:
    for key in ("modalities", "model", "train"):
        if key not in profile:
            raise InputError("profile lacks a required section", key=key)


def _decide(profile, signals, devices, budget, estimate):
    """Strategy names, reasons, mesh, chunk and estimate for ``devices`` devices."""
    hic = profile["modalities"].get("hic", {})
    chunks = _chunk_candidates(int(hic.get("n_anchors", 0))) if hic else []
    strategies = {s.name: s for s in ordered()}

    def peak(names, dp, tp, chunk):
        return estimate(profile, tuple(names), dp, tp, chunk).total

    ctx = Context(profile=profile, signals=signals, devices=devices, budget=budget, peak=peak)
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
            fitting = [c for c in chunks if peak(ctx.chosen, devices, 1, c) <= budget]
            ctx.best_chunk = fitting[0] if fitting else chunks[-1]

    uses_chunk = any(strategies[n].knob == "chunk" for n in ctx.chosen) and chunks
    chunk_options = chunks if uses_chunk else [0]
    tp_options = _divisors(devices) if any(strategies[n].uses_tp for n in ctx.chosen) else [1]
    if HIDDEN_PARALLEL in ctx.chosen:  # every rank takes an equal share of every head
        cfg = model_config(profile)
        tp_options = [t for t in tp_options if (cfg.D // cfg.heads) % t == 0] or [1]
    choice = None
    for tp in tp_options:
        for c in chunk_options:
            if peak(ctx.chosen, devices // tp, tp, c) <= budget:
                choice = (tp, c, True)
                break
        if choice:
            break
    if choice is None:
        choice = (tp_options[-1], chunk_options[-1], False)
    tp, chunk, fits = choice
    names, reasons = [], []
    for name in ctx.chosen:
        st = strategies[name]
        if st.uses_tp and tp < 2:
            # with tp 1 a tensor-parallel strategy shards nothing: listing it would say
            # the plan does what it does not (the memory model divides nothing by 1 either)
            raised = why_chosen[name].rstrip(".")
            if fits:
                reasons.append(f"{st.id} {st.name} not taken: its signal is raised ({raised}), but the plan fits with tp 1, "
                               f"where it would shard nothing; all {devices} device(s) do data parallelism instead.")  # fmt: skip
            else:
                reasons.append(f"{st.id} {st.name} not taken: its signal is raised ({raised}), but no tensor-parallel "
                               f"degree >= 2 of {devices} device(s) suits this model, and with tp 1 it would shard nothing.")  # fmt: skip
            continue
        names.append(name)
        reasons.append(f"{st.id} {st.name}: {why_chosen[name]}")
    est = estimate(profile, tuple(names), devices // tp, tp, chunk)
    return names, reasons, {"dp": devices // tp, "tp": tp}, chunk, fits, est


def data_batch_bytes(profile: dict, dp: int) -> int:
    """Bytes of one device's input batch: ``ceil(B / dp) x (G + F)`` counts in the run's
    dtype, dense (as the trainer builds it; every tp rank holds all features of it)."""
    mods = profile["modalities"]
    train = train_settings(profile)
    width = sum(int(mods.get(m, {}).get("n_features", 0)) for m in ("rna", "hic"))
    return -(-int(train.batch_size) // int(dp)) * width * DTYPE_BYTES.get(train.dtype, 4)


def peak_scope(profile: dict, dp: int, est) -> dict:
    """What ``predicted_peak_bytes`` counts, each phase's predicted peak and what the
    peak leaves out (JSON, integers only).

    ``leaves_out`` names what no profile can tell
    (:data:`~ampflow.spec.plan.PEAK_NOT_MODELLED`); the data batch is counted, and its
    bytes are given as ``data_batch_bytes``.
    """
    return {
        "counts": list(PEAK_COUNTS),
        "phases": {k: int(v) for k, v in (getattr(est, "phases", None) or {}).items()},
        "peak_phase": str(getattr(est, "peak_phase", "")),
        "data_batch_bytes": data_batch_bytes(profile, dp),
        "leaves_out": {"not_modelled": list(PEAK_NOT_MODELLED)},
    }


def diagnose(profile: dict, devices: int, device_memory: int, budget_fraction: float = 0.9, settings=None, estimate=None) -> Plan:
    """The plan for running ``profile``'s configuration on ``devices`` devices.

    Parameters
    ----------
    profile : dict
        From :func:`ampflow.amp.profile.profile_data` (signals are re-evaluated here).
    devices : int
    device_memory : int
        Bytes per device.
    budget_fraction : float
        Share of ``device_memory`` the plan may use.
    settings : dict, optional
        Signal thresholds (e.g. ``dimensionality_ratio``).
    estimate : callable, optional
        ``estimate(profile, names, dp, tp, chunk) -> Estimate``; default the analytic
        memory model.
    """
    from .memory_model import estimate_for_profile

    _check_profile(profile)
    if devices < 1:
        raise InputError("must be >= 1", key="devices", value=devices)
    if device_memory <= 0:
        raise InputError("must be > 0", key="device_memory", value=device_memory)
    if not 0 < budget_fraction <= 1:
        raise InputError("must be in (0, 1]", key="budget_fraction", value=budget_fraction)
    estimate = estimate or estimate_for_profile
    signals = evaluate_signals(profile, settings)
    budget = math.floor(device_memory * budget_fraction)
    names, reasons, mesh, chunk, fits, est = _decide(profile, signals, devices, budget, estimate)

    # the fewest devices that fit: powers of two, and the devices given when they fit
    # (a count such as 6 may fit where 4 does not and 8 is more than given)
    fewest = None
    d = 1
    while d <= MAX_RECOMMENDED:
        if (fits if d == devices else _decide(profile, signals, d, budget, estimate)[4]):
            fewest = d
            break
        d *= 2
    if fits and (fewest is None or devices < fewest):
        fewest = devices
    # what to train on: the mesh beside it when the plan fits (more devices than the
    # fewest means more data parallelism, i.e. faster steps), else the fewest that fit
    recommended = mesh["dp"] * mesh["tp"] if fits else fewest
    by_name = {s.name: s for s in ordered()}
    if not names:
        reasons.append("no signal calls for a strategy: plain single-process training.")
    if mesh["tp"] > 1:
        reasons.append(f"mesh: tp {mesh['tp']} is the smallest tensor-parallel degree that fits; dp {mesh['dp']} uses the other devices.")
    if chunk:
        reasons.append(f"chunk size {chunk} is the largest power of two that fits (larger chunks run faster).")
    if fits:
        reasons.append(f"predicted peak {human_bytes(est.total)} per device fits the budget {human_bytes(budget)}.")
    else:
        reasons.append(f"predicted peak {human_bytes(est.total)} per device exceeds the budget {human_bytes(budget)} even with every applicable strategy.")
    if fits:
        more = f"; {fewest} would fit too (fewer data-parallel groups, slower steps)" if fewest < recommended else ""
        reasons.append(f"recommended: {recommended} device(s), those this mesh uses (dp {mesh['dp']} x tp {mesh['tp']}){more}.")
    elif recommended is None:
        reasons.append(f"no device count up to {MAX_RECOMMENDED} fits this budget per device.")
    else:
        reasons.append(f"recommended: {recommended} device(s), the fewest with which the plan fits; this plan is for {devices} "
                       f"and does not fit: plan again with {recommended}.")  # fmt: skip
    hic = profile["modalities"].get("hic", {})
    return Plan(
        version=PLAN_VERSION,
        inputs=PlanInputs(
            profile_hash=profile_hash(profile),
            devices=devices,
            device_memory_bytes=int(device_memory),
            budget_fraction=budget_fraction,
            budget_bytes=int(budget),
        ),
        signals=signals,
        strategies=tuple(PlannedStrategy(by_name[n].id, n, by_name[n].summary) for n in names),
        mesh=MeshShape(mesh["dp"], mesh["tp"]),
        world_size=devices,
        chunk_size=int(chunk) or None,
        key_first=any(by_name[n].knob == "key_first" for n in names),
        predicted_peak_bytes=int(est.total),
        M_base_bytes=int(est.base),
        M_stratum_bytes=int(est.per_stratum),
        n_strata=int(hic.get("n_strata", 0)),
        memory_components={k: int(v) for k, v in sorted(est.components.items())},
        fits=bool(fits),
        recommended_devices=recommended,
        min_fitting_devices=fewest,
        peak_scope=peak_scope(profile, mesh["dp"], est),
        reasons=tuple(reasons),
    )


def explain(plan: Plan) -> str:
    """The plan as a readable table."""
    hb = human_bytes
    inp = plan.inputs
    rows = [
        ("devices", f"{inp.devices} x {hb(inp.device_memory_bytes)} (budget {inp.budget_fraction:g}: {hb(inp.budget_bytes)})"),
        ("mesh", f"dp {plan.mesh.dp} x tp {plan.mesh.tp}"),
        ("strategies", ", ".join(f"{s.id} {s.name}" for s in plan.strategies) or "none"),
        ("chunk size", str(plan.chunk_size or "-")),
        ("predicted peak", f"{hb(plan.predicted_peak_bytes)} per device"),
        ("  counts", plan.peak_counts_text()),
        ("  phases", plan.peak_phase_text()),
        ("  leaves out", plan.peak_leaves_out_text()),
        ("M(L)", f"{hb(plan.M_base_bytes)} + (L-1) x {hb(plan.M_stratum_bytes)} (L = {plan.n_strata}; stratum 0 has no attention block)"),
        ("fits", "yes" if plan.fits else "NO"),
        ("recommended devices", plan.recommended_text()),
    ]
    width = max(len(k) for k, _ in rows)
    lines = ["plan", "----"] + [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines += ["", "signals", "-------"]
    for name, s in sorted(plan.signals.items()):
        ev = ", ".join(f"{k}={v}" for k, v in sorted(s["evidence"].items()))
        lines.append(f"{'RAISED' if s['raised'] else 'no    '}  {name}  ({ev})")
    lines += ["", "why", "---"] + [f"- {r}" for r in plan.reasons]
    return "\n".join(lines) + "\n"
