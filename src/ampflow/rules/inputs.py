"""The workflow's config, checked where its schema cannot: which branches a run has and
what each needs, the template's placeholders, retired keys, the sets to embed and the
inputs to extract features from.

``workflow/rules/common.smk`` calls these while Snakemake parses the workflow, after
the schema (``workflow/schemas/config.schema.yaml``) has filled in the defaults. Each
problem is an :class:`~ampflow.base.errors.InputError` naming the key and its value (or
the file). Snakemake-free; paths are read relative to the working directory, as the
workflow's are.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from pathlib import Path

from ..base.errors import InputError

_LOG = logging.getLogger(__name__)

#: The keys of ``inputs`` that name files (in the order they are checked).
INPUT_FILES = ("cells", "rna", "genes", "chromsizes")

#: What to do when the template config/config.yaml was read and names a missing file.
TEMPLATE_HINT = (
    "does not exist. No --configfile was given, so the template config/config.yaml "
    "was read: copy it (cp config/config.yaml config/my.yaml), point its inputs at "
    "your files and run snakemake --configfile config/my.yaml; "
    "make demo runs the demo (config/demo.yaml)"
)


def check_config(config: dict, template: bool) -> tuple[bool, bool]:
    """The run's branches ``(has_hic, has_rna)``, checked.

    * Hi-C (and training) when ``inputs.cells`` is given; without it the run extracts
      features only. It needs ``inputs.chromsizes`` and at least one of ``configs``.
    * RNA when ``inputs.rna`` is given; without it the dataset is Hi-C only. It needs
      ``inputs.genes``.
    * ``template``: the config is the template config/config.yaml (no ``--configfile``);
      an input file there that does not exist most likely is a placeholder never
      replaced, so the error says how to give a configuration
      (:func:`check_template_inputs`).
    * ``train.gpus`` is retired (:func:`check_retired_keys`).
    """
    inputs = config["inputs"]
    has_hic = bool(inputs.get("cells"))
    if has_hic:
        if not inputs.get("chromsizes"):
            raise InputError("is needed with inputs.cells", key="inputs.chromsizes", value=None)
        if not config["configs"]:
            raise InputError("give at least one training configuration with inputs.cells", key="configs", value=[])
    has_rna = bool(inputs.get("rna"))
    if has_rna and not inputs.get("genes"):
        raise InputError("a gene annotation is needed with an RNA matrix", key="inputs.genes", value=None)
    if template:
        check_template_inputs(inputs)
    check_retired_keys(config)
    return has_hic, has_rna


def check_template_inputs(inputs: dict) -> None:
    """An InputError for the first of :data:`INPUT_FILES` given in ``inputs`` whose file
    does not exist, with :data:`TEMPLATE_HINT`."""
    for key in INPUT_FILES:
        path = inputs.get(key)
        if path and not Path(path).exists():
            raise InputError(TEMPLATE_HINT, path=path, key=f"inputs.{key}")


def check_retired_keys(config: dict) -> None:
    """``train.gpus`` is no longer read: the plan sets the train job's GPUs, and a second
    figure could only disagree with it."""
    if "gpus" in config["train"]:
        raise InputError(
            "is no longer read: the train job asks for the plan's devices (amp.devices); give the GPUs a node offers as cluster.gpus_per_node",
            key="train.gpus",
            value=config["train"]["gpus"],
        )


def embed_sets(embed: dict, has_rna: bool) -> dict:
    """Config ``embed``: each name's entry, checked to be either a prepared folder
    (``data``) or raw cells the workflow prepares itself: a ``cells`` sheet and its
    ``rna`` counts (a Hi-C-only dataset: the sheet alone)."""
    raw, what = (
        (["cells", "rna"], "both cells and rna (a cell sheet and its RNA counts)") if has_rna else (["cells"], "cells (a cell sheet; this dataset has no RNA)")
    )
    sets = {}
    for name, entry in embed.items():
        # the schema allows no other key
        if sorted(entry) not in (["data"], raw):
            raise InputError(f"give either data (a prepared folder) or {what}", key=f"embed.{name}", value=sorted(entry))
        sets[name] = entry
    return sets


def extract_inputs(extract: dict, models: Collection[str], log: Callable[[str], None] = _LOG.info) -> dict:
    """Config ``extract.inputs`` less the optional inputs whose FASTA file is absent (each
    left out with a ``log`` line); an InputError for a model name not in ``models``
    (the names of ``extract.models``)."""
    inputs = {}
    for name, inp in extract["inputs"].items():
        for model in inp["models"]:
            if model not in models:
                raise InputError(f"unknown model; known: {sorted(models)}", key=f"extract.inputs.{name}.models", value=model)
        if inp.get("optional", False) and not Path(inp["fasta"]).exists():
            log(f"extract: {inp['fasta']} not found; optional input {name} left out")
            continue
        inputs[name] = inp
    return inputs
