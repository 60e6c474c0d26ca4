# Config and cell-sheet validation, derived names, and input functions. The checks,
# shell arguments and target lists are the package's (ampflow.rules: inputs, args,
# targets), and so is the job sizing policy (ampflow.contract.allocation.JobSizing);
# this file looks up the config and the host and hands them over.
import functools
import os
import shlex  # the evaluate rule quotes its batch key
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.logging import logger
from snakemake.utils import validate

from ampflow.extract.config import (
    ExtractSettings,
    ModelSpec,
    input_policy,
    output_files,
)
from ampflow.io.genome import resolution_label
from ampflow.io.sheet import read_sheet
from ampflow.prepare.blocks import block_digest, block_names, block_rows
from ampflow.prepare.resources import NEEDS, bin_block_mem_mb
from ampflow.devices import probe_devices
from ampflow.contract.allocation import JobSizing
from ampflow.contract.config import require_gpus
from ampflow.rules.args import (
    calibration_args,
    chromosomes_arg,
    extract_folder_arg,
    extract_input_args,
    extract_model_inputs,
    extract_settings_arg,
    label_arg,
    naming_args,
    qc_args,
    shell_json,
)
from ampflow.rules.inputs import check_config, embed_sets, extract_inputs
from ampflow.rules.targets import (
    RunPaths,
    alternatives,
    extract_model_input,
)

validate(config, "../schemas/config.schema.yaml")

DATASET = config["dataset"]
PATHS = RunPaths(DATASET)
RESULTS, LOGS, REPORT = PATHS.results, PATHS.logs, PATHS.report
INPUTS = config["inputs"]
# HAS_HIC: a cell sheet (inputs.cells); without one an extraction-only run, no Hi-C key
# is read and only the extraction rules exist (see the Snakefile). HAS_RNA: an RNA
# matrix (inputs.rna); without one a Hi-C-only dataset: RNA QC and rna.h5ad are skipped,
# the graph has anchors only and the Hi-C branch trains alone. Without --configfile the
# template config/config.yaml was read (see the Snakefile): a missing input there is
# named with how to give a configuration.
HAS_HIC, HAS_RNA = check_config(
    config, template=not workflow.config_settings.configfiles
)

#: The sizing of the devices, train and embed jobs, and what the cluster offers GPU
#: jobs (config "cluster"): partition, GPUs, CPUs and memory.
SIZING = JobSizing.from_config(config)
CLUSTER = SIZING.offer

#: This host's devices record (probed once per parse; NVML, no torch).
host_devices = functools.cache(probe_devices)


def check_local_gpus():
    """Before a local run starts any job: a config that needs a GPU (train.device: cuda,
    amp.devices: auto, amp.device_memory_gb: auto) on a host where none is visible is an
    InputError naming the key and its value, not a run that prepares the data and fails
    at its diagnose or train job. A cluster run (the jobs run elsewhere: the SLURM
    executor; inside its jobs the job step executor) and a dry run are not checked."""
    if HAS_HIC and workflow.local_exec and not workflow.remote_exec:
        require_gpus(config, host_devices())


def train_cores():
    """Cores a training job (and the devices job) reserves (JobSizing.train_cores)."""
    try:
        cores = workflow.cores
    except WorkflowError:  # no --cores (a cluster run given --jobs)
        cores = None
    gpus = len(host_devices()["devices"])
    return SIZING.train_cores(gpus, cores, os.cpu_count() or 1)


if HAS_HIC:
    # duplicates, malformed ids and missing pairs files are reported with their line;
    # Snakemake itself would only say that an input is missing
    CELLS = read_sheet(INPUTS["cells"])
    validate(CELLS, "../schemas/cells.schema.yaml")

    # The binning's jobs: blocks of consecutive sheet rows (cells appended to the sheet
    # change the last block only, or add blocks)
    BLOCK_CELLS = config["prepare"]["block_cells"]
    BLOCKS = block_names(len(CELLS), BLOCK_CELLS)


def block_sheet(block):
    """The sheet rows of a block."""
    return CELLS.iloc[block_rows(block, BLOCK_CELLS)]


def need_mem_mb(rule):
    """A rule's mem_mb from the size of its inputs and its threads (profiles/README.md)."""
    return lambda wc, input, threads: NEEDS[rule].mem_mb(input.size_mb, threads)


def need_runtime(rule):
    """A rule's runtime (minutes) from the size of its inputs and its threads."""
    return lambda wc, input, threads: NEEDS[rule].runtime(input.size_mb, threads)


TRAIN_CONFIGS = {
    f"{resolution_label(c['resolution'])}_s{c['strata']}": c for c in config["configs"]
}
RESOLUTIONS = {
    resolution_label(c["resolution"]): c["resolution"] for c in config["configs"]
}
# the finest binning: P(s) in the report is drawn from it
FINEST = min(RESOLUTIONS, key=RESOLUTIONS.get) if RESOLUTIONS else None


EXTRACT = config["extract"]
EXTRACT_SETTINGS = ExtractSettings.from_dict(EXTRACT)
EXTRACT_MODELS = {name: ModelSpec.from_dict(m) for name, m in EXTRACT["models"].items()}
#: extract.inputs less optional ones whose FASTA is absent; model names checked.
EXTRACT_INPUTS = extract_inputs(EXTRACT, EXTRACT_MODELS, logger.info)

#: Cells to embed with each trained configuration (config "embed"), by name: a
#: prepared folder or raw cells the workflow prepares (embed.smk).
EMBED_SETS = embed_sets(config["embed"], HAS_RNA)
#: The cell sheets of the raw ones (prepared under embed/cells/{name}), checked like inputs.cells.
EMBED_SHEETS = {
    name: read_sheet(e["cells"]) for name, e in EMBED_SETS.items() if "cells" in e
}
for _sheet in EMBED_SHEETS.values():
    validate(_sheet, "../schemas/cells.schema.yaml")


wildcard_constraints:
    cfg="|".join(TRAIN_CONFIGS),
    res="|".join(RESOLUTIONS),
    name=alternatives(EXTRACT_INPUTS),
    model=alternatives(EXTRACT_MODELS),
    cells=alternatives(EMBED_SETS),
    block=r"\d+",


def cfg_resolution(wildcards):
    return resolution_label(TRAIN_CONFIGS[wildcards.cfg]["resolution"])


def extract_files(name, model):
    """One input's outputs with one model, by kind (h5ad, report, ...; config.output_files)."""
    policy = input_policy(EXTRACT_SETTINGS, name, EXTRACT_INPUTS[name].get("policy"))
    return output_files(name, model, EXTRACT_MODELS[model], policy)


def all_outputs():
    """The default target: the Hi-C branch's files, then the extraction's."""
    out = (
        PATHS.hic_outputs(RESOLUTIONS, TRAIN_CONFIGS, EMBED_SETS, HAS_RNA)
        if HAS_HIC
        else []
    )
    return out + PATHS.extract_outputs(EXTRACT_INPUTS, extract_files)


def print_summary():
    """The per-configuration summary table, at the end of a successful run."""
    path = Path(REPORT) / "summary.txt"
    if path.exists():
        logger.info(f"Summary ({path}):\n{path.read_text()}")


def rna_data(wildcards):
    """The configuration's rna.h5ad as an input (none for a Hi-C-only dataset)."""
    return f"{RESULTS}/data/{wildcards.cfg}/rna.h5ad" if HAS_RNA else []


def rna_arg(flag, path):
    """``flag path`` for a dataset with RNA; nothing for a Hi-C-only one."""
    return f"{flag} {path}" if HAS_RNA else ""
