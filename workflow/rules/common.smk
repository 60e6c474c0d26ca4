# Config and cell-sheet validation, derived names, and input functions.
import pandas as pd
from snakemake.utils import validate


validate(config, "../schemas/config.schema.yaml")

DATASET = config["dataset"]
RESULTS = f"results/{DATASET}"
LOGS = f"logs/{DATASET}"
INPUTS = config["inputs"]


def read_cell_sheet(path):
    """The cell sheet, validated by schema here and by ampflow (files, duplicates)."""
    sheet = pd.read_csv(path, sep="\t", dtype=str, keep_default_na=False)
    validate(sheet, "../schemas/cells.schema.yaml")
    dup = sheet["cell_id"][sheet["cell_id"].duplicated()]
    if len(dup):
        raise ValueError(f"{path}: duplicate cell_id {dup.iloc[0]!r}")
    return sheet.set_index("cell_id", drop=False)


CELLS = read_cell_sheet(INPUTS["cells"])


def resolution_label(bp):
    if bp % 1_000_000 == 0:
        return f"{bp // 1_000_000}mb"
    if bp % 1000 == 0:
        return f"{bp // 1000}kb"
    return f"{bp}bp"


TRAIN_CONFIGS = {
    f"{resolution_label(c['resolution'])}_s{c['strata']}": c for c in config["configs"]
}
RESOLUTIONS = {resolution_label(c["resolution"]): c["resolution"] for c in config["configs"]}


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
        ]
    return out
