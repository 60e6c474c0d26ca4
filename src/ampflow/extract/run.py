"""One extraction job: FASTA + model -> chunks -> worker pool -> merged h5ad.

:func:`extract_fasta` is what ``ampflow extract`` (and so the workflow's ``extract``
rule) calls. Every step can be interrupted at any moment, SIGKILL included: the split
is reused when its manifest matches, finished chunks are skipped by their markers,
temporaries of killed processes are removed, and outputs appear under their final
names only when complete.

Every output is data a later rule may read, rebuilt in full by every run: the progress
file comes from the chunks' markers (not from this run's log), so a run that finds every
chunk done (the re-run after a crash) writes the same progress file as the run that
computed them.
"""

from __future__ import annotations

import fcntl
import logging
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

from ..io.atomic import atomic_path, remove_stale_temps, write_text_atomic
from ..io.errors import InputError, require_file
from ..progress import Progress
from .chunks import split_fasta
from .config import ExtractSettings, ModelSpec
from .markers import check_marker, marker_path, progress_rows, progress_text
from .merge import merge_chunks
from .models import fingerprint, model_shape, resolve_layer, resolve_source
from .pool import WorkerPool, choose_devices
from .telemetry import GpuSampler
from .worker import Job

log = logging.getLogger(__name__)

POOLING_TEXT = {
    "mean": "mean over sequence tokens (special tokens and padding excluded)",
    "mean_special": "mean over all tokens of the sequence, special tokens included (padding excluded)",
}


@contextmanager
def work_lock(work: Path):
    """Hold ``work/.lock`` (released by the kernel even after SIGKILL)."""
    work.mkdir(parents=True, exist_ok=True)
    fh = open(work / ".lock", "w")
    try:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InputError("another extraction is running in this work folder", path=work) from None
        yield
    finally:
        fh.close()


def _remove_temps(work: Path, outputs) -> int:
    gone = [p for p in work.rglob(".tmp-*")]
    for p in gone:
        shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    for out in outputs:
        gone += remove_stale_temps(out)
    return len(gone)


def _publish(src: Path, dst: Path) -> None:
    """Copy a work-folder file to its declared output atomically (empty if absent)."""
    with atomic_path(dst) as tmp:
        shutil.copyfile(src, tmp) if src.exists() else tmp.write_bytes(b"")


def extract_fasta(
    fasta,
    spec: ModelSpec,
    model_name: str,
    work,
    out,
    report,
    telemetry,
    progress=None,
    settings: ExtractSettings | None = None,
    model_folder=None,
    delay: float = 0.0,
    hang: dict | None = None,
    deadlines: dict | None = None,
    pool=WorkerPool,
) -> dict:
    """Embed every sequence of ``fasta`` with one model; a summary of the run.

    Parameters
    ----------
    fasta
        Protein (ESM-2) or DNA (DNABERT-S) FASTA, plain or gzipped.
    spec, model_name
        The model's settings and its name in the config (recorded in the outputs).
    work
        The job's work folder (chunks, outputs, markers); kept across failures.
    out, report, telemetry
        The merged ``.h5ad`` (obs x dim), the report TSV (one row per problem record),
        the GPU telemetry JSONL.
    progress
        JSONL of the progress, one row per chunk in the order they finished, rebuilt
        from the markers (:func:`~ampflow.extract.markers.progress_rows`); not written
        when None.
    settings
        Chunk size, FASTA policies, devices, workers (defaults: ExtractSettings()).
    model_folder
        Where the model is, when not ``spec.source`` (tiny models built by the workflow).
    delay
        Seconds each worker waits after a chunk (tests only).
    hang
        Tests only: a simulated hung worker, :class:`~ampflow.extract.worker.Job`'s
        ``hang_once``, ``hang_in``, ``hang_times``.
    deadlines
        ``deadline`` and/or ``load_deadline`` for the pool (seconds; default: the pool's,
        see :class:`~ampflow.extract.pool.WorkerPool`).
    pool
        The pool class: :class:`~ampflow.extract.pool.WorkerPool` (processes), or
        :class:`~ampflow.extract.pool.InlinePool` (this process; tests, debugging).
    """
    settings = settings or ExtractSettings()
    fasta = require_file(fasta, "FASTA file")
    work, out, report, telemetry = Path(work), Path(out), Path(report), Path(telemetry)
    outputs = (out, report, telemetry) + ((Path(progress),) if progress is not None else ())
    t_start = time.monotonic()
    with work_lock(work):
        n_temps = _remove_temps(work, outputs)
        if n_temps:
            log.info("removed %d temporary file(s) left by an interrupted run", n_temps)
        folder = Path(model_folder) if model_folder else resolve_source(spec.source)
        n_layers, dim = model_shape(folder)
        layer = resolve_layer(spec.layer, n_layers)
        device, slots = choose_devices(settings.device, settings.gpus, settings.cpu_workers)
        dtype = spec.dtype if device == "cuda" else "float32"
        model_id = {"name": model_name, "kind": spec.kind, "source": spec.source or str(model_folder), "fingerprint": fingerprint(folder)}
        expect = {"model": model_id, "settings": {"layer": layer, "pooling": spec.pooling, "dtype": dtype}}

        manifest = split_fasta(fasta, work, spec, settings.fasta, settings.sequences_per_file)
        todo = []
        for c in manifest.chunks:
            why = check_marker(work / "out", c["name"], c["n"], {**expect, "input_sha256": c["sha256"]})
            if why is not None:
                if why != "no marker":
                    log.info("%s: %s; computing it again", c["name"], why)
                    marker_path(work / "out", c["name"]).unlink(missing_ok=True)
                todo.append(c)
        skipped = len(manifest.chunks) - len(todo)
        log.info(
            "%s with %s (layer %d of %d, %s): %d chunk(s) skipped (done), %d to compute on %d %s worker(s)",
            fasta.name, model_name, layer, n_layers, dtype, skipped, len(todo), len(slots), device,
        )  # fmt: skip

        workers, gpu = [], {}
        if todo:
            sampler = GpuSampler(work / "telemetry.jsonl", slots if device == "cuda" else [], settings.telemetry_interval)
            sampler.start()
            try:
                job = Job(spec, str(folder), layer, str(work), expect, device, settings.threads, delay, **(hang or {}))
                meter = Progress(sum(c["n"] for c in todo), "sequences", log)
                workers = pool(job, slots, settings.max_attempts, **(deadlines or {})).run(todo, meter)
            finally:
                gpu = sampler.stop()
            for w in workers:
                padded = w.get("padded_tokens", 0)
                log.info(
                    "%s: %d chunk(s), %d sequences, %.1f s computing, padding %.1f%%",
                    w["worker"], w.get("chunks", 0), w.get("sequences", 0), w.get("seconds", 0.0),
                    100.0 * (1 - w.get("tokens", 0) / padded) if padded else 0.0,
                )  # fmt: skip
            for entry, g in gpu.items():
                log.info("GPU %s: mean utilisation %.1f%%, peak memory %.2f GiB", entry, g["mean_utilization_gpu"], g["peak_memory_used"] / 2**30)

        truncated = int(manifest.summary.get("too_long_truncated", 0))
        uns = {
            "model": model_id,
            "layer": layer,
            "n_layers": n_layers,
            "pooling": spec.pooling,
            "pooling_description": POOLING_TEXT[spec.pooling],
            "dtype": dtype,
            "max_length": spec.letters,
            "truncations": {"count": truncated, "max_length": spec.letters, "policy": settings.fasta.too_long},
            "fasta": {"file": fasta.name, "policy": settings.fasta.to_dict(), "summary": manifest.summary},
        }
        n = merge_chunks(work, manifest.chunks, dim, out, uns)
        _publish(work / "report.tsv", report)
        _publish(work / "telemetry.jsonl", telemetry)
        if progress is not None:
            write_text_atomic(progress, progress_text(progress_rows(work / "out", manifest.chunks)))
        seconds = time.monotonic() - t_start
        computed = sum(c["n"] for c in todo)
        log.info(
            "%d chunk(s) skipped (done), %d computed; %d sequences in %s (%.1f s, %.1f sequences/s computed)",
            skipped, len(todo), n, out, seconds, computed / seconds if seconds > 0 else 0.0,
        )  # fmt: skip
        return {
            "chunks": len(manifest.chunks),
            "skipped": skipped,
            "computed": len(todo),
            "sequences": n,
            "seconds": seconds,
            "workers": workers,
            "gpu": gpu,
            "summary": manifest.summary,
        }
