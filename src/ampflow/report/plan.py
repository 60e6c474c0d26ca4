"""One configuration's AMP plan as a page, and its per-stratum memory, predicted against measured.

:func:`plan_page` turns ``plan.json`` into HTML: signals with their evidence, the
strategies and why (and why a strategy whose signal is raised was not taken), the
device it trains on (``cpu`` or ``cuda``, decided with the plan), the mesh, chunk size, the predicted seconds per step with the cost model's chunk
candidates, predicted peak against the budget with what it counts and leaves out,
the recommended device count, for a CPU run the torch threads per process and the
host-memory check of the batch, and the memory model's components.

:func:`measured_memory` reads ``metrics.jsonl``: per rank, the bytes held after each
Hi-C stratum (``stratum_bytes``) and the step peak (``peak_bytes``), each the maximum
over the steps. Rows with a ``rank`` field are that rank's; rows without one are rank
0's, with every rank's peak in ``rank_peak_bytes`` and per-stratum bytes in
``rank_stratum_bytes`` when the run had several processes.
:func:`plot_memory` draws them against the memory model's prediction for the plan
(and, when the run used a different number of processes than the plan, for the run
as it ran).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from ..amp.decide.strategies import STRATEGIES
from ..base.progress import human_bytes
from ..contract.plan import Plan
from ..contract.profile import Profile, as_profile, read_profile
from ..contract.strategies import DATA_PARALLEL
from .common import GIB, LIMIT_COLOUR, MIB, colour, esc, html_table, new_figure, note, read_jsonl, save_png, write_html
from .plan_text import device_text, host_memory_text, peak_counts_text, peak_leaves_out_text, peak_phase_text, recommended_text, step_text, threads_text

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- plan page
def strategy_ids(plan: Plan) -> str:
    """``"S1 S3"`` (or ``"none"``)."""
    return " ".join(s.id for s in plan.strategies) or "none"


def mesh_text(plan: Plan) -> str:
    return f"dp {plan.mesh.dp} x tp {plan.mesh.tp}"


def _peak_bar(peak: int, budget: int) -> str:
    share = peak / budget if budget else 0.0
    width = max(2, min(300, round(300 * min(share, 1.0))))
    cls = "bar over" if share > 1 else "bar"
    return f'<span class="{cls}" style="width:{width}px"></span> {100 * share:.0f}% of the budget'


def plan_page(plan: Plan, path, name: str = "") -> Path:
    """Write one plan as an HTML page (see the module docstring)."""
    inp = plan.inputs
    peak, budget = int(plan.predicted_peak_bytes), int(inp.budget_bytes)
    fits = plan.fits
    overview = pd.DataFrame(
        [
            ("devices", f"{inp.devices} x {human_bytes(inp.device_memory_bytes)}"),
            ("trains on", device_text(plan)),
            ("budget per device", f"{human_bytes(budget)} ({inp.budget_fraction:g} of the device memory)"),
            ("mesh", f"{mesh_text(plan)} ({plan.world} process(es))"),
            ("strategies", ", ".join(f"{s.id} {s.name}" for s in plan.strategies) or "none"),
            ("chunk size (S3)", str(plan.chunk_size or "-")),
            ("key-first decode (S4)", "yes" if plan.key_first else "no"),
            ("predicted seconds per step", step_text(plan)),
            ("predicted peak per device", f"{human_bytes(peak)}"),
            ("the peak counts", peak_counts_text(plan)),
            ("phases of the step", peak_phase_text(plan)),
            ("the peak leaves out", peak_leaves_out_text(plan)),
            ("fits", "yes" if fits else "NO"),
            ("recommended devices", recommended_text(plan)),
            ("CPU threads per process", threads_text(plan)),
            ("host memory (CPU run)", host_memory_text(plan)),
            ("memory model", f"M(L) = {human_bytes(plan.M_base_bytes)} + (L - 1) x {human_bytes(plan.M_stratum_bytes)}, L = {plan.n_strata}"),
        ],
        columns=["plan", "value"],
    )
    signals = pd.DataFrame(
        [
            (n, "raised" if s["raised"] else "no", s.get("summary", ""), ", ".join(f"{k} = {v}" for k, v in sorted(s["evidence"].items())))
            for n, s in sorted(plan.signals.items())
        ],
        columns=["signal", "state", "meaning", "evidence"],
    )
    # a listed strategy's reason goes beside it; every other one (strategies not taken
    # included) is a decision
    listed = {f"{s.id} {s.name}" for s in plan.strategies}
    why = {r.split(":", 1)[0]: r.split(":", 1)[1].strip() for r in plan.reasons if r.split(":", 1)[0] in listed}
    strategies = pd.DataFrame(
        [(s.id, s.name, s.summary, why.get(f"{s.id} {s.name}", "")) for s in plan.strategies],
        columns=["id", "name", "what", "why"],
    )
    comps = plan.memory_components
    total = sum(comps.values()) or 1
    components = pd.DataFrame(
        [(k, human_bytes(v), f"{100 * v / total:.1f}") for k, v in sorted(comps.items(), key=lambda kv: -kv[1])],
        columns=["component", "bytes", "share (%)"],
    )
    other = [r for r in plan.reasons if r.split(":", 1)[0] not in why]
    cost = plan.cost_model
    cands = cost.candidates if cost else ()
    chosen = plan.chunk_size or None
    candidates = pd.DataFrame(
        [
            (
                f"{c.chunk}" if c.chunk else "one block (no chunk)",
                "-" if c.seconds is None else f"{c.seconds:.3g}",
                human_bytes(c.need_bytes),
                human_bytes(c.transient_bytes),
                "yes" if c.fits else "no",
                "chosen" if c.chunk == chosen else "",
            )
            for c in cands
        ],
        columns=["chunk", "predicted s/step", "bytes needed", "of which transient scores", "fits", "choice"],
    )
    parts = [
        html_table(overview),
        f"<p>Predicted peak {esc(human_bytes(peak))} against the budget {esc(human_bytes(budget))}: {_peak_bar(peak, budget)}</p>",
        "<h2>Signals (from the profile, metadata only)</h2>",
        html_table(signals, row_class=lambda r: "good" if r["state"] == "raised" else ""),
        "<h2>Strategies</h2>",
        html_table(strategies) if len(strategies) else "<p>No strategy: plain single-process training.</p>",
        "<h2>Decisions</h2>",
        "<ul>" + "".join(f"<li>{esc(r)}</li>" for r in other) + "</ul>",
        *(
            [
                "<h2>Chunk candidates (cost model)</h2>",
                f"<p>{esc(cost.counts if cost else '')}. Bytes needed: the predicted peak plus one query block's transient attention scores.</p>",
                html_table(candidates, row_class=lambda r: "good" if r["choice"] == "chosen" else ""),
            ]
            if len(candidates)
            else []
        ),
        "<h2>Predicted memory per device by component</h2>",
        html_table(components, numeric=["bytes", "share (%)"]),
    ]
    verdict = "fits" if fits else "does NOT fit"
    lead = f"{mesh_text(plan)}, {strategy_ids(plan)}: predicted peak {human_bytes(peak)} per device {verdict} the budget {human_bytes(budget)}."
    return write_html(path, f"AMP plan{': ' + name if name else ''}", parts, lead=lead)


# ---------------------------------------------------------------- memory
@dataclass
class MeasuredMemory:
    """Per rank: bytes after each stratum and the step peak, maxima over steps."""

    strata: dict[int, np.ndarray] = field(default_factory=dict)  # rank -> (L,)
    peak: dict[int, int] = field(default_factory=dict)  # rank -> bytes
    steps: int = 0

    @property
    def world(self) -> int:
        return max([*self.strata, *self.peak], default=-1) + 1


def measured_memory(rows: list[dict]) -> MeasuredMemory:
    """Collect :class:`MeasuredMemory` from ``metrics.jsonl`` rows (see the module docstring).

    Rows of a multi-process run carry every rank's figures: ``rank_stratum_bytes`` (per
    rank, the bytes after each stratum) and ``rank_peak_bytes``.
    """
    out = MeasuredMemory()
    steps = set()

    def add_marks(rank: int, marks) -> None:
        marks = np.asarray(marks, dtype=np.float64)
        prev = out.strata.get(rank)
        if prev is not None and len(prev) == len(marks):
            marks = np.maximum(prev, marks)
        elif prev is not None and len(prev) > len(marks):
            marks = prev
        out.strata[rank] = marks

    for row in rows:
        rank = int(row.get("rank", 0))
        steps.add(row.get("step"))
        per_rank = row.get("rank_stratum_bytes")
        if per_rank:
            for r, marks in enumerate(per_rank):
                if marks:
                    add_marks(r, marks)
        elif row.get("stratum_bytes"):
            add_marks(rank, row["stratum_bytes"])
        peaks = row.get("rank_peak_bytes") if "rank" not in row else None
        if peaks:
            for r, p in enumerate(peaks):
                out.peak[r] = max(out.peak.get(r, 0), int(p))
        elif "peak_bytes" in row:
            out.peak[rank] = max(out.peak.get(rank, 0), int(row["peak_bytes"]))
    out.steps = len(steps)
    return out


@dataclass
class Prediction:
    label: str
    marks: np.ndarray  # (L,) bytes after each stratum
    total: int


def predictions(plan: Plan, profile: Profile | dict, world: int) -> list[Prediction]:
    """The memory model's prediction for the plan, and for the run as it ran when its
    process count ``world`` differs from the plan's (the single-process savers S3/S4 of
    the plan, data parallel over ``world`` processes, no tensor parallelism)."""
    from ..amp.memory.predict import estimate_for_profile

    profile = as_profile(profile)  # read once for the predictions below
    names = list(plan.names)
    dp, tp = plan.mesh.dp, plan.mesh.tp
    chunk = plan.chunk
    est = estimate_for_profile(profile, names, dp, tp, chunk)
    out = [Prediction(f"predicted, plan ({mesh_text(plan)}; {strategy_ids(plan)})", np.asarray(est.marks, dtype=np.float64), int(est.total))]
    if world and world != plan.world:
        run = [n for n in names if n in STRATEGIES and not STRATEGIES[n].multi_process]
        if world > 1:
            run = [DATA_PARALLEL, *run]
        est = estimate_for_profile(profile, run, world, 1, chunk)
        ids = " ".join(STRATEGIES[n].id for n in run if n in STRATEGIES) or "none"
        what = "1 process" if world == 1 else f"{world} processes"
        out.append(Prediction(f"predicted, as run ({what}; {ids})", np.asarray(est.marks, dtype=np.float64), int(est.total)))
    return out


def _unit(values) -> tuple[float, str]:
    top = max((float(np.nanmax(v)) for v in values if np.size(v)), default=0.0)
    return (GIB, "GiB") if top >= 2 * GIB else (MIB, "MiB")


def plot_memory(plan: Plan, profile: dict, rows: list[dict], path, name: str = "") -> Path:
    """Two panels: bytes held after each Hi-C stratum (predicted lines, measured markers
    per rank, the budget) and the step peak per rank (measured bars, predicted peaks and
    the budget as lines)."""
    measured = measured_memory(rows)
    world = measured.world if measured.world > 0 else plan.world
    preds = predictions(plan, profile, world)
    budget = int(plan.inputs.budget_bytes)
    scale, unit = _unit([p.marks for p in preds] + list(measured.strata.values()) + [[budget], list(measured.peak.values())])

    fig, axes = new_figure(1, 2, size=(13, 5.2), gridspec_kw={"width_ratios": [3, 2]})
    ax, axp = axes[0]
    styles = ["-", "--"]
    for i, p in enumerate(preds):
        ax.plot(np.arange(len(p.marks)), p.marks / scale, styles[i % 2], color="#333333" if i == 0 else "#888888", linewidth=2, label=p.label)
    for r in sorted(measured.strata):
        m = measured.strata[r]
        ax.plot(np.arange(len(m)), m / scale, "o", color=colour(r), markersize=6, label=f"measured, rank {r}")
    ax.axhline(budget / scale, color=LIMIT_COLOUR, linestyle=":", linewidth=1.5, label=f"budget {human_bytes(budget)}")
    ax.set_xlabel("Hi-C stratum k (bin distance; 0 = diagonal)")
    ax.set_ylabel(f"memory held after stratum k ({unit})")
    n = max([len(p.marks) for p in preds] + [len(m) for m in measured.strata.values()] + [1])
    ax.set_xticks(range(n))
    top = max([budget] + [float(np.nanmax(p.marks)) for p in preds if len(p.marks)] + [float(np.nanmax(m)) for m in measured.strata.values()])
    ax.set_ylim(0, top / scale * 1.35)  # room for the legend above the lines
    ax.grid(True, alpha=0.3)
    ax.legend(frameon=False, fontsize=8.5, loc="upper left")
    ax.set_title("Per stratum: predicted (lines) vs measured (points)")
    if not measured.strata:
        note(ax, "no per-stratum measurements in metrics.jsonl")

    ranks = sorted(measured.peak)
    if ranks:
        axp.bar([str(r) for r in ranks], [measured.peak[r] / scale for r in ranks], color=[colour(r) for r in ranks], width=0.6, label="measured peak")
    for i, p in enumerate(preds):
        axp.axhline(p.total / scale, linestyle=styles[i % 2], color="#333333" if i == 0 else "#888888", linewidth=2, label=p.label.split(" (")[0])
    axp.axhline(budget / scale, color=LIMIT_COLOUR, linestyle=":", linewidth=1.5, label="budget")
    axp.set_xlabel("rank (process)")
    axp.set_ylabel(f"step peak memory ({unit})")
    axp.set_ylim(bottom=0, top=max([budget] + [p.total for p in preds] + list(measured.peak.values())) / scale * 1.25)
    axp.legend(frameon=False, fontsize=8.5, loc="upper right")
    axp.set_title("Peak per rank (max over steps)")
    if not ranks:
        note(axp, "no peak measurements in metrics.jsonl")
    fig.suptitle(f"{name + ': ' if name else ''}memory per device, {mesh_text(plan)}, {strategy_ids(plan)} ({measured.steps} steps measured)")
    return save_png(fig, path)


def plan_report(plan_path, out, name: str = "") -> Path:
    """``ampflow report-plan``: the plan page."""
    return plan_page(Plan.read(plan_path), out, name)


def memory_report(plan_path, profile_path, metrics_path, out, name: str = "") -> Path:
    """``ampflow report-memory``: the memory figure."""
    plan = Plan.read(plan_path)
    profile = read_profile(profile_path)
    rows = read_jsonl(metrics_path, "metrics file")
    return plot_memory(plan, profile, rows, out, name)
