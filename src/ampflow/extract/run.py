"""One extraction job: one model, all its input FASTA files, one queue, one worker pool.

:func:`extract_model` is what ``ampflow extract`` (and so the workflow's per-model
extraction rule) calls: every input is split (``chunks.split_fasta``), the sequences
the vector cache lacks are queued once across all inputs (so small inputs together fill
every worker, and each worker loads the model once), the pool computes them into the
cache, and each input's outputs are written from the cache. Every step can be
interrupted at any moment, SIGKILL included: splits are reused when their manifest
matches, computed shards stay in the cache, temporaries of killed processes are
removed, and outputs appear under their final names only when complete.

Every output is data a later rule may read, rebuilt in full by every run: the progress
file comes from the shards' markers (not from this run's log), so a run that finds every
sequence cached (the re-run after a crash) writes the same progress file as the run that
computed them.
"""

from __future__ import annotations

import fcntl
import json
import logging
import shutil
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

from ..base.atomic import atomic_path, remove_stale_temps, write_text_atomic
from ..base.errors import InputError, require_file
from ..base.progress import Progress
from .cache import VectorCache
from .chunks import split_fasta, write_queue
from .config import ExtractSettings, ModelSpec, input_policy, output_files
from .markers import progress_rows, progress_text
from .merge import merge_input, read_items
from .models import cached_fingerprint, model_shape, product_names, resolve_layer, resolve_source
from .pool import WorkerPool, choose_devices
from .telemetry import GpuSampler
from .worker import Job

log = logging.getLogger(__name__)

POOLING_TEXT = {
    "mean": "mean over sequence tokens (special tokens and padding excluded)",
    "mean_special": "mean over all tokens of the sequence, special tokens included (padding excluded)",
    "bos": "the first token (<cls> / [CLS])",
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


def _remove_temps(work: Path, outputs, keep: Path) -> int:
    """Temporaries of killed runs in ``work`` (held by this job's lock) and of
    ``outputs``; none under ``keep``, the cache, which other jobs may be writing."""
    keep = keep.resolve()
    gone = [p for p in work.rglob(".tmp-*") if not p.resolve().is_relative_to(keep)]
    for p in gone:
        shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    for out in outputs:
        gone += remove_stale_temps(out)
    return len(gone)


def _publish(src: Path, dst: Path) -> None:
    """Copy a work-folder file to its declared output atomically (empty if absent)."""
    with atomic_path(dst) as tmp:
        shutil.copyfile(src, tmp) if src.exists() else tmp.write_bytes(b"")


def compute_model(
    inputs: dict,
    spec: ModelSpec,
    model_name: str,
    work,
    cache_root,
    settings: ExtractSettings | None = None,
    model_folder=None,
    record=None,
) -> dict:
    """Put every sequence of every input into the vector cache with one model; the job
    record (also written to ``record``, what :func:`write_outputs` reads).

    Parameters
    ----------
    inputs
        ``{name: {"fasta": path, "policy": {...}}}``: protein (ESM-2) or DNA (DNABERT-S)
        FASTA, plain or gzipped, and the input's own FASTA policy keys (over
        ``settings.fasta``).
    spec, model_name
        The model's settings and its name in the config (recorded in the outputs).
    work
        The model's work folder (splits, queue, telemetry); kept across failures.
    cache_root
        The vector cache (``cache.py``), possibly shared with other jobs.
    settings
        Chunk size, FASTA policies, devices, workers (defaults: ExtractSettings()).
    model_folder
        Where the model is, when not ``spec.source`` (tiny models built by the workflow).
    record
        Where to write the job record as JSON (atomically), if given.

    The sequences to compute go to a :class:`~ampflow.extract.pool.WorkerPool`, one
    worker process per slot of ``settings`` (GPUs or CPU workers).
    """
    settings = settings or ExtractSettings()
    work = Path(work)
    policies = {name: input_policy(settings, name, inp.get("policy")) for name, inp in inputs.items()}
    fastas = {name: require_file(inp["fasta"], "FASTA file") for name, inp in inputs.items()}
    t_start = time.monotonic()
    with work_lock(work):
        n_temps = _remove_temps(work, [record] if record else [], Path(cache_root))
        if n_temps:
            log.info("removed %d temporary file(s) left by an interrupted run", n_temps)
        folder = Path(model_folder) if model_folder else resolve_source(spec.source, spec.kind)
        n_layers, dim = model_shape(folder, spec.kind)
        layers = [resolve_layer(x, n_layers) for x in spec.layers]
        device, slots = choose_devices(settings.device, settings.gpus, settings.cpu_workers)
        dtype = spec.dtype if device == "cuda" else "float32"
        model_id = {"name": model_name, "kind": spec.kind, "source": spec.source or str(model_folder), "fingerprint": cached_fingerprint(folder, work)}
        ident = {"kind": spec.kind, "fingerprint": model_id["fingerprint"], "dtype": dtype}
        cache = VectorCache(cache_root, ident)
        if cache.remove_stale_temps():
            log.info("removed shard temporaries of killed writers from the cache (older than an hour)")
        products = product_names(layers, spec.poolings, spec.per_token)

        manifests = {name: split_fasta(fastas[name], work / "inputs" / name, spec, policies[name]) for name in inputs}
        index = cache.index(products)
        chunks, n_items, n_cached = write_queue(work, [work / "inputs" / n for n in inputs], index, len(slots), settings.sequences_per_file)
        del index
        todo = sum(c["n"] for c in chunks)
        log.info(
            "%s (layers %s of %d, %s, %s): %d input(s), %d distinct sequence(s) per input summed, "
            "%d found in the cache, %d to compute in %d chunk(s) on %d %s worker(s)",
            model_name, layers, n_layers, "+".join(spec.poolings), dtype, len(inputs), n_items, n_cached, todo, len(chunks),
            len(slots), device,
        )  # fmt: skip

        workers, gpu = [], {}
        if chunks:
            sampler = GpuSampler(work / "telemetry.jsonl", slots if device == "cuda" else [], settings.telemetry_interval)
            sampler.start()
            try:
                job = Job(spec, str(folder), tuple(layers), str(work), str(cache.dir.parent), ident, device, settings.threads)
                meter = Progress(todo, "sequences", log)
                workers = WorkerPool(job, slots, settings.max_attempts, settings.deadline, settings.load_deadline).run(chunks, meter)
            finally:
                gpu = sampler.stop()
            for w in workers:
                padded = w.get("padded_tokens", 0)
                log.info(
                    "%s: %d chunk(s), %d sequences, %.1f s computing, padding %.1f%%, %d batch(es) split after running out of memory",
                    w["worker"], w.get("chunks", 0), w.get("sequences", 0), w.get("seconds", 0.0),
                    100.0 * (1 - w.get("tokens", 0) / padded) if padded else 0.0, w.get("splits", 0),
                )  # fmt: skip
            for entry, g in gpu.items():
                log.info("GPU %s: mean utilisation %.1f%%, peak memory %.2f GiB", entry, g["mean_utilization_gpu"], g["peak_memory_used"] / 2**30)
        seconds = time.monotonic() - t_start
        log.info(
            "%d sequence(s) computed, %d found in the cache (%.1f s, %.1f sequences/s computed)",
            todo, n_cached, seconds, todo / seconds if seconds > 0 else 0.0,
        )  # fmt: skip
        out = {
            "model": model_id,
            "ident": ident,
            "cache": str(Path(cache_root).resolve()),
            "work": str(work.resolve()),
            "layers": layers,
            "n_layers": n_layers,
            "dim": dim,
            "poolings": spec.poolings,
            "products": products,
            "dtype": dtype,
            "max_length": spec.letters,
            "inputs": {
                name: {
                    "fasta": fastas[name].name,
                    "policy": policies[name].to_dict(),
                    "summary": manifests[name].summary,
                    "n_distinct": manifests[name].n_distinct,
                }
                for name in inputs
            },  # fmt: skip
            "run": {"chunks": len(chunks), "computed": todo, "cached": n_cached, "workers": workers, "gpu": gpu},
        }
        if record is not None:
            write_text_atomic(record, json.dumps(out, indent=1, sort_keys=True) + "\n")
        return out


def write_outputs(job: dict, name: str, files: dict) -> int:
    """One input's outputs (``config.output_files`` kinds -> paths; those given) from the
    cache, after :func:`compute_model`; the number of records."""
    work = Path(job["work"])
    inp = job["inputs"][name]
    cache = VectorCache(job["cache"], job["ident"])
    markers = cache.markers()
    index = cache.index(job["products"], markers)
    pooled = [p for p in job["products"] if not p.endswith(".tokens")]
    summary, policy = inp["summary"], inp["policy"]
    uns = {
        "model": job["model"],
        "layers": job["layers"],
        "n_layers": job["n_layers"],
        "poolings": job["poolings"],
        "products": pooled,
        "pooling_description": {p: POOLING_TEXT[p] for p in job["poolings"]},
        "dtype": job["dtype"],
        "max_length": job["max_length"],
        "truncations": {"count": int(summary.get("too_long_truncated", 0)), "max_length": job["max_length"], "policy": policy["too_long"]},
        "windows": {"records": int(summary.get("too_long_windowed", 0)), "window": job["max_length"], "overlap": policy["overlap"]},
        "fasta": {"file": inp["fasta"], "policy": policy, "summary": summary},
    }
    folder = work / "inputs" / name
    items = read_items(folder)
    n = merge_input(folder, items, index, cache.reader(), pooled, job["dim"], files.get("h5ad"), uns, files.get("windows"), files.get("tokens"))
    if "report" in files:
        _publish(folder / "report.tsv", files["report"])
    if "telemetry" in files:
        _publish(work / "telemetry.jsonl", files["telemetry"])
    if "progress" in files:
        counts = Counter(index[k][0] for k in dict.fromkeys(items["key"]))
        write_text_atomic(files["progress"], progress_text(progress_rows(markers, counts, inp["n_distinct"])))
    log.info("%s: %d record(s); written: %s", name, n, ", ".join(str(p) for p in files.values()))
    return n


def extract_model(inputs: dict, spec: ModelSpec, model_name: str, work, out_dir, settings: ExtractSettings | None = None, **kw) -> dict:
    """:func:`compute_model`, then every input's outputs in ``out_dir`` (their names from
    ``config.output_files``; the cache in ``settings.cache``, or ``out_dir/cache``)."""
    settings = settings or ExtractSettings()
    out_dir = Path(out_dir)
    job = compute_model(inputs, spec, model_name, work, Path(settings.cache) if settings.cache else out_dir / "cache", settings, **kw)
    for name, inp in inputs.items():
        policy = input_policy(settings, name, inp.get("policy"))
        write_outputs(job, name, {k: out_dir / v for k, v in output_files(name, model_name, spec, policy).items()})
    return job


def extract_fasta(fasta, spec: ModelSpec, model_name: str, work, out, report, telemetry, progress=None,
                  settings: ExtractSettings | None = None, windows=None, tokens=None, **kw) -> dict:  # fmt: skip
    """One FASTA file with one model, outputs at the given paths (the cache in
    ``settings.cache``, or ``work/cache``): :func:`compute_model` + :func:`write_outputs`
    for a caller with one file."""
    settings = settings or ExtractSettings()
    name = "input"
    job = compute_model({name: {"fasta": fasta}}, spec, model_name, work, settings.cache or Path(work) / "cache", settings, **kw)
    given = {"h5ad": out, "report": report, "telemetry": telemetry, "progress": progress, "windows": windows, "tokens": tokens}
    write_outputs(job, name, {k: Path(v) for k, v in given.items() if v is not None})
    return job
