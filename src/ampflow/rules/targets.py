"""The workflow's files: where a run of one dataset writes (``results/{dataset}``,
``logs/{dataset}``), what its default target asks for, the inputs some rules take from
the config, and the wildcard patterns that keep names apart.

``workflow/rules/common.smk`` builds a :class:`RunPaths` from the config's ``dataset``
and calls these while Snakemake parses the workflow; the rules' own ``output:`` paths
are under the same folders. Snakemake-free. The files inside a configuration's data
folder are :mod:`ampflow.contract.layout`'s.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

#: Where the workflow builds the models marked ``tiny`` (rule ``tiny_model``).
TINY_MODELS = "resources/models"
#: Report figures of each configuration (under ``figures/{cfg}/``).
CONFIG_FIGURES = ("plan.html", "memory.png", "training.png")
#: QC figures (under ``figures/qc/``).
QC_FIGURES = ("contacts.png", "distance_decay.png", "rna.png", "failed_cells.html")
#: Figures of all configurations together (under ``figures/``).
SUMMARY_FIGURES = ("summary.html", "scores.png")
#: Report figures of each (input, model) extraction (under ``figures/extract/{name}.{model}/``).
EXTRACT_FIGURES = ("throughput.png", "gpus.png", "records.html")


@dataclass(frozen=True)
class RunPaths:
    """The folders of one dataset's run (config ``dataset``) and the files its default
    target (rule ``all``) asks for."""

    dataset: str

    @property
    def results(self) -> str:
        return f"results/{self.dataset}"

    @property
    def logs(self) -> str:
        return f"logs/{self.dataset}"

    @property
    def report(self) -> str:
        """The report's figures and tables (``snakemake --report``)."""
        return f"{self.results}/figures"

    def block_folder(self, block: str) -> str:
        """One binning job's folder (a block of sheet rows)."""
        return f"{self.results}/binned/blocks/{block}"

    def hic_outputs(self, resolutions: Iterable[str], configs: Iterable[str], embed_sets: Iterable[str], has_rna: bool) -> list[str]:
        """What a run with a cell sheet makes: QC, split, binned cells per resolution
        label and the pseudobulk; per configuration name its data files (``rna.h5ad``
        only ``has_rna``), plan, model, scores and figures; each embedding set's
        embeddings per configuration; the QC and summary figures."""
        results, report = self.results, self.report
        configs = list(configs)
        out = [f"{results}/qc/cells.tsv", f"{results}/qc/split.tsv", f"{results}/binned/pseudobulk.mcool", f"{results}/amp/devices.json"]
        out += [f"{results}/binned/{res}.scool" for res in resolutions]
        for cfg in configs:
            out += [f"{results}/data/{cfg}/rna.h5ad"] if has_rna else []
            out += [f"{results}/data/{cfg}/hic.h5ad", f"{results}/data/{cfg}/graph", f"{results}/amp/{cfg}/plan.json"]
            out += [f"{results}/train/{cfg}/model.pt", f"{results}/eval/{cfg}/scores.json", f"{results}/eval/{cfg}/umap.png"]
            out += [f"{report}/{cfg}/{fig}" for fig in CONFIG_FIGURES]
        out += [f"{results}/embed/{cfg}/{name}/embeddings.h5ad" for cfg in configs for name in embed_sets]
        out += [f"{report}/qc/{fig}" for fig in QC_FIGURES]
        out += [f"{report}/{fig}" for fig in SUMMARY_FIGURES]
        return out

    def extract_outputs(self, inputs: dict, files: Callable[[str, str], dict[str, str]]) -> list[str]:
        """For each input of ``inputs`` (checked ``extract.inputs``) and each of its
        models, in config order: the files ``files(name, model)`` names (inside
        ``extract/``; :func:`ampflow.extract.config.output_files`), then its figures."""
        out = []
        for name, inp in inputs.items():
            for model in inp["models"]:
                out += [f"{self.results}/extract/{f}" for f in files(name, model).values()]
                out += [f"{self.report}/extract/{name}.{model}/{fig}" for fig in EXTRACT_FIGURES]
        return out

    def embed_input(self, sets: dict, name: str) -> Callable:
        """An input function ``(wildcards)`` of the set ``wildcards.cells`` (of ``sets``,
        the checked config ``embed``): its ``{name}.h5ad`` (``rna`` or ``hic``) in a
        prepared folder (``data``), else the one the embed_* rules write under
        ``embed/cells/{cells}`` (``hic.h5ad`` per configuration ``wildcards.cfg``)."""

        def files(wildcards):
            entry = sets[wildcards.cells]
            if "data" in entry:
                return f"{entry['data']}/{name}.h5ad"
            prep = f"{self.results}/embed/cells/{wildcards.cells}"
            return f"{prep}/rna.h5ad" if name == "rna" else f"{prep}/{wildcards.cfg}/hic.h5ad"

        return files


def tiny_model_folder(model: str) -> str:
    """The folder rule ``tiny_model`` builds the tiny model ``model`` into."""
    return f"{TINY_MODELS}/{model}"


def extract_model_input(models: dict, model: str) -> str | list:
    """The extract job's model input (``models``: name -> an
    :class:`~ampflow.extract.config.ModelSpec`), so that it re-runs when the model
    changes: a tiny model's folder (built by the workflow), else its ``source`` where
    that is a local folder or file; nothing (``[]``) for a hub name."""
    spec = models[model]
    if spec.tiny:
        return tiny_model_folder(model)
    return spec.source if Path(spec.source).exists() else []


def alternatives(names: Iterable[str]) -> str:
    """A wildcard pattern matching exactly these names (none: a pattern matching nothing)."""
    return "|".join(re.escape(n) for n in names) or "(?!x)x"
