"""Report figures and pages: numbers on small synthetic inputs, labels with units on every
figure, and (slow) the demo's Snakemake report opened in headless Chromium.

Longer than 400 lines on purpose: the slow cases share one demo run and its report, which a
split would run again per file."""

from __future__ import annotations

import json
import os
import re
import zipfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import PROFILE, assert_labelled, metrics_rows, summary_inputs

from ampflow.amp.decide.diagnose import diagnose
from ampflow.base.errors import InputError
from ampflow.cli import main
from ampflow.prepare.qc import QCThresholds
from ampflow.report import extraction as ex
from ampflow.report.plan import measured_memory, plan_page, plot_memory, predictions
from ampflow.report.qc import distance_decay, failed_cells_page, failure_kinds, load_qc, plot_contacts, plot_distance_decay, plot_rna
from ampflow.report.summary import summary_report, text_table
from ampflow.report.training import metrics_frame, plot_training

PNG = b"\x89PNG\r\n\x1a\n"


def is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG


# ---------------------------------------------------------------- QC
def qc_table(tmp_path) -> Path:
    t = pd.DataFrame(
        {
            "cell_id": ["a", "b", "c", "d", "orphan"],
            "total": [5000, 400, 8000, 3000, ""],
            "cis": [4000, 300, 3000, 2700, ""],
            "trans": [1000, 100, 5000, 300, ""],
            "dropped_unknown_chrom": [0, 0, 0, 0, ""],
            "dropped_excluded": [0, 0, 0, 0, ""],
            "rna_umis": [2000, 3000, 2500, 50, 900],
            "rna_genes": [800, 900, 850, 30, 400],
            "in_pairs": [True, True, True, True, False],
            "in_rna": [True, True, True, True, True],
            "matched": [True, True, True, True, False],
            "cis_fraction": [0.8, 0.75, 0.375, 0.9, 0.0],
            "pass": [True, False, False, False, False],
            "reason": ["", "contacts 400 < 1000", "cis fraction 0.38 < 0.5", "RNA UMIs 50 < 500; RNA genes 30 < 200", "not in cell sheet (no pairs)"],
            "cell_type": ["x", "y", "x", "y", ""],
        }
    )
    path = tmp_path / "cells.tsv"
    t.to_csv(path, sep="\t", index=False)
    return path


def test_failure_kinds():
    assert failure_kinds("contacts 400 < 1000; RNA UMIs 49 < 500") == ["contacts", "RNA UMIs"]
    assert failure_kinds("cis fraction 0.38 < 0.5") == ["cis fraction"]
    assert failure_kinds("not in RNA matrix") == ["not in RNA matrix"]
    assert failure_kinds("") == []


def test_qc_figures_and_failed_page(tmp_path, figures):
    qc = load_qc(qc_table(tmp_path))
    assert qc["pass"].dtype == bool and np.isnan(qc.loc["orphan", "cis"])
    th = QCThresholds()
    assert is_png(plot_contacts(qc, tmp_path / "contacts.png", th))
    assert is_png(plot_rna(qc, tmp_path / "rna.png", th))
    assert len(figures) == 2
    for fig in figures:
        assert_labelled(fig)
    # contacts: the orphan (no pairs) is left out and said so
    assert "1 cell(s) without pairs" in figures[0]._suptitle.get_text()
    page = failed_cells_page(qc, tmp_path / "failed.html", th, label_key="cell_type").read_text()
    assert "4 of 5 cells failed QC" in page
    for reason in ("contacts", "cis fraction", "RNA UMIs", "RNA genes", "not in cell sheet (no pairs)"):
        assert f"<td>{reason}</td>" in page
    assert "RNA UMIs 50 &lt; 500; RNA genes 30 &lt; 200" in page  # escaped, whole


def test_load_qc_names_missing_columns(tmp_path):
    path = tmp_path / "bad.tsv"
    pd.DataFrame({"cell_id": ["a"], "total": [1]}).to_csv(path, sep="\t", index=False)
    with pytest.raises(InputError, match="lacks columns"):
        load_qc(path)


@pytest.fixture
def tiny_scool(tmp_path) -> Path:
    """Two chromosomes (10 and 5 bins of 1 kb); cell A has cis contacts at k = 0, 1, 2 and one trans."""
    import cooler

    bins = pd.DataFrame({"chrom": ["c1"] * 10 + ["c2"] * 5, "start": [i * 1000 for i in range(10)] + [i * 1000 for i in range(5)]})
    bins["end"] = bins["start"] + 1000
    px = {
        "A": pd.DataFrame({"bin1_id": [0, 0, 3, 0, 11], "bin2_id": [1, 2, 3, 12, 12], "count": [2, 3, 5, 4, 1]}),
        "B": pd.DataFrame({"bin1_id": [4], "bin2_id": [5], "count": [7]}),
    }
    path = tmp_path / "tiny.scool"
    cooler.create_scool(str(path), bins, px)
    return path


def test_distance_decay_by_hand(tiny_scool, tmp_path, figures):
    decay = distance_decay(tiny_scool, ["A", "B"], n_bins=30)
    assert decay.resolution == 1000
    # one distance bin per k: k = 1 .. 9, centres k x 1 kb
    assert np.allclose(decay.distance, np.arange(1, 10) * 1000)
    a, b = decay.curves.loc["A"].to_numpy(), decay.curves.loc["B"].to_numpy()
    # A: cis contacts 2 (k=1) + 3 (k=2) + 5 (k=0) + 1 (c2, k=1) = 11; same-chromosome pairs at k=1: 9 + 4, at k=2: 8 + 3
    assert a[0] == pytest.approx((2 + 1) / 13 / 11)
    assert a[1] == pytest.approx(3 / 11 / 11)
    assert a[2] == 0
    assert b[0] == pytest.approx(7 / 13 / 7) and b[1] == 0
    plot_distance_decay(decay, pd.Series({"A": "x", "B": "y"}), tmp_path / "ps.png")
    assert_labelled(figures[-1])
    with pytest.raises(InputError, match="not in the file"):
        distance_decay(tiny_scool, ["A", "nope"])


def test_measured_memory_from_rank_zero_rows_and_per_rank_rows():
    m = measured_memory(metrics_rows(world=2))
    assert m.world == 2 and m.steps == 3
    assert list(m.strata) == [0] and list(m.strata[0]) == [103, 113, 123, 133]  # max over steps
    assert m.peak == {0: 303, 1: 293}
    m = measured_memory(metrics_rows(world=3, per_rank=True))
    assert sorted(m.strata) == [0, 1, 2] and list(m.strata[2]) == [105, 115, 125, 135]
    assert m.peak == {0: 203, 1: 204, 2: 205}
    assert measured_memory([]).world == 0


def test_predictions_for_the_plan_and_as_run():
    plan = diagnose(PROFILE, 2, 2**30, 0.9)
    assert plan.to_dict()["mesh"] == {"dp": 2, "tp": 1}
    (only,) = predictions(plan, PROFILE, world=2)
    assert only.total == plan.predicted_peak_bytes and len(only.marks) == 4
    assert np.all(np.diff(only.marks) > 0), "memory grows with every stratum"
    # a run in one process is predicted without S1 (full batch per process): more memory
    plan_pred, as_run = predictions(plan, PROFILE, world=1)
    # (one block of attention fits and is the fastest: the plan has no S3)
    assert "as run (1 process; none)" in as_run.label and as_run.total > plan_pred.total


def test_memory_figure_and_plan_page(tmp_path, figures):
    plan = diagnose(PROFILE, 2, 2**30, 0.9)
    assert is_png(plot_memory(plan, PROFILE, metrics_rows(world=2), tmp_path / "m.png", "toy"))
    assert is_png(plot_memory(plan, PROFILE, metrics_rows(world=3, per_rank=True), tmp_path / "m3.png", "toy"))
    assert is_png(plot_memory(plan, PROFILE, [], tmp_path / "m0.png", "toy"))  # nothing measured yet
    for fig in figures:
        assert_labelled(fig)
    labels = [t.get_text() for t in figures[1].axes[0].get_legend().get_texts()]
    assert [lb for lb in labels if lb.startswith("measured")] == ["measured, rank 0", "measured, rank 1", "measured, rank 2"]
    assert any(lb.startswith("predicted, as run (3 processes") for lb in labels)
    page = plan_page(plan, tmp_path / "plan.html", "toy").read_text()
    for text in ("AMP plan: toy", "dp 2 x tp 1", "S1 data_parallel", "ATTENTION_DECODER", "HEAVY_DECOMPOSITION", "recommended devices", "% of the budget"):
        assert text in page
    # the cost model: the plan's seconds per step and every chunk candidate, one block chosen
    assert "predicted seconds per step" in page and f"{plan.predicted_step_seconds:.3g} s" in page
    assert "Chunk candidates (cost model)" in page and "S3 chunked_attention not taken" in page
    assert page.count("<td>chosen</td>") == 1 and "<td>one block (no chunk)</td>" in page


# ---------------------------------------------------------------- training and summary
def test_training_figure(tmp_path, figures):
    rows = metrics_rows(n_steps=6, world=1) + [{"step": 1, "rank": 1, "loss": {"total": 99.0}}]
    frame = metrics_frame(rows)
    assert len(frame) == 6 and list(frame["stage"].unique()) == ["pretrain", "finetune"]  # rank 1 left out
    assert is_png(plot_training(frame, tmp_path / "t.png", "toy"))
    (fig,) = figures
    assert_labelled(fig)
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert titles[:3] == ["total", "rna_nll", "align"] and titles[-1].startswith("throughput")
    with pytest.raises(InputError, match="no metrics rows"):
        metrics_frame([])


def test_summary_files_and_text(tmp_path, figures):
    cfgs = summary_inputs(tmp_path, {"500kb_s10": {"ari": 0.9, "nmi": 0.8, "foscttm": 0.1}, "250kb_s12": {"ari": None, "nmi": None, "foscttm": 0.4}})
    paths = summary_report(cfgs, tmp_path / "out", dataset="toy")
    table = pd.read_csv(paths["tsv"], sep="\t")
    assert list(table["configuration"]) == ["500kb_s10", "250kb_s12"]
    assert table.loc[0, "measured_peak_bytes"] == 303 and table.loc[0, "processes"] == 2
    text = paths["txt"].read_text().splitlines()
    assert text[0].split()[:6] == ["configuration", "ARI", "NMI", "FOSCTTM", "strategies", "mesh"]
    assert text[2].split()[:4] == ["500kb_s10", "0.900", "0.800", "0.100"] and text[3].split()[1] == "-"
    assert all(ln == ln.rstrip() for ln in text)
    assert "Summary of 2 configuration(s)" in paths["html"].read_text()
    assert_labelled(figures[-1])
    assert text_table(table) == paths["txt"].read_text()


def test_umap_figure_panels_and_labels(tmp_path, figures):
    import anndata as ad

    from ampflow.evaluate.umap import plot_umap

    rng = np.random.default_rng(0)
    centres = rng.normal(0, 5, (3, 4))
    types = np.repeat([0, 1, 2], 12)
    a = ad.AnnData(obs=pd.DataFrame({"cell_type": [f"t{t}" for t in types]}, index=[f"c{i}" for i in range(36)]))
    a.obsm["X_rna"] = (centres[types] + rng.normal(0, 0.3, (36, 4))).astype(np.float32)
    a.obsm["X_hic"] = (centres[types] + rng.normal(0, 0.3, (36, 4))).astype(np.float32)
    a.obsm["X_joint"] = (a.obsm["X_rna"] + a.obsm["X_hic"]) / 2
    assert is_png(plot_umap(a, tmp_path / "umap.png", seed=0))
    (fig,) = figures
    assert_labelled(fig)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles[0].startswith("Joint latent X_joint by cell type") and titles[2].startswith("RNA and Hi-C latents by modality")


# ---------------------------------------------------------------- extraction telemetry
def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_extraction_progress_from_jsonl_and_throughput(tmp_path, figures):
    t0 = 1_732_170_000.0
    p = write_jsonl(tmp_path / "progress.jsonl", [{"time": t0 + 10 * i, "sequences": 100 * i * i, "total": 5000, "eta_s": 1} for i in range(6)])
    frame = ex.read_progress(p)
    assert list(frame["time_s"]) == [0, 10, 20, 30, 40, 50] and frame["sequences"].iloc[-1] == 2500
    assert is_png(ex.plot_throughput(frame, tmp_path / "tp.png"))
    assert_labelled(figures[-1])
    rate = figures[-1].axes[0].get_lines()[0].get_ydata()
    assert list(rate) == [10, 30, 50, 70, 90]  # sequences/s between rows: 100 (2i + 1) / 10
    with pytest.raises(InputError, match="'time' and 'sequences'"):
        ex.read_progress(write_jsonl(tmp_path / "bad.jsonl", [{"time": 1}]))


def test_extraction_progress_from_the_markers(tmp_path, figures):
    """The progress file the extraction rebuilds from its cache shards' markers; an empty
    one (no sequence left) is an empty progress; a log is not a progress file."""
    from ampflow.extract.cache import VectorCache
    from ampflow.extract.markers import progress_rows, progress_text

    cache = VectorCache(tmp_path / "cache", {"model": "m"})
    # finished out of order (two workers), with the seconds each took; the input has
    # every sequence of the first two shards and 2 of the third's 3
    names = []
    for i, (n, t, sec) in enumerate(zip((4, 4, 3), (1_000_012.5, 1_000_010.0, 1_000_020.0), (2.0, 4.0, 1.5))):
        keys = [f"k{i}_{j}" for j in range(n)]
        names.append(cache.write(f"{i:064d}", keys, {"L1.mean": np.zeros((n, 3))}, finished=t, seconds=sec, worker="w")["shard"])
    counts = {names[0]: 4, names[1]: 4, names[2]: 2}
    path = tmp_path / "progress.jsonl"
    path.write_text(progress_text(progress_rows(cache.markers(), counts, 10)))
    frame = ex.read_progress(path)
    assert list(frame["time_s"]) == [0.0, 4.0, 6.5, 14.0]  # from the start of the first to finish (10.0 - 4.0)
    assert list(frame["sequences"]) == [0, 4, 8, 10] and set(frame["total"]) == {10}
    assert is_png(ex.plot_throughput(frame, tmp_path / "tp.png"))
    assert list(figures[-1].axes[0].get_lines()[0].get_ydata()) == [1.0, 1.6, 2 / 7.5]

    path.write_text("")
    empty = ex.read_progress(path)
    assert empty.empty and is_png(ex.plot_throughput(empty, tmp_path / "none.png"))
    assert any("no sequence embedded" in t.get_text() for t in figures[-1].axes[0].texts)
    path.write_text("2026-11-21 10:00:00,250 INFO x: done 10/40 sequences (25.0%), 1.0 sequences/s, ETA 30s\n")
    with pytest.raises(InputError, match="not valid JSON"):
        ex.read_progress(path)


def telemetry_rows(n_samples=5, gpus=("0", "1")):
    """What ampflow.extract.telemetry.GpuSampler writes: one line per GPU and sample."""
    return [{"run": "r1", "time": 100.0 + 5 * s, "elapsed": 5.0 * s, "gpu": g, "name": "GPU model", "utilization_gpu": 50 + i,
             "utilization_memory": 10, "memory_used": (i + 1) * 2**30, "memory_total": 80 * 2**30}
            for s in range(n_samples) for i, g in enumerate(gpus)]  # fmt: skip


def test_extraction_gpu_samples(tmp_path, figures):
    a = ex.read_gpu_samples(write_jsonl(tmp_path / "t.jsonl", telemetry_rows()))
    assert list(a.columns) == ["time_s", "gpu", "utilization_pct", "memory_used_bytes", "memory_total_bytes"]
    assert a["time_s"].min() == 0 and a["time_s"].max() == 20 and sorted(a["gpu"].unique()) == ["0", "1"]
    assert list(a.loc[a["gpu"] == "1", "utilization_pct"].unique()) == [51]
    assert is_png(ex.plot_gpu_timelines(a, tmp_path / "gpus.png", "toy: "))
    assert_labelled(figures[-1])
    assert "2 GPU(s), 10 samples" in figures[-1]._suptitle.get_text()
    # 'utilization' is read as well; a note line is a note, not a sample
    rows = [{"time": 1.0, "gpu": 0, "utilization": 70, "memory_used": 5}, {"run": "r2", "time": 2.0, "note": "no NVML"}]
    b = ex.read_gpu_samples(write_jsonl(tmp_path / "b.jsonl", rows))
    assert len(b) == 1 and b["utilization_pct"].iloc[0] == 70 and b.attrs["notes"] == ["no NVML"]
    # CPU workers: only a note; the figure says so
    c = ex.read_gpu_samples(write_jsonl(tmp_path / "c.jsonl", [{"run": "r", "time": 1.0, "note": "no GPU: CPU workers"}]))
    assert c.empty and is_png(ex.plot_gpu_timelines(c, tmp_path / "none.png"))
    texts = [t.get_text() for t in figures[-1].axes[0].texts]
    assert any("no GPU samples: no GPU: CPU workers" in t for t in texts)
    with pytest.raises(InputError, match="'utilization_gpu' and 'memory_used'"):
        ex.read_gpu_samples(write_jsonl(tmp_path / "bad.jsonl", [{"time": 1, "gpu": "0"}]))


class FakeNvml:
    """A stand-in for ``pynvml`` that GpuSampler imports: per GPU index, utilisation and
    memory used from fixed lists, one value per sample; when the first GPU's list runs out
    it raises like a GPU fallen off the bus, so the sampler stops by itself after exactly
    that many samples (and writes its "sampling stopped" note)."""

    def __init__(self, util: dict[int, list[int]], used: dict[int, list[int]], total: int):
        import threading
        from types import SimpleNamespace

        self.util, self.used, self.total, self.calls = util, used, total, {i: 0 for i in util}
        self.done, self.ns = threading.Event(), SimpleNamespace

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return b"Fake GPU"  # older pynvml returns bytes: the sampler decodes them

    def nvmlDeviceGetUtilizationRates(self, h):
        k = self.calls[h]
        if k >= len(self.util[h]):
            self.done.set()
            raise RuntimeError(f"GPU {h} fell off the bus")
        self.calls[h] += 1
        return self.ns(gpu=self.util[h][k], memory=7)

    def nvmlDeviceGetMemoryInfo(self, h):
        return self.ns(used=self.used[h][self.calls[h] - 1], total=self.total)


def sampled_telemetry(path, monkeypatch) -> dict:
    """A telemetry file written by the real GpuSampler (its thread, its writer) from a
    fake NVML: GPUs "0" and "1", 7 samples each; the sampler's own summary."""
    import sys

    from ampflow.extract.telemetry import GpuSampler

    # skewed on purpose: the median and the mean differ, the peak is mid-run
    fake = FakeNvml(
        util={0: [3, 97, 95, 0, 99, 98, 2], 1: [10, 20, 90, 15, 12, 100, 11]},
        used={0: [1 * 2**30, 9 * 2**30, 23 * 2**30 + 5, 12 * 2**30, 11 * 2**30, 10 * 2**30, 2**29],
              1: [2**28, 3 * 2**30, 3 * 2**30, 40 * 2**30, 3 * 2**30, 3 * 2**30, 3 * 2**30]},
        total=80 * 2**30,
    )  # fmt: skip
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    sampler = GpuSampler(path, ["0", "1"], interval=0.001, run="r1").start()
    assert fake.done.wait(10), "the sampler never used up the fake GPU's samples"
    return sampler.stop()


def test_gpu_summary_from_the_samplers_own_file(tmp_path, monkeypatch, figures):
    """Per GPU, the figure's summary line gives the median utilisation and peak memory of
    that GPU's samples, computed here with numpy from the raw lines the sampler wrote."""
    path = tmp_path / "x.esm.telemetry.jsonl"
    own = sampled_telemetry(path, monkeypatch)
    raw = [json.loads(line) for line in path.read_text().splitlines()]
    assert raw[-1]["note"] == "sampling stopped: GPU 0 fell off the bus"
    expect = {}
    for gpu in ("0", "1"):
        rows = [r for r in raw if r.get("gpu") == gpu]
        assert len(rows) == 7 and {r["name"] for r in rows} == {"Fake GPU"}
        expect[gpu] = (np.median([r["utilization_gpu"] for r in rows]), np.max([r["memory_used"] for r in rows]) / 2**30)
    assert expect["0"][0] == 95 and expect["1"][0] == 15  # medians far from the means (56, 37)

    samples = ex.read_gpu_samples(path)
    assert samples.attrs["notes"] == ["sampling stopped: GPU 0 fell off the bus"] and not samples.attrs["cpu"]
    summary = ex.gpu_summary(samples).set_index("gpu")
    for gpu, (median, peak) in expect.items():
        assert summary.loc[gpu, "samples"] == 7
        assert summary.loc[gpu, "median_utilization_pct"] == median
        assert summary.loc[gpu, "peak_memory_gib"] == pytest.approx(peak, rel=1e-12)
        assert summary.loc[gpu, "memory_total_gib"] == 80
        assert own[gpu]["peak_memory_used"] == round(peak * 2**30)  # the sampler's own view agrees

    assert is_png(ex.plot_gpu_timelines(samples, tmp_path / "gpus.png", "x.esm: "))
    fig = figures[-1]
    assert_labelled(fig)
    shown = "\n".join(t.get_text() for ax in fig.axes for t in ax.texts).splitlines()
    pattern = re.compile(r"GPU (\S+): median utilisation ([\d.]+)%, peak memory ([\d.]+) GiB of ([\d.]+) GiB \((\d+) samples\)")
    parsed = {m[1]: m for m in map(pattern.fullmatch, shown) if m}
    assert sorted(parsed) == ["0", "1"], shown
    for gpu, (median, peak) in expect.items():
        m = parsed[gpu]
        assert float(m[2]) == pytest.approx(median, abs=0.05) and float(m[3]) == pytest.approx(peak, abs=0.005)
        assert float(m[4]) == 80 and int(m[5]) == 7
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["GPU 0 (median 95%)", "GPU 1 (median 15%)"]


def test_gpu_samples_half_written_last_line(tmp_path, monkeypatch, caplog):
    """A job killed mid-write leaves a last line without its newline: the reader skips it
    (naming file and line); a malformed line anywhere else stays an error; the next
    sampler start cuts the stub instead of gluing its first line onto it."""
    from ampflow.extract.telemetry import GpuSampler

    path = tmp_path / "t.jsonl"
    sampled_telemetry(path, monkeypatch)
    whole = ex.read_gpu_samples(path)
    text = path.read_text()
    n_lines = len(text.splitlines())
    cut = text + json.dumps(telemetry_rows(1, ("0",))[0])[:57]  # stops inside a value
    path.write_text(cut)
    with caplog.at_level("WARNING"):
        half = ex.read_gpu_samples(path)
    pd.testing.assert_frame_equal(half, whole)
    assert f"{path}, line {n_lines + 1}: skipped a half-written last line" in caplog.text

    path.write_text(cut + "\n")  # the same stub with a newline is not a cut line: an error
    with pytest.raises(InputError, match=re.escape(f"{path}:{n_lines + 1}: not valid JSON")):
        ex.read_gpu_samples(path)
    lines = text.splitlines(keepends=True)
    path.write_text("".join(lines[:3]) + lines[3][:20] + "".join(lines[4:]))  # line 4 cut, the rest whole
    with pytest.raises(InputError, match=re.escape(f"{path}:4: not valid JSON")):
        ex.read_gpu_samples(path)

    # a re-run appends to the same file: the stub is cut first, so every line parses
    path.write_text(cut)
    GpuSampler(path, [], run="r2").start().stop()  # a CPU re-run: writes its note
    after = path.read_text()
    assert after.startswith(text) and after.count("\n") == n_lines + 1
    again = ex.read_gpu_samples(path)
    pd.testing.assert_frame_equal(again, whole, check_like=True)
    assert again.attrs["notes"][-1] == "no GPU in use (CPU workers): nothing sampled"


def test_gpu_samples_missing_file_and_cpu_run(tmp_path, figures):
    """No file, or only the sampler's CPU note: the figure says the job ran on the CPU;
    an NVML failure is not a CPU run and says what happened; an empty file (nothing was
    left to compute) says that."""
    from ampflow.extract.telemetry import GpuSampler

    missing = ex.read_gpu_samples(tmp_path / "absent.jsonl")
    assert missing.empty and missing.attrs["cpu"]
    cpu_file = tmp_path / "cpu.jsonl"
    GpuSampler(cpu_file, []).start().stop()
    cpu = ex.read_gpu_samples(cpu_file)
    assert cpu.empty and cpu.attrs["cpu"]
    nvml = ex.read_gpu_samples(write_jsonl(tmp_path / "nvml.jsonl", [{"run": "r", "time": 1.0, "note": "NVML unavailable (x): nothing sampled"}]))
    (tmp_path / "empty.jsonl").write_text("")
    empty = ex.read_gpu_samples(tmp_path / "empty.jsonl")
    expect = [
        (missing, "no GPU samples (ran on CPU)"),
        (cpu, "no GPU samples (ran on CPU)"),
        (nvml, "no GPU samples: NVML unavailable (x): nothing sampled"),
        (empty, "no GPU samples (empty telemetry file: nothing was computed)"),
    ]
    for i, (frame, text) in enumerate(expect):
        assert is_png(ex.plot_gpu_timelines(frame, tmp_path / f"g{i}.png"))
        fig = figures[-1]
        assert_labelled(fig)
        for ax in fig.axes:  # both panels and the summary line
            assert [t.get_text() for t in ax.texts] == [text]


RECORDS = "record\tline\tid\tlength\tproblem\taction\tdetail\n" \
          "17\t233\tP1\t2301\ttoo long\ttruncated\tkept the first 1022 residues\n" \
          "18\t240\tQ0\t0\tempty sequence\tskipped\t\n" \
          "30\t300\tP1\t90\tduplicate id\trenamed\tnow P1_2\n" \
          "31\t301\tP9\t80\tempty sequence\tskipped\t\n"  # fmt: skip


def test_extraction_records(tmp_path):
    tsv = tmp_path / "proteins.esm.report.tsv"
    tsv.write_text(RECORDS)
    recs = ex.read_records(tsv)
    page = ex.records_page(recs, tmp_path / "r.html").read_text()
    assert "1 record(s) renamed, 2 record(s) skipped, 1 record(s) truncated." in page
    assert '<td>empty sequence</td><td class="num">2</td>' in page.replace("<td>skipped</td>", "")
    assert "<td>kept the first 1022 residues</td>" in page and page.count('class="bad"') == 2
    jsl = write_jsonl(tmp_path / "r.jsonl", recs.to_dict("records"))
    assert ex.read_records(jsl).equals(recs)
    empty = tmp_path / "empty.tsv"
    empty.write_text("record\tline\tid\tlength\tproblem\taction\tdetail\n")
    assert "No record was skipped, truncated or changed" in ex.records_page(ex.read_records(empty), tmp_path / "e.html").read_text()
    bad = tmp_path / "bad.tsv"
    bad.write_text("id\tnote\nx\ty\n")
    with pytest.raises(InputError, match="lacks columns"):
        ex.read_records(bad)


def test_report_extraction_cli(tmp_path):
    progress = write_jsonl(tmp_path / "p.jsonl", [{"time": 100.0 + 10 * i, "sequences": 10 * i, "total": 50} for i in range(6)])
    tel = write_jsonl(tmp_path / "t.jsonl", telemetry_rows(gpus=("0",)))
    recs = tmp_path / "r.tsv"
    recs.write_text(RECORDS)
    out = tmp_path / "out"
    assert (
        main(["report-extraction", "--progress", str(progress), "--telemetry", str(tel), "--records", str(recs), "--out-dir", str(out), "--name", "toy"]) == 0
    )
    assert sorted(p.name for p in out.iterdir()) == ["gpus.png", "records.html", "throughput.png"]
    assert main(["report-extraction", "--out-dir", str(out)]) == 2


# ---------------------------------------------------------------- the demo's report in a browser
def report_results(report_html: Path) -> dict:
    """The report's ``results`` table (path -> caption, mime type, labels...)."""
    m = re.search(r"var results = (\{.*?\});\n", report_html.read_text(encoding="utf-8"), re.S)
    assert m, "no results table in report.html"
    return json.loads(m.group(1))


@pytest.mark.slow
def test_demo_report_every_result_has_a_caption(readme_run, tmp_path):
    dest, proc, _ = readme_run
    assert proc.returncode == 0, "the README commands (make demo) failed; see test_readme"
    with zipfile.ZipFile(dest / "results/demo/report.zip") as z:
        z.extractall(tmp_path)
    results = report_results(tmp_path / "report" / "report.html")
    names = sorted(Path(k).name for k in results)
    expected = ["contacts.png", "distance_decay.png", "failed_cells.html", "rna.png", "scores.png", "summary.html"]
    expected += ["memory.png", "plan.html", "training.png", "umap.png"] * 2
    assert names == sorted(expected)
    for path, r in results.items():
        assert len(re.sub(r"<[^>]+>", "", r["caption"]).split()) >= 20, f"{path}: caption too short"
        assert (tmp_path / "report" / r["data_uri"]).is_file(), path
    memory = next(r for k, r in results.items() if k.endswith("500kb_s10/memory.png"))
    assert "500kb_s10" in memory["caption"] and "predicted" in memory["caption"]


@pytest.mark.slow
def test_demo_report_screenshots(readme_run, tmp_path):
    """The report's main page and one figure page in headless Chromium. Screenshots go to
    $AMPFLOW_REPORT_SHOTS when set (to look at them), else to the test's temp folder."""
    from PIL import Image
    from report_shots import install_chromium, report_screenshots

    dest, proc, _ = readme_run
    assert proc.returncode == 0, "the README commands (make demo) failed; see test_readme"
    browser = install_chromium()
    if browser is None:
        pytest.skip("no headless Chromium: `apt-get install -y chromium` was not possible here (needs root and apt)")
    out = Path(os.environ.get("AMPFLOW_REPORT_SHOTS") or tmp_path / "shots")
    shots = report_screenshots(dest / "results/demo/report.zip", out, results=("500kb_s10/memory.png", "qc/distance_decay.png", "250kb_s12/plan.html"))
    for name, path in shots.items():
        img = np.asarray(Image.open(path).convert("L"), dtype=float)
        assert img.shape == (1000, 1400), name
        # not a blank page: dark text and figure lines on a light background
        assert img.std() > 20 and (img < 100).mean() > 0.005, f"{name} looks blank: {path}"
    # the figure page shows the figure (a large light area right of the side panel) and its
    # caption (the side panel is dark; its width follows the figure's, at least ~200 px)
    fig = np.asarray(Image.open(shots["500kb_s10/memory.png"]).convert("L"), dtype=float)
    assert fig[:, 500:].mean() > 200 and fig[100:600, 20:180].mean() < 150


def test_measured_memory_reads_every_rank_of_a_sharded_run():
    from ampflow.report.plan import measured_memory

    rows = [
        {"step": 1, "peak_bytes": 90, "stratum_bytes": [10, 20], "rank_peak_bytes": [90, 80], "rank_stratum_bytes": [[10, 20], [9, 18]]},
        {"step": 2, "peak_bytes": 95, "stratum_bytes": [11, 19], "rank_peak_bytes": [95, 70], "rank_stratum_bytes": [[11, 19], [8, 21]]},
    ]
    m = measured_memory(rows)
    assert m.world == 2 and m.steps == 2
    assert m.peak == {0: 95, 1: 80}
    assert m.strata[0].tolist() == [11, 20] and m.strata[1].tolist() == [9, 21]
