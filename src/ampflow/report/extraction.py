"""Figures and a page for the FASTA feature extraction: throughput, GPU timelines, bad records.

Input formats (one extraction job = one input FASTA and one model):

**Progress** (JSON lines, one object per line, written as chunks finish)::

    {"time": 1732170000.0, "sequences": 20000, "total": 1000000}

``time``: seconds (Unix time or any fixed origin; plotted from the first row);
``sequences``: sequences embedded so far, cumulative; ``total``: sequences in the
input (optional). Other keys (``rate``, ``eta_s``, ``chunks``...) are ignored: the
rate is recomputed from consecutive rows.

**GPU telemetry** (JSON lines from the NVML sampler thread), either one object per GPU
and sample::

    {"time": 1732170000.5, "gpu": 0, "utilization": 87, "memory_used": 12884901888, "memory_total": 85899345920}

or one object per sample holding every GPU::

    {"time": 1732170000.5, "gpus": [{"index": 0, "utilization": 87, "memory_used": ..., "memory_total": ...}, ...]}

``utilization`` in percent (0-100, NVML's ``gpu`` utilisation rate); ``memory_used`` and
``memory_total`` in bytes (``memory_total`` optional).

**Skipped and truncated records** (TSV with a header, or JSON lines), one row per record::

    input   record  id      action     reason                      length  kept
    a.fa    17      P12345  truncated  longer than 1022 residues   2301    1022
    a.fa    18      Q0      skipped    empty sequence              0

Required: ``id``, ``action`` (``skipped`` or ``truncated``) and ``reason``; optional:
``input``, ``record`` (1-based position in the input), ``length`` and ``kept``
(residues or bases before and after truncation).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pandas as pd

from ..io.errors import InputError, require_file
from .common import GIB, colour, html_table, new_figure, note, read_jsonl, save_png, write_html

log = logging.getLogger(__name__)

RECORD_COLUMNS = ("id", "action", "reason")


# ---------------------------------------------------------------- reading
def _time_unit(seconds: float) -> tuple[float, str]:
    """Divisor and name that keep a time axis readable."""
    if seconds > 3 * 3600:
        return 3600.0, "h"
    if seconds > 600:
        return 60.0, "min"
    return 1.0, "s"


def read_progress(path) -> pd.DataFrame:
    """Progress rows as ``time_s`` (from the first row), ``sequences`` (cumulative) and
    ``total`` (NaN when not given), sorted by time."""
    rows = read_jsonl(path, "progress file")
    for n, r in enumerate(rows, 1):
        if "time" not in r or "sequences" not in r:
            raise InputError("progress row needs 'time' and 'sequences'", path=path, line=n)
    if not rows:
        raise InputError("no progress rows", path=path)
    frame = pd.DataFrame(
        {
            "time_s": [float(r["time"]) for r in rows],
            "sequences": [float(r["sequences"]) for r in rows],
            "total": [float(r["total"]) if r.get("total") is not None else np.nan for r in rows],
        }
    ).sort_values("time_s", kind="stable")
    frame["time_s"] -= frame["time_s"].iloc[0]
    return frame.reset_index(drop=True)


def read_gpu_samples(path) -> pd.DataFrame:
    """Telemetry rows (either layout) as ``time_s`` (from the first sample), ``gpu``,
    ``utilization_pct``, ``memory_used_bytes`` and ``memory_total_bytes`` (NaN if absent)."""
    out = []
    for n, r in enumerate(read_jsonl(path, "GPU telemetry file"), 1):
        if "time" not in r:
            raise InputError("telemetry row needs 'time'", path=path, line=n)
        gpus = r["gpus"] if "gpus" in r else [r]
        for g in gpus:
            idx = g.get("gpu", g.get("index"))
            if idx is None or "utilization" not in g or "memory_used" not in g:
                raise InputError("telemetry sample needs 'gpu' (or 'index'), 'utilization' and 'memory_used'", path=path, line=n)
            out.append((float(r["time"]), int(idx), float(g["utilization"]), float(g["memory_used"]),
                        float(g["memory_total"]) if g.get("memory_total") is not None else np.nan))  # fmt: skip
    if not out:
        raise InputError("no telemetry samples", path=path)
    frame = pd.DataFrame(out, columns=["time_s", "gpu", "utilization_pct", "memory_used_bytes", "memory_total_bytes"])
    frame = frame.sort_values(["time_s", "gpu"], kind="stable")
    frame["time_s"] -= frame["time_s"].min()
    return frame.reset_index(drop=True)


def read_records(path) -> pd.DataFrame:
    """The skipped/truncated records report (TSV, or JSON lines for ``.jsonl``/``.json``)."""
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
    (with the overall mean as a line), and sequences done (with the input's total)."""
    fig, axes = new_figure(1, 2, size=(12, 4.6))
    ax_rate, ax_done = axes[0]
    t, done = progress["time_s"].to_numpy(), progress["sequences"].to_numpy()
    div, unit = _time_unit(float(t.max()) if len(t) else 0.0)
    if len(t) >= 2:
        dt, dn = np.diff(t), np.diff(done)
        ok = dt > 0
        rate = dn[ok] / dt[ok]
        mid = ((t[1:] + t[:-1]) / 2)[ok]
        ax_rate.step(mid / div, rate, where="mid", color=colour(0), linewidth=1.5, label="between progress rows")
        mean = (done[-1] - done[0]) / (t[-1] - t[0]) if t[-1] > t[0] else np.nan
        if np.isfinite(mean):
            ax_rate.axhline(mean, color="#444444", linestyle="--", linewidth=1.2, label=f"mean {mean:,.1f} sequences/s")
        ax_rate.legend(frameon=False, fontsize=9)
        ax_rate.set_ylim(bottom=0)
    else:
        note(ax_rate, "fewer than two progress rows")
    ax_rate.set_xlabel(f"time since start ({unit})")
    ax_rate.set_ylabel("throughput (sequences/s)")
    ax_rate.set_title("Sequences per second")
    ax_rate.grid(True, alpha=0.3)

    ax_done.plot(t / div, done, color=colour(2), linewidth=2, marker="o", markersize=3, label="embedded")
    total = progress["total"].dropna()
    if len(total):
        ax_done.axhline(total.iloc[-1], color="#444444", linestyle=":", linewidth=1.2, label=f"input: {total.iloc[-1]:,.0f} sequences")
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
    used (GiB, each GPU's total memory dashed)."""
    fig, axes = new_figure(2, 1, size=(12, 7), sharex=True)
    ax_u, ax_m = axes[:, 0]
    div, unit = _time_unit(float(samples["time_s"].max()) if len(samples) else 0.0)
    for gpu, g in samples.groupby("gpu", sort=True):
        c = colour(int(gpu))
        mean = g["utilization_pct"].mean()
        ax_u.plot(g["time_s"] / div, g["utilization_pct"], color=c, linewidth=1.3, label=f"GPU {gpu} (mean {mean:.0f}%)")
        ax_m.plot(g["time_s"] / div, g["memory_used_bytes"] / GIB, color=c, linewidth=1.3,
                  label=f"GPU {gpu} (peak {g['memory_used_bytes'].max() / GIB:.1f} GiB)")  # fmt: skip
        tot = g["memory_total_bytes"].dropna()
        if len(tot):
            ax_m.axhline(tot.max() / GIB, color=c, linestyle="--", linewidth=0.9, alpha=0.7)
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
    if not len(samples):
        note(ax_u, "no telemetry samples")
    n_gpus = samples["gpu"].nunique()
    fig.suptitle(f"{title}GPU telemetry, {n_gpus} GPU(s), {len(samples)} samples")
    return save_png(fig, path)


def records_page(records: pd.DataFrame, path, title: str = "", processed: int | None = None) -> Path:
    """An HTML page: counts per action and reason, then every skipped or truncated record."""
    counts = (
        records.groupby(["action", "reason"], sort=True).size().reset_index(name="records").sort_values("records", ascending=False)
        if len(records)
        else pd.DataFrame(columns=["action", "reason", "records"])
    )
    order = [c for c in ("input", "record", "id", "action", "reason", "length", "kept") if c in records.columns]
    order += [c for c in records.columns if c not in order]
    n_skip = int((records["action"] == "skipped").sum()) if len(records) else 0
    n_trunc = int((records["action"] == "truncated").sum()) if len(records) else 0
    lead = f"{n_skip} record(s) skipped, {n_trunc} truncated"
    if processed is not None:
        lead += f", of {processed:,} in the input"
    parts = ["<h2>By reason</h2>", html_table(counts, numeric=["records"]) if len(counts) else "<p>No record was skipped or truncated.</p>"]
    if len(records):
        parts += ["<h2>Records</h2>", html_table(records[order], numeric=[c for c in ("record", "length", "kept") if c in order],
                                                  row_class=lambda r: "bad" if r["action"] == "skipped" else "")]  # fmt: skip
    return write_html(path, f"{title}Skipped and truncated records", parts, lead=lead + ".")


def extraction_report(out_dir, progress=None, telemetry=None, records=None, name: str = "") -> dict[str, Path]:
    """Whichever of ``throughput.png``, ``gpus.png`` and ``records.html`` have inputs, into ``out_dir``."""
    out = Path(out_dir)
    prefix = f"{name}: " if name else ""
    paths: dict[str, Path] = {}
    done = None
    if progress is not None:
        frame = read_progress(progress)
        done = int(frame["total"].dropna().iloc[-1]) if frame["total"].notna().any() else None
        paths["throughput"] = plot_throughput(frame, out / "throughput.png", prefix)
    if telemetry is not None:
        paths["gpus"] = plot_gpu_timelines(read_gpu_samples(telemetry), out / "gpus.png", prefix)
    if records is not None:
        paths["records"] = records_page(read_records(records), out / "records.html", prefix, processed=done)
    log.info("extraction report: %s", {k: str(v) for k, v in paths.items()})
    return paths


__all__ = [
    "extraction_report",
    "plot_gpu_timelines",
    "plot_throughput",
    "read_gpu_samples",
    "read_progress",
    "read_records",
    "records_page",
]
