"""Figures and a page for the FASTA feature extraction: throughput, GPU timelines, bad records.

One extraction job (one input FASTA, one model; rule ``extract``) leaves three files
these functions read; none of them is a log (a re-run that finds every chunk done writes
them all again, and logs are for people):

**Progress** (``results/{dataset}/extract/{name}.{model}.progress.jsonl``), rebuilt by the
job from the chunks' ``.done`` markers (:func:`ampflow.extract.markers.progress_rows`):
one JSON object per finished chunk, in the order they finished, after a first row at 0::

    {"time": 1732170000.5, "sequences": 2000, "total": 45000, "chunk": "chunk-00003", "n": 500, "seconds": 12.1, "worker": "worker 1 (GPU 0)"}

Required: ``time`` (seconds) and ``sequences`` (cumulative); ``total`` is optional. An
empty file (an input with no sequence left) is an empty progress.

**GPU telemetry** (``results/{dataset}/extract/{name}.{model}.telemetry.jsonl``), one
JSON object per GPU and sample, appended by the NVML sampler thread::

    {"run": "...", "time": 1732170000.5, "elapsed": 5.0, "gpu": "0", "name": "NVIDIA H100",
     "utilization_gpu": 87, "utilization_memory": 40, "memory_used": 12884901888, "memory_total": 85899345920}

``gpu`` is the worker's ``CUDA_VISIBLE_DEVICES`` entry; ``utilization_gpu`` is NVML's
utilisation in percent (``utilization`` is accepted too); memory in bytes
(``memory_total`` optional). A line with a ``note`` and no ``gpu`` says why nothing was
sampled (no GPU, no NVML): it is kept as a note, not as a sample. A half-written last
line (the job was killed mid-write) is skipped. A missing file is shown as a run on the
CPU, with a warning naming the path: the workflow declares the file, so only a report
run by hand can miss it, and a figure is more use then than no report at all.

**Problem records** (``results/{dataset}/extract/{name}.{model}.report.tsv``), one row
per record something was done to, with a header::

    record  line  id      length  problem          action     detail
    17      233   P12345  2301    too long         truncated  kept the first 1022 residues
    18      240   Q0      0       empty sequence   skipped

Required: ``id``, ``problem`` and ``action`` (``skipped``, ``truncated``, ``replaced``,
``renamed``, ``kept``); the other columns are shown when present.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pandas as pd

from ..base.errors import InputError, require_file
from ..extract.telemetry import CPU_NOTE
from .common import GIB, colour, html_table, new_figure, note, read_jsonl, save_png, write_html

log = logging.getLogger(__name__)

RECORD_COLUMNS = ("id", "problem", "action")


# ---------------------------------------------------------------- reading
def _time_unit(seconds: float) -> tuple[float, str]:
    """Divisor and name that keep a time axis readable."""
    if seconds > 3 * 3600:
        return 3600.0, "h"
    if seconds > 600:
        return 60.0, "min"
    return 1.0, "s"


def read_progress(path) -> pd.DataFrame:
    """Progress as ``time_s`` (from the first row), ``sequences`` (cumulative) and
    ``total`` (NaN when not given), sorted by time, from the job's progress JSONL (no
    row when the input had no sequence)."""
    path = require_file(path, "progress file")
    rows = read_jsonl(path, "progress file")
    for n, r in enumerate(rows, 1):
        if "time" not in r or "sequences" not in r:
            raise InputError("progress row needs 'time' and 'sequences'", path=path, line=n)
    rows = [(float(r["time"]), float(r["sequences"]), float(r["total"]) if r.get("total") is not None else np.nan) for r in rows]
    frame = pd.DataFrame(rows, columns=["time_s", "sequences", "total"]).sort_values("time_s", kind="stable")
    if len(frame):
        frame["time_s"] -= frame["time_s"].iloc[0]
    return frame.reset_index(drop=True)


def read_gpu_samples(path) -> pd.DataFrame:
    """Telemetry samples as ``time_s`` (from the first sample), ``gpu`` (label, text),
    ``utilization_pct``, ``memory_used_bytes`` and ``memory_total_bytes`` (NaN if absent).

    Lines with a ``note`` are not samples: their notes are in ``frame.attrs["notes"]``;
    ``frame.attrs["cpu"]`` is True when the job ran on the CPU (the sampler's CPU note,
    or no file at all). A half-written last line is skipped (the sampler appends line by
    line and may be killed mid-line); any other malformed line is an InputError."""
    path = Path(path)
    out, notes = [], []
    if path.exists():
        rows = read_jsonl(path, "GPU telemetry file", partial_last=True)
    else:
        log.warning("GPU telemetry file %s does not exist: reported as a run on the CPU", path)
        rows, notes = [], [f"no telemetry file {path}"]
    for n, r in enumerate(rows, 1):
        if "gpu" not in r and "note" in r:
            notes.append(str(r["note"]))
            continue
        util = r.get("utilization_gpu", r.get("utilization"))
        if "time" not in r or "gpu" not in r or util is None or "memory_used" not in r:
            raise InputError("telemetry sample needs 'time', 'gpu', 'utilization_gpu' and 'memory_used'", path=path, line=n)
        total = float(r["memory_total"]) if r.get("memory_total") is not None else np.nan
        out.append((float(r["time"]), str(r["gpu"]), float(util), float(r["memory_used"]), total))
    frame = pd.DataFrame(out, columns=["time_s", "gpu", "utilization_pct", "memory_used_bytes", "memory_total_bytes"])
    frame = frame.sort_values(["time_s", "gpu"], kind="stable").reset_index(drop=True)
    if len(frame):
        frame["time_s"] -= frame["time_s"].min()
    frame.attrs["notes"] = notes
    frame.attrs["cpu"] = not path.exists() or (not len(frame) and CPU_NOTE in notes)
    return frame


def no_samples_text(samples: pd.DataFrame) -> str:
    """Why a telemetry frame has no sample, in the words the report shows: a CPU run says
    so plainly (nothing is wrong), anything else gives the sampler's last note."""
    notes = samples.attrs.get("notes") or []
    if samples.attrs.get("cpu"):
        return "no GPU samples (ran on CPU)"
    if notes:
        return f"no GPU samples: {notes[-1]}"
    return "no GPU samples (empty telemetry file: nothing was computed)"


def gpu_summary(samples: pd.DataFrame) -> pd.DataFrame:
    """One row per GPU: ``samples``, ``median_utilization_pct``, ``peak_memory_gib``,
    ``memory_total_gib`` (NaN if not recorded). The median, not the mean: a few idle
    samples while the model loads or the queue drains should not hide a GPU that was
    busy the rest of the time (nor a mostly idle one behind a few busy samples)."""
    rows = [
        (gpu, len(g), float(np.median(g["utilization_pct"])), float(g["memory_used_bytes"].max()) / GIB,
         float(g["memory_total_bytes"].max()) / GIB if g["memory_total_bytes"].notna().any() else np.nan)
        for gpu, g in samples.groupby("gpu", sort=True)
    ]  # fmt: skip
    return pd.DataFrame(rows, columns=["gpu", "samples", "median_utilization_pct", "peak_memory_gib", "memory_total_gib"])


def gpu_summary_lines(summary: pd.DataFrame) -> list[str]:
    """The one line per GPU the figure shows and the job log gets."""
    lines = []
    for r in summary.itertuples(index=False):
        total = f" of {r.memory_total_gib:.1f} GiB" if np.isfinite(r.memory_total_gib) else ""
        lines.append(f"GPU {r.gpu}: median utilisation {r.median_utilization_pct:.1f}%, "
                     f"peak memory {r.peak_memory_gib:.2f} GiB{total} ({r.samples} samples)")  # fmt: skip
    return lines


def read_records(path) -> pd.DataFrame:
    """The problem records report (TSV with a header, or JSON lines for ``.jsonl``/``.json``)."""
    path = require_file(path, "records report")
    if path.suffix in (".jsonl", ".json"):
        frame = pd.DataFrame(read_jsonl(path, "records report"))
    else:
        frame = pd.read_csv(path, sep="\t", dtype=str, keep_default_na=False)
    missing = [c for c in RECORD_COLUMNS if c not in frame.columns]
    if len(frame) and missing:
        raise InputError(f"records report lacks columns {missing}", path=path)
    for c in RECORD_COLUMNS:
        if c not in frame.columns:
            frame[c] = pd.Series(dtype=str)
    return frame


# ---------------------------------------------------------------- figures
def plot_throughput(progress: pd.DataFrame, path, title: str = "") -> Path:
    """Two panels against wall-clock time: sequences/s between consecutive progress rows
    (finished chunks; with the overall mean as a line), and sequences done (with the
    input's total)."""
    fig, axes = new_figure(1, 2, size=(12, 4.6))
    ax_rate, ax_done = axes[0]
    t, done = progress["time_s"].to_numpy(), progress["sequences"].to_numpy()
    div, unit = _time_unit(float(t.max()) if len(t) else 0.0)
    if len(t) >= 2:
        dt, dn = np.diff(t), np.diff(done)
        ok = dt > 0
        rate = np.clip(dn[ok] / dt[ok], 0, None)
        mid = ((t[1:] + t[:-1]) / 2)[ok]
        ax_rate.step(mid / div, rate, where="mid", color=colour(0), linewidth=1.5, label="between finished chunks")
        mean = (done[-1] - done[0]) / (t[-1] - t[0]) if t[-1] > t[0] else np.nan
        if np.isfinite(mean):
            ax_rate.axhline(mean, color="#444444", linestyle="--", linewidth=1.2, label=f"mean {mean:,.1f} sequences/s")
        ax_rate.legend(frameon=False, fontsize=9)
        ax_rate.set_ylim(bottom=0)
    else:
        note(ax_rate, "fewer than two progress rows" if len(t) else "no sequence embedded (empty input)")
    ax_rate.set_xlabel(f"time since start ({unit})")
    ax_rate.set_ylabel("throughput (sequences/s)")
    ax_rate.set_title("Sequences per second")
    ax_rate.grid(True, alpha=0.3)

    ax_done.plot(t / div, done, color=colour(2), linewidth=2, marker="o", markersize=3, label="embedded")
    total = progress["total"].dropna()
    if len(total):
        ax_done.axhline(total.iloc[-1], color="#444444", linestyle=":", linewidth=1.2, label=f"to compute: {total.iloc[-1]:,.0f} sequences")
    ax_done.set_xlabel(f"time since start ({unit})")
    ax_done.set_ylabel("sequences embedded (count, cumulative)")
    ax_done.set_ylim(bottom=0)
    ax_done.set_title(f"Progress ({done[-1]:,.0f} sequences)" if len(done) else "Progress")
    ax_done.legend(frameon=False, fontsize=9, loc="lower right")
    ax_done.grid(True, alpha=0.3)
    fig.suptitle(f"{title}Extraction throughput")
    return save_png(fig, path)


def plot_gpu_timelines(samples: pd.DataFrame, path, title: str = "") -> Path:
    """Two panels against wall-clock time, one line per GPU: utilisation (%) and memory
    used (GiB, each GPU's total memory dashed); under them one summary line per GPU
    (:func:`gpu_summary_lines`: median utilisation, peak memory), also logged."""
    summary = gpu_summary(samples)
    lines = gpu_summary_lines(summary) if len(samples) else [no_samples_text(samples)]
    for line in lines:
        log.info("%sGPU telemetry: %s", title, line)
    fig, axes = new_figure(3, 1, size=(12, 7.4 + 0.22 * len(lines)), sharex=True,
                           gridspec_kw={"height_ratios": [3, 3, 0.25 + 0.22 * len(lines)]})  # fmt: skip
    ax_u, ax_m, ax_s = axes[:, 0]
    div, unit = _time_unit(float(samples["time_s"].max()) if len(samples) else 0.0)
    for i, ((gpu, g), s) in enumerate(zip(samples.groupby("gpu", sort=True), summary.itertuples(index=False))):
        c = colour(i)
        ax_u.plot(g["time_s"] / div, g["utilization_pct"], color=c, linewidth=1.3, label=f"GPU {gpu} (median {s.median_utilization_pct:.0f}%)")
        ax_m.plot(g["time_s"] / div, g["memory_used_bytes"] / GIB, color=c, linewidth=1.3, label=f"GPU {gpu} (peak {s.peak_memory_gib:.1f} GiB)")
        if np.isfinite(s.memory_total_gib):
            ax_m.axhline(s.memory_total_gib, color=c, linestyle="--", linewidth=0.9, alpha=0.7)
    ax_u.set_ylabel("GPU utilisation (%)")
    ax_u.set_ylim(0, 105)
    ax_u.set_title("Utilisation per GPU (NVML)")
    ax_m.set_ylabel("GPU memory used (GiB)")
    ax_m.set_ylim(bottom=0)
    ax_m.set_title("Memory per GPU (dashed: the GPU's total)")
    for ax in (ax_u, ax_m):
        ax.set_xlabel(f"time since first sample ({unit})")
        ax.xaxis.set_tick_params(labelbottom=True)
        ax.grid(True, alpha=0.3)
        if len(samples):
            ax.legend(frameon=False, fontsize=9, loc="lower right", ncols=2)
        else:
            note(ax, lines[0])
    ax_s.set_axis_off()
    ax_s.text(0.0, 1.0, "\n".join(lines), ha="left", va="top", transform=ax_s.transAxes, fontsize=9, family="monospace")
    n_gpus = samples["gpu"].nunique()
    fig.suptitle(f"{title}GPU telemetry, {n_gpus} GPU(s), {len(samples)} samples")
    return save_png(fig, path)


def records_page(records: pd.DataFrame, path, title: str = "") -> Path:
    """An HTML page: counts per action and problem, then every record something was done to."""
    counts = (
        records.groupby(["action", "problem"], sort=True).size().reset_index(name="records").sort_values("records", ascending=False, kind="stable")
        if len(records)
        else pd.DataFrame(columns=["action", "problem", "records"])
    )
    order = [c for c in ("record", "line", "id", "length", "problem", "action", "detail") if c in records.columns]
    order += [c for c in records.columns if c not in order]
    by_action = records["action"].value_counts() if len(records) else pd.Series(dtype=int)
    lead = ", ".join(f"{n} record(s) {a}" for a, n in sorted(by_action.items())) or "No record needed attention"
    parts = ["<h2>By problem</h2>", html_table(counts, numeric=["records"]) if len(counts) else "<p>No record was skipped, truncated or changed.</p>"]
    if len(records):
        parts += ["<h2>Records</h2>", html_table(records[order], numeric=[c for c in ("record", "line", "length") if c in order],
                                                  row_class=lambda r: "bad" if r["action"] == "skipped" else "")]  # fmt: skip
    return write_html(path, f"{title}Skipped, truncated and changed records", parts, lead=lead + ".")


def extraction_report(out_dir, progress=None, telemetry=None, records=None, name: str = "") -> dict[str, Path]:
    """Whichever of ``throughput.png``, ``gpus.png`` and ``records.html`` have inputs, into ``out_dir``."""
    out = Path(out_dir)
    prefix = f"{name}: " if name else ""
    paths: dict[str, Path] = {}
    if progress is not None:
        paths["throughput"] = plot_throughput(read_progress(progress), out / "throughput.png", prefix)
    if telemetry is not None:
        paths["gpus"] = plot_gpu_timelines(read_gpu_samples(telemetry), out / "gpus.png", prefix)
    if records is not None:
        paths["records"] = records_page(read_records(records), out / "records.html", prefix)
    log.info("extraction report: %s", {k: str(v) for k, v in paths.items()})
    return paths


__all__ = [
    "extraction_report",
    "gpu_summary",
    "gpu_summary_lines",
    "no_samples_text",
    "plot_gpu_timelines",
    "plot_throughput",
    "read_gpu_samples",
    "read_progress",
    "read_records",
    "records_page",
]
