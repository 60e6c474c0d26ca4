# Config and cell-sheet validation, derived names, and input functions.
import json
import shlex
from pathlib import Path

from snakemake.logging import logger

from snakemake.utils import validate

from ampflow.io.genome import resolution_label
from ampflow.io.sheet import read_sheet

validate(config, "../schemas/config.schema.yaml")

DATASET = config["dataset"]
RESULTS = f"results/{DATASET}"
LOGS = f"logs/{DATASET}"
REPORT = f"{RESULTS}/figures"
INPUTS = config["inputs"]


# duplicates, malformed ids and missing pairs files are reported with their line;
# Snakemake itself would only say that an input is missing
CELLS = read_sheet(INPUTS["cells"])
validate(CELLS, "../schemas/cells.schema.yaml")


TRAIN_CONFIGS = {
    f"{resolution_label(c['resolution'])}_s{c['strata']}": c for c in config["configs"]
}
RESOLUTIONS = {
    resolution_label(c["resolution"]): c["resolution"] for c in config["configs"]
}
# the finest binning: P(s) in the report is drawn from it
FINEST = min(RESOLUTIONS, key=RESOLUTIONS.get)


wildcard_constraints:
    cfg="|".join(TRAIN_CONFIGS),
    res="|".join(RESOLUTIONS),


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


def qc_args():
    """The QC thresholds as ``--min-contacts N ...`` options."""
    return " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in sorted(config["qc"].items())
    )


def all_outputs():
    out = [
        f"{RESULTS}/qc/cells.tsv",
        f"{RESULTS}/binned/pseudobulk.mcool",
        f"{RESULTS}/amp/devices.json",
    ]
    out += [f"{RESULTS}/binned/{res}.scool" for res in RESOLUTIONS]
    for cfg in TRAIN_CONFIGS:
        out += [
            f"{RESULTS}/data/{cfg}/rna.h5ad",
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


def json_arg(section):
    """A config section as one shell-quoted JSON argument."""
    return shlex.quote(json.dumps(config[section], sort_keys=True))
