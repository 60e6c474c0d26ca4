"""A plan in words: the lines the plan page, ``ampflow plan-explain`` and the log say about a
:class:`~ampflow.contract.plan.Plan` (the contract holds the plan; its rendering lives here)."""

from __future__ import annotations

from ..base.progress import human_bytes
from ..contract.plan import Plan


def recommended_text(plan: Plan) -> str:
    """The recommended device count and which count it is."""
    rec = plan.recommended_devices
    if not rec:
        return "none up to 1024"
    if plan.fits:
        more = f"; fewest that fit: {plan.min_fitting_devices}" if plan.min_fitting_devices and plan.min_fitting_devices < rec else ""
        return f"{rec} (the devices this mesh uses, dp {plan.mesh.dp} x tp {plan.mesh.tp}{more})"
    return f"{rec} (the fewest that fit; this mesh, for {plan.world}, does not)"


def device_text(plan: Plan) -> str:
    """The device the plan trains on, or that it records none."""
    if not plan.device:
        return "not recorded (a plan before version 4): train.device decides"
    gpus = "one process per GPU, NCCL" if plan.device == "cuda" else "processes on CPU cores, gloo"
    return f"{plan.device} ({plan.world} process(es): {gpus})"


def threads_text(plan: Plan) -> str:
    """Threads per process, where the figure comes from and the cores it divides."""
    cpu = plan.cpu
    if cpu is None or not cpu.threads:
        return "not planned (GPU run, or a plan before version 3)"
    why = {"plan": "cores / processes", "train.threads": "train.threads, explicit", "default": "no cores recorded"}.get(cpu.threads_source, "")
    cores = f"{cpu.cores} cores, " if cpu.cores else ""
    return f"{cpu.threads} per process ({cores}{cpu.processes} process(es); {why})"


def host_memory_text(plan: Plan) -> str:
    """The host-memory check of the batch (CPU runs)."""
    cpu = plan.cpu
    if cpu is None:
        return "not checked (GPU run)"
    need = human_bytes(cpu.host_need_bytes)
    if cpu.host_fits is None:
        return f"batch {cpu.batch_size} needs {need}; not checked (no available memory recorded)"
    budget = human_bytes(cpu.host_budget_bytes or 0)
    if cpu.host_fits:
        return f"batch {cpu.batch_size} needs {need} of {budget}: fits"
    best = cpu.largest_fitting_batch
    alt = f"; batch {best} would" if best else "; no batch would"
    return f"batch {cpu.batch_size} needs {need} of {budget}: does NOT fit{alt}"


def step_text(plan: Plan) -> str:
    """The predicted seconds per step and where the cost model's constants come from."""
    if plan.predicted_step_seconds is None:
        return "not predicted"
    source = plan.cost_model.source if plan.cost_model else ""
    return f"{plan.predicted_step_seconds:.3g} s (Hi-C decoder and encoders, cost model{'; ' + source if source else ''})"


def peak_counts_text(plan: Plan) -> str:
    return ", ".join(plan.peak_scope.counts if plan.peak_scope else ()) or "not stated"


def peak_leaves_out_text(plan: Plan) -> str:
    """The left-out terms, with their bytes where the plan has them."""
    scope = plan.peak_scope
    if scope is None:
        return "not stated"
    parts = []
    if scope.left_out_batch_bytes is not None:  # a plan of an earlier version, which left the batch out
        parts.append(f"the data batch ({human_bytes(scope.left_out_batch_bytes)})")
    transient = {k: v for k, v in scope.left_out_transient_bytes.items() if v}
    if transient:
        parts.append("short-lived " + ", ".join(f"{k.replace('_', ' ')} ({human_bytes(v)})" for k, v in sorted(transient.items())))
    return "; ".join(parts + list(scope.not_modelled)) or "not stated"


def peak_phase_text(plan: Plan) -> str:
    """The predicted peak of each phase of the step, the largest marked."""
    if plan.peak_scope is None or not plan.peak_scope.phases:
        return "not stated"
    phases, peak = plan.peak_scope.phases, plan.peak_scope.peak_phase
    return ", ".join(f"{k.replace('_', ' ')} {human_bytes(v)}{' (peak)' if k == peak else ''}" for k, v in phases.items())


def explain(plan: Plan) -> str:
    """The plan as a readable table."""
    hb = human_bytes
    inp = plan.inputs
    rows = [
        ("devices", f"{inp.devices} x {hb(inp.device_memory_bytes)} (budget {inp.budget_fraction:g}: {hb(inp.budget_bytes)})"),
        ("device", device_text(plan)),
        ("mesh", f"dp {plan.mesh.dp} x tp {plan.mesh.tp}"),
        ("strategies", ", ".join(f"{s.id} {s.name}" for s in plan.strategies) or "none"),
        ("chunk size", str(plan.chunk_size or "-")),
        ("predicted step", step_text(plan)),
        ("predicted peak", f"{hb(plan.predicted_peak_bytes)} per device"),
        ("  counts", peak_counts_text(plan)),
        ("  phases", peak_phase_text(plan)),
        ("  leaves out", peak_leaves_out_text(plan)),
        ("M(L)", f"{hb(plan.M_base_bytes)} + (L-1) x {hb(plan.M_stratum_bytes)} (L = {plan.n_strata}; stratum 0 has no attention block)"),
        ("fits", "yes" if plan.fits else "NO"),
        ("recommended devices", recommended_text(plan)),
        ("cpu threads", threads_text(plan)),
        ("host memory", host_memory_text(plan)),
    ]
    width = max(len(k) for k, _ in rows)
    lines = ["plan", "----"] + [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines += ["", "signals", "-------"]
    for name, s in sorted(plan.signals.items()):
        ev = ", ".join(f"{k}={v}" for k, v in sorted(s["evidence"].items()))
        lines.append(f"{'RAISED' if s['raised'] else 'no    '}  {name}  ({ev})")
    lines += ["", "why", "---"] + [f"- {r}" for r in plan.reasons]
    return "\n".join(lines) + "\n"
