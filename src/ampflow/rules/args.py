"""Command-line arguments the workflow's rules hand to ``ampflow`` commands, built from
config sections: each returns the text that goes into a rule's shell command, quoted
for the shell where a value may need it (an option left out is the empty string).

Called from ``workflow/rules/*.smk`` while Snakemake parses the workflow. The options
are those of :mod:`ampflow.cli`; Snakemake-free.
"""

from __future__ import annotations

import json
import logging
import shlex
from collections.abc import Callable, Collection, Iterable

from ..contract.config import ModelConfig, TrainConfig, calibration_sections
from .targets import tiny_model_folder

_LOG = logging.getLogger(__name__)


def shell_json(value) -> str:
    """``value`` (a config section) as one shell-quoted JSON argument, keys sorted."""
    return shlex.quote(json.dumps(value, sort_keys=True))


def chromosomes_arg(chromosomes: Iterable[str]) -> str:
    """``--chromosomes a,b`` for config ``genome.chromosomes``; none for all (empty)."""
    chromosomes = list(chromosomes)
    return f"--chromosomes {','.join(chromosomes)}" if chromosomes else ""


def naming_args(genome: dict, pairs: dict) -> str:
    """The chromosome naming options of the binning and RNA commands (config ``genome``,
    ``pairs.columns``): ``--chr-prefix`` and ``--chromosomes`` always (the latter
    possibly empty), ``--strip-prefix`` when one is given and ``--pairs-columns`` when
    not ``auto``."""
    args = f"--chr-prefix {genome['chr_prefix']} {chromosomes_arg(genome['chromosomes'])}"
    if genome["strip_prefix"]:
        args += f" --strip-prefix {genome['strip_prefix']}"
    if pairs["columns"] != "auto":
        args += f" --pairs-columns {pairs['columns']}"
    return args


def qc_args(qc: dict) -> str:
    """The QC thresholds (config ``qc``) as ``--min-cis-fraction 0.5 --min-contacts N ...``,
    in the order of their keys."""
    return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in sorted(qc.items()))


def calibration_args(model: dict, train: dict) -> str:
    """``--model JSON --train JSON`` for ``ampflow calibrate``: of config ``model`` and
    ``train`` (checked as the trainer checks them) only what the calibration measures with
    (:func:`ampflow.contract.config.calibration_sections`). The ``devices`` rule's params:
    a new seed, schedule, learning rate or loss weight leaves them as they were, so the
    machine is not timed again for it."""
    sections = calibration_sections(ModelConfig.from_dict(model), TrainConfig.from_dict(train))
    return f"--model {shell_json(sections['model'])} --train {shell_json(sections['train'])}"


def label_arg(key: str, columns: Collection[str], log: Callable[[str], None] = _LOG.info) -> str:
    """``--label-key KEY`` for the split when the cell sheet has that column (each of its
    labels then keeps a training cell); none otherwise, said in a ``log`` line: a split
    without labels, and evaluation has no labels either."""
    if key in columns:
        return f"--label-key {shlex.quote(key)}"
    log(f"split: no column {key!r} in the cell sheet; a random split")
    return ""


# ------------------------------------------------------------------ feature extraction
def extract_settings_arg(extract: dict) -> str:
    """Config ``extract`` less its ``inputs`` and ``models``, as :func:`shell_json`."""
    return shell_json({k: v for k, v in extract.items() if k not in ("inputs", "models")})


def extract_folder_arg(models: dict, model: str) -> str:
    """``--model-folder`` for a model marked ``tiny`` in ``models`` (name -> an
    :class:`~ampflow.extract.config.ModelSpec`): the folder the workflow builds it into
    (:func:`~.targets.tiny_model_folder`); none otherwise."""
    return f"--model-folder {tiny_model_folder(model)}" if models[model].tiny else ""


def extract_model_inputs(inputs: dict, model: str) -> list[str]:
    """Names of the inputs (checked ``extract.inputs``) that ``model`` runs on: its one
    job's queue, in config order."""
    return [name for name, inp in inputs.items() if model in inp["models"]]


def extract_input_args(inputs: dict, model: str) -> str:
    """``--input=NAME=FASTA`` per input of ``model`` and ``--policies JSON`` for those
    inputs that set their own ``policy`` keys."""
    names = extract_model_inputs(inputs, model)
    args = " ".join(shlex.quote(f"--input={n}={inputs[n]['fasta']}") for n in names)
    policies = {n: inputs[n]["policy"] for n in names if inputs[n].get("policy")}
    if policies:
        args = f"{args} --policies {shell_json(policies)}"
    return args
