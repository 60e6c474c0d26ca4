"""Commands of the extraction branch: embed FASTA files, write tiny test models."""

from __future__ import annotations

import json
import logging
import sys

log = logging.getLogger("ampflow")


def cmd_extract(a):
    import signal

    from ..base.errors import InputError
    from ..extract.config import ExtractSettings, ModelSpec
    from ..extract.run import compute_model

    # SIGTERM (Snakemake, SLURM) unwinds like an exception: the workers are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    spec = ModelSpec.from_dict(json.loads(a.model))
    settings = ExtractSettings.from_dict(json.loads(a.settings) if a.settings else {})
    inputs = {}
    for item in a.input:
        name, sep, fasta = item.partition("=")
        if not sep or not name or not fasta:
            raise InputError("expected NAME=FASTA", key="--input", value=item)
        inputs[name] = {"fasta": fasta}
    for name, policy in (json.loads(a.policies) if a.policies else {}).items():
        if name not in inputs:
            raise InputError(f"no --input of that name (inputs: {sorted(inputs)})", key="--policies", value=name)
        inputs[name]["policy"] = policy
    compute_model(inputs, spec, a.model_name, a.work, a.cache, settings, model_folder=a.model_folder, record=a.record)


def cmd_extract_outputs(a):
    from ..base.errors import InputError, read_json
    from ..extract.run import write_outputs

    given = {"h5ad": a.out, "report": a.report, "telemetry": a.telemetry, "progress": a.progress, "windows": a.windows, "tokens": a.tokens}
    files = {k: v for k, v in given.items() if v}
    if not files:
        raise InputError("give at least one output (--out, --report, --telemetry, --progress, --windows, --tokens)", key="extract-outputs")
    write_outputs(read_json(a.record, "extraction record"), a.name, files)


def cmd_tiny_model(a):
    from ..extract.tiny import write_tiny

    write_tiny(a.kind, a.out, seed=a.seed)
    log.info("tiny %s model (random weights, seed %d) written to %s", a.kind, a.seed, a.out)


def add_commands(sub) -> None:
    """Add this group's subcommands to the ``ampflow`` parser."""
    s = sub.add_parser("extract", help="embed FASTA files with one ESM-2, DNABERT-S or ESM C model (one queue, worker pool, vector cache)")
    s.add_argument("--input", action="append", required=True, metavar="NAME=FASTA", help="an input FASTA and its name (repeat)")
    s.add_argument("--policies", default="", help="per-input FASTA policy keys as JSON {name: {key: value}} (over extract.fasta)")
    s.add_argument("--model-name", required=True, help="the model's name in the config (recorded in the outputs)")
    s.add_argument("--model", required=True, help="the model's settings as JSON (an entry of extract.models)")
    s.add_argument("--model-folder", default=None, help="model folder when not the model's source (tiny models)")
    s.add_argument("--settings", default="", help="extract settings as JSON (config section 'extract')")
    s.add_argument("--work", required=True, help="the model's work folder: splits, queue, telemetry")
    s.add_argument("--cache", required=True, help="the vector cache folder (may be shared between jobs)")
    s.add_argument("--record", required=True, help="JSON of the job (model, layers, cache, inputs) that extract-outputs reads")
    s.set_defaults(func=cmd_extract)

    s = sub.add_parser("extract-outputs", help="one input's h5ad, report, telemetry and progress from the vector cache")
    s.add_argument("--record", required=True, help="the JSON `ampflow extract` wrote")
    s.add_argument("--name", required=True, help="the input's name")
    s.add_argument("--out", default=None, help="the .h5ad (records x dim)")
    s.add_argument("--report", default=None, help="TSV of problem records (skipped, truncated, windowed, ...)")
    s.add_argument("--telemetry", default=None, help="JSONL of GPU utilisation and memory samples")
    s.add_argument("--progress", default=None, help="JSONL of the progress, rebuilt from the shards' markers")
    s.add_argument("--windows", default=None, help="the windows' .h5ad (too_long: window)")
    s.add_argument("--tokens", default=None, help="per-token vectors (.h5; per_token)")
    s.set_defaults(func=cmd_extract_outputs)

    s = sub.add_parser("tiny-model", help="write a tiny randomly initialised ESM-2, DNABERT-S or ESM C-shaped model folder")
    s.add_argument("--kind", required=True, choices=["esm2", "dnabert_s", "esmc"])
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", required=True)
    s.set_defaults(func=cmd_tiny_model)
