# Config and cell-sheet validation, derived names, and input functions.
import json
import os
import re
import shlex
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
from ampflow.base.errors import InputError
from ampflow.io.genome import resolution_label
from ampflow.io.sheet import read_sheet
from ampflow.prepare.blocks import block_digest, block_names, block_rows
from ampflow.prepare.resources import NEEDS, bin_block_mem_mb
from ampflow.devices import probe_devices
from ampflow.contract.allocation import (
    ClusterOffer,
    devices_job_gpus,
    planned_devices,
    train_allocation,
)
from ampflow.contract.allocation import embed_threads as embed_threads_for
from ampflow.contract.allocation import gpu_partition as gpu_partition_for
from ampflow.contract.allocation import train_cores as train_cores_for
from ampflow.contract.config import AUTO_DEVICES, check_amp_devices, require_gpus
from ampflow.contract.plan import Plan

validate(config, "../schemas/config.schema.yaml")

DATASET = config["dataset"]
RESULTS = f"results/{DATASET}"
LOGS = f"logs/{DATASET}"
REPORT = f"{RESULTS}/figures"
INPUTS = config["inputs"]
# no cell sheet (inputs.cells absent): an extraction-only run; no Hi-C key is read and
# only the extraction rules exist (see the Snakefile)
HAS_HIC = bool(INPUTS.get("cells"))
if HAS_HIC:
    if not INPUTS.get("chromsizes"):
        raise InputError(
            "is needed with inputs.cells", key="inputs.chromsizes", value=None
        )
    if not config["configs"]:
        raise InputError(
            "give at least one training configuration with inputs.cells",
            key="configs",
            value=[],
        )
# no RNA matrix (inputs.rna absent or null): a Hi-C-only dataset. RNA QC and rna.h5ad
# are skipped, the graph has anchors only and the Hi-C branch trains alone.
HAS_RNA = bool(INPUTS.get("rna"))
if HAS_RNA and not INPUTS.get("genes"):
    raise InputError(
        "a gene annotation is needed with an RNA matrix", key="inputs.genes", value=None
    )


def check_template_inputs():
    """Without --configfile the template config/config.yaml is the configuration (see
    the Snakefile): a missing input there most likely means its placeholders were never
    replaced, so say how to give a configuration, not only that a file is missing."""
    if workflow.config_settings.configfiles:
        return
    for key in ("cells", "rna", "genes", "chromsizes"):
        path = INPUTS.get(key)
        if path and not Path(path).exists():
            raise InputError(
                "does not exist. No --configfile was given, so the template config/config.yaml "
                "was read: copy it (cp config/config.yaml config/my.yaml), point its inputs at "
                "your files and run snakemake --configfile config/my.yaml; "
                "make demo runs the demo (config/demo.yaml)",
                path=path,
                key=f"inputs.{key}",
            )


check_template_inputs()

if "gpus" in config["train"]:
    # the plan sets the train job's GPUs now; a second figure could only disagree with it
    raise InputError(
        "is no longer read: the train job asks for the plan's devices (amp.devices); "
        "give the GPUs a node offers as cluster.gpus_per_node",
        key="train.gpus",
        value=config["train"]["gpus"],
    )

#: What the cluster offers GPU jobs (config "cluster"): partition, GPUs, CPUs and memory.
CLUSTER = ClusterOffer.from_dict(config["cluster"])
check_amp_devices(config["amp"]["devices"])

_HOST = {}


def host_devices():
    """This host's devices record (probed once per parse; NVML, no torch)."""
    if not _HOST:
        _HOST.update(probe_devices())
    return _HOST


def check_local_gpus():
    """Before a local run starts any job: a config that needs a GPU (train.device: cuda,
    amp.devices: auto, amp.device_memory_gb: auto) on a host where none is visible is an
    InputError naming the key and its value, not a run that prepares the data and fails
    at its diagnose or train job. A cluster run (the jobs run elsewhere: the SLURM
    executor; inside its jobs the job step executor) and a dry run are not checked."""
    if HAS_HIC and workflow.local_exec and not workflow.remote_exec:
        require_gpus(config, host_devices())


def amp_devices_count():
    """amp.devices as a number for sizing jobs before a plan exists
    (ampflow.contract.allocation.planned_devices)."""
    return planned_devices(
        config["amp"]["devices"], len(host_devices()["devices"]), CLUSTER
    )


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


def block_folder(block):
    return f"{RESULTS}/binned/blocks/{block}"


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


def extract_inputs():
    """extract.inputs less optional ones whose FASTA is absent; model names checked."""
    inputs = {}
    for name, inp in EXTRACT["inputs"].items():
        for model in inp["models"]:
            if model not in EXTRACT_MODELS:
                raise InputError(
                    f"unknown model; known: {sorted(EXTRACT_MODELS)}",
                    key=f"extract.inputs.{name}.models",
                    value=model,
                )
        if inp.get("optional", False) and not Path(inp["fasta"]).exists():
            logger.info(
                f"extract: {inp['fasta']} not found; optional input {name} left out"
            )
            continue
        inputs[name] = inp
    return inputs


EXTRACT_INPUTS = extract_inputs()


def embed_sets():
    """Config "embed": each name's entry, checked: a prepared folder (``data``) or raw
    cells (``cells`` sheet + ``rna`` matrix; a Hi-C-only dataset: the sheet alone) that
    the workflow prepares itself."""
    sets = {}
    raw, what = (
        (["cells", "rna"], "both cells and rna (a cell sheet and its RNA counts)")
        if HAS_RNA
        else (["cells"], "cells (a cell sheet; this dataset has no RNA)")
    )
    for name, e in config["embed"].items():
        # the schema allows no other key
        if sorted(e) not in (["data"], raw):
            raise InputError(
                f"give either data (a prepared folder) or {what}",
                key=f"embed.{name}",
                value=sorted(e),
            )
        sets[name] = e
    return sets


#: Cells to embed with each trained configuration (config "embed"), by name.
EMBED_SETS = embed_sets()
#: The cell sheets of the raw ones (prepared under embed/cells/{name}), checked like inputs.cells.
EMBED_SHEETS = {
    name: read_sheet(e["cells"]) for name, e in EMBED_SETS.items() if "cells" in e
}
for _sheet in EMBED_SHEETS.values():
    validate(_sheet, "../schemas/cells.schema.yaml")


def embed_input(name):
    """Input function: the set's ``rna.h5ad`` or ``hic.h5ad`` (a prepared folder's, or
    the one the embed_* rules write)."""

    def files(wc):
        entry = EMBED_SETS[wc.cells]
        if "data" in entry:
            return f"{entry['data']}/{name}.h5ad"
        prep = f"{RESULTS}/embed/cells/{wc.cells}"
        return f"{prep}/rna.h5ad" if name == "rna" else f"{prep}/{wc.cfg}/hic.h5ad"

    return files


def alternatives(names):
    """A wildcard pattern matching exactly these names (none: matching nothing)."""
    return "|".join(re.escape(n) for n in names) or "(?!x)x"


wildcard_constraints:
    cfg="|".join(TRAIN_CONFIGS),
    res="|".join(RESOLUTIONS),
    name=alternatives(EXTRACT_INPUTS),
    model=alternatives(EXTRACT_MODELS),
    cells=alternatives(EMBED_SETS),
    block=r"\d+",


def cfg_resolution(wildcards):
    return resolution_label(TRAIN_CONFIGS[wildcards.cfg]["resolution"])


def chromosomes_arg():
    chroms = config["genome"]["chromosomes"]
    return f"--chromosomes {','.join(chroms)}" if chroms else ""


def naming_args():
    g = config["genome"]
    args = f"--chr-prefix {g['chr_prefix']} {chromosomes_arg()}"
    if g["strip_prefix"]:
        args += f" --strip-prefix {g['strip_prefix']}"
    if config["pairs"]["columns"] != "auto":
        args += f" --pairs-columns {config['pairs']['columns']}"
    return args


def label_arg():
    """``--label-key`` for the split when the cell sheet has that column (then the
    split is stratified by it); none otherwise: evaluation then has no labels either."""
    key = config["evaluate"]["label_key"]
    if key in CELLS.columns:
        return f"--label-key {shlex.quote(key)}"
    logger.info(f"split: no column {key!r} in the cell sheet; a random split")
    return ""


def qc_args():
    """The QC thresholds as ``--min-contacts N ...`` options."""
    return " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in sorted(config["qc"].items())
    )


def all_outputs():
    out = hic_outputs() if HAS_HIC else []
    for name, inp in EXTRACT_INPUTS.items():
        for model in inp["models"]:
            out += [
                f"{RESULTS}/extract/{f}" for f in extract_files(name, model).values()
            ]
            out += [
                f"{REPORT}/extract/{name}.{model}/{fig}"
                for fig in ("throughput.png", "gpus.png", "records.html")
            ]
    return out


def hic_outputs():
    out = [
        f"{RESULTS}/qc/cells.tsv",
        f"{RESULTS}/qc/split.tsv",
        f"{RESULTS}/binned/pseudobulk.mcool",
        f"{RESULTS}/amp/devices.json",
    ]
    out += [f"{RESULTS}/binned/{res}.scool" for res in RESOLUTIONS]
    for cfg in TRAIN_CONFIGS:
        out += [f"{RESULTS}/data/{cfg}/rna.h5ad"] if HAS_RNA else []
        out += [
            f"{RESULTS}/data/{cfg}/hic.h5ad",
            f"{RESULTS}/data/{cfg}/graph",
            f"{RESULTS}/amp/{cfg}/plan.json",
            f"{RESULTS}/train/{cfg}/model.pt",
            f"{RESULTS}/eval/{cfg}/scores.json",
            f"{RESULTS}/eval/{cfg}/umap.png",
            f"{REPORT}/{cfg}/plan.html",
            f"{REPORT}/{cfg}/memory.png",
            f"{REPORT}/{cfg}/training.png",
        ]
    out += [
        f"{RESULTS}/embed/{cfg}/{name}/embeddings.h5ad"
        for cfg in TRAIN_CONFIGS
        for name in EMBED_SETS
    ]
    out += [
        f"{REPORT}/qc/contacts.png",
        f"{REPORT}/qc/distance_decay.png",
        f"{REPORT}/qc/rna.png",
        f"{REPORT}/qc/failed_cells.html",
        f"{REPORT}/summary.html",
        f"{REPORT}/scores.png",
    ]
    return out


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


def json_arg(section):
    """A config section as one shell-quoted JSON argument."""
    return shlex.quote(json.dumps(config[section], sort_keys=True))


def tiny_model_folder(model):
    return f"resources/models/{model}"


def extract_model_input(model):
    """The model folder (or ESM C weights file) when the workflow builds it or it is
    local (re-run on change)."""
    spec = EXTRACT_MODELS[model]
    if spec.tiny:
        return tiny_model_folder(model)
    return spec.source if Path(spec.source).exists() else []


def extract_folder_arg(model):
    spec = EXTRACT_MODELS[model]
    return f"--model-folder {tiny_model_folder(model)}" if spec.tiny else ""


def extract_model_arg(model):
    return shlex.quote(json.dumps(EXTRACT["models"][model], sort_keys=True))


def extract_settings_arg():
    settings = {k: v for k, v in EXTRACT.items() if k not in ("inputs", "models")}
    return shlex.quote(json.dumps(settings, sort_keys=True))


def extract_model_inputs(model):
    """Names of the inputs one model runs on (its one job's queue)."""
    return [name for name, inp in EXTRACT_INPUTS.items() if model in inp["models"]]


def extract_files(name, model):
    """One input's outputs with one model, by kind (h5ad, report, ...; config.output_files)."""
    inp = EXTRACT_INPUTS[name]
    policy = input_policy(EXTRACT_SETTINGS, name, inp.get("policy"))
    return output_files(name, model, EXTRACT_MODELS[model], policy)


def extract_input_args(model):
    """``--input NAME=FASTA`` per input and ``--policies`` for the inputs' own keys."""
    names = extract_model_inputs(model)
    args = " ".join(
        shlex.quote(f"--input={n}={EXTRACT_INPUTS[n]['fasta']}") for n in names
    )
    policies = {
        n: EXTRACT_INPUTS[n]["policy"] for n in names if EXTRACT_INPUTS[n].get("policy")
    }
    if policies:
        args = f"{args} --policies {shlex.quote(json.dumps(policies, sort_keys=True))}"
    return args


def train_cores():
    """Cores a training job (and the devices job) reserves
    (ampflow.contract.allocation.train_cores)."""
    try:
        cores = workflow.cores
    except WorkflowError:  # no --cores (a cluster run given --jobs)
        cores = None
    return train_cores_for(
        config["train"]["threads"], amp_devices_count(), cores, os.cpu_count() or 1
    )


def embed_threads():
    return embed_threads_for(config["train"]["threads"], train_cores())


def devices_gpus():
    return devices_job_gpus(
        CLUSTER, config["train"]["device"], config["amp"]["devices"]
    )


def train_resource(name, default=None):
    """A resource of the train job read from its plan (input.plan) and the cluster offer
    (contract/allocation.py); ``default`` where the allocation does not set it. Before the
    plan exists (a dry run) the FileNotFoundError makes Snakemake show it as <TBD>."""

    def value(wildcards, input):
        if not Path(input.plan).exists():
            raise FileNotFoundError(2, "no plan yet", input.plan)
        alloc = train_allocation(Plan.read(input.plan), CLUSTER)
        return alloc.resources().get(name, default)

    return value


def gpu_partition(value):
    return gpu_partition_for(CLUSTER, config["train"]["device"], value)
