# Config and cell-sheet validation, derived names, and input functions.
import json
import shlex

from snakemake.utils import validate

from ampflow.io.genome import resolution_label
from ampflow.io.sheet import read_sheet

validate(config, "../schemas/config.schema.yaml")

DATASET = config["dataset"]
RESULTS = f"results/{DATASET}"
LOGS = f"logs/{DATASET}"
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
        ]
    return out


def json_arg(section):
    """A config section as one shell-quoted JSON argument."""
    return shlex.quote(json.dumps(config[section], sort_keys=True))
