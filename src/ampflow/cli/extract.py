"""Commands of the extraction branch: embed FASTA files, write tiny test models."""

from __future__ import annotations

import argparse
import json
import logging
import sys

log = logging.getLogger("ampflow")


def cmd_extract(a):
    import os
    import signal

    from ..extract.config import ExtractSettings, ModelSpec
    from ..extract.run import extract_fasta

    # SIGTERM (Snakemake, SLURM) unwinds like an exception: the workers are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    spec = ModelSpec.from_dict(json.loads(a.model))
    settings = ExtractSettings.from_dict(json.loads(a.settings) if a.settings else {})
    delay = float(os.environ.get("AMPFLOW_EXTRACT_CHUNK_DELAY", a.chunk_delay))
    extract_fasta(
        a.fasta, spec, a.model_name, a.work, a.out, a.report, a.telemetry, a.progress,
        settings=settings, model_folder=a.model_folder, delay=delay,
    )  # fmt: skip


def cmd_tiny_model(a):
    from ..extract.tiny import write_tiny

    write_tiny(a.kind, a.out, seed=a.seed)
    log.info("tiny %s model (random weights, seed %d) written to %s", a.kind, a.seed, a.out)


def add_commands(sub) -> None:
    """Add this group's subcommands to the ``ampflow`` parser."""
    s = sub.add_parser("extract", help="embed a FASTA file with ESM-2 or DNABERT-S (chunks, worker pool, resume)")
    s.add_argument("fasta")
    s.add_argument("--model-name", required=True, help="the model's name in the config (recorded in the outputs)")
    s.add_argument("--model", required=True, help="the model's settings as JSON (an entry of extract.models)")
    s.add_argument("--model-folder", default=None, help="model folder when not the model's source (tiny models)")
    s.add_argument("--settings", default="", help="extract settings as JSON (config section 'extract')")
    s.add_argument("--work", required=True, help="work folder: chunks, per-chunk outputs and .done markers")
    s.add_argument("--out", required=True, help="merged .h5ad")
    s.add_argument("--report", required=True, help="TSV of problem records (skipped, truncated, ...)")
    s.add_argument("--telemetry", required=True, help="JSONL of GPU utilisation and memory samples")
    s.add_argument("--progress", default=None, help="JSONL of the progress, one row per chunk, rebuilt from the chunks' markers")
    # tests: seconds each worker waits after a chunk, a window to kill the job in
    s.add_argument("--chunk-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    s.set_defaults(func=cmd_extract)

    s = sub.add_parser("tiny-model", help="write a tiny randomly initialised ESM-2 or DNABERT-S-shaped model folder")
    s.add_argument("--kind", required=True, choices=["esm2", "dnabert_s"])
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", required=True)
    s.set_defaults(func=cmd_tiny_model)
