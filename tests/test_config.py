"""The config schema documents the same defaults the typed settings use."""

from __future__ import annotations

import dataclasses

import yaml
from conftest import REPO

from ampflow.contract.config import EvaluateConfig, LossWeights, ModelConfig, TrainConfig


def schema_defaults(node):
    """The object a schema's defaults produce (nested objects included)."""
    if node.get("type") == "object" and "properties" in node:
        return {k: schema_defaults(v) for k, v in node["properties"].items() if "default" in v or v.get("type") == "object"}
    return node.get("default")


def test_schema_defaults_equal_dataclass_defaults():
    schema = yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())
    model = schema_defaults(schema["properties"]["model"])
    assert model == dataclasses.asdict(ModelConfig())
    train = schema_defaults(schema["properties"]["train"])
    assert TrainConfig.from_dict(train) == TrainConfig()
    assert train["pretrain"]["weights"] == dataclasses.asdict(LossWeights())
    assert set(train) == {f.name for f in dataclasses.fields(TrainConfig)}
    evaluate = schema_defaults(schema["properties"]["evaluate"])
    assert evaluate == dataclasses.asdict(EvaluateConfig())
    assert EvaluateConfig.from_dict(evaluate) == EvaluateConfig()


def test_extract_schema_defaults_equal_dataclass_defaults():
    from ampflow.extract.config import ExtractSettings, ModelSpec
    from ampflow.io.fasta import FastaPolicy

    schema = yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())["properties"]["extract"]
    settings = schema_defaults(schema)
    assert settings.pop("inputs") == {} and settings.pop("models") == {}
    assert settings == dataclasses.asdict(ExtractSettings())
    assert settings["fasta"] == dataclasses.asdict(FastaPolicy())
    model = schema["properties"]["models"]["additionalProperties"]["properties"]
    fields = {f.name: f.default for f in dataclasses.fields(ModelSpec)}
    assert set(model) == set(fields)
    assert {k: v["default"] for k, v in model.items() if "default" in v} == {k: v for k, v in fields.items() if k != "kind"}


def test_cluster_schema_defaults_equal_dataclass_defaults():
    from ampflow.contract.allocation import ClusterOffer

    schema = yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())
    cluster = schema_defaults(schema["properties"]["cluster"])
    assert cluster == dataclasses.asdict(ClusterOffer())
    assert ClusterOffer.from_dict(cluster) == ClusterOffer()


def test_jobs_sized_before_a_plan_follow_the_config():
    """The workflow's sizing of the devices, train, embed and extraction jobs before a
    plan exists (contract.allocation, ExtractSettings): each rule on hand-worked cases."""
    from ampflow.contract.allocation import (
        ClusterOffer,
        devices_job_gpus,
        embed_threads,
        gpu_partition,
        planned_devices,
        train_cores,
        trains_on_gpus,
    )
    from ampflow.extract.config import ExtractSettings

    four = ClusterOffer(gpu_partition="gpu", gpus_per_node=4, cpus_per_gpu=8)
    none = ClusterOffer(gpus_per_node=0)
    # amp.devices: as given; auto: the GPUs visible, else one node's, at least 1
    assert planned_devices(3, 0, four) == 3 and planned_devices("auto", 2, four) == 2
    assert planned_devices("auto", 0, four) == 4 and planned_devices("auto", 0, none) == 1
    # cores: threads x processes; auto: Snakemake's cores, at most the host's, at least 1
    assert train_cores(2, 3, 64, 16) == 6
    assert train_cores("auto", 3, 8, 16) == 8 and train_cores("auto", 3, 64, 16) == 16 and train_cores("auto", 3, None, 12) == 12
    assert embed_threads(5, 99) == 5 and embed_threads("auto", 7) == 7
    # GPUs: only where the cluster offers them and train.device allows them
    assert trains_on_gpus(four, "auto") and trains_on_gpus(four, "cuda") and not trains_on_gpus(four, "cpu") and not trains_on_gpus(none, "cuda")
    assert devices_job_gpus(four, "cuda", 2) == 2 and devices_job_gpus(four, "cuda", 8) == 4 and devices_job_gpus(four, "cuda", "auto") == 4
    assert devices_job_gpus(four, "cpu", 2) == 0
    assert gpu_partition(four, "cuda", "x") == {"slurm_partition": "x"} and gpu_partition(four, "cpu", "x") == {}
    assert gpu_partition(ClusterOffer(gpus_per_node=2), "cuda", "x") == {}
    # extraction: threads per worker x workers (GPUs, or CPU workers)
    gpu = ExtractSettings.from_dict({"device": "cuda", "gpus": 2, "threads": 3})
    cpu = ExtractSettings.from_dict({"device": "cpu", "gpus": 2, "cpu_workers": 4, "threads": 1})
    assert gpu.uses_gpus and gpu.job_threads == 6 and gpu.gpu_job_resources(four) == {"cpus_per_gpu": 8, "slurm_partition": "gpu"}
    assert not cpu.uses_gpus and cpu.job_threads == 4 and cpu.gpu_job_resources(four) == {}


def _leaves(d, prefix=""):
    """Every leaf of a nested config as ``{"a.b.c": value}`` (lists are leaves)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        out.update(_leaves(v, key + ".") if isinstance(v, dict) and v else {key: v})
    return out


#: Template keys that describe the user's own data and hardware, not a setting with a
#: default: the template's values are placeholders or sizes of a real mouse dataset on
#: an 80 GB GPU, and config/config.yaml says to edit them.
TEMPLATE_PLACEHOLDERS = {"dataset", "configs", "pseudobulk.resolutions", "amp.device_memory_gb", "cluster.gpu_partition", "threads"}


def test_a_config_that_leaves_keys_out_trains_what_the_template_trains():
    """A user's config that leaves a key out gets the template's value: a minimal
    config (the dataset and inputs alone) and the template, each resolved by the workflow's own
    schema validation with its defaults, agree on every key the template sets but the
    placeholders of the user's data and hardware."""
    from snakemake.utils import validate

    schema = REPO / "workflow/schemas/config.schema.yaml"
    template = yaml.safe_load((REPO / "config/config.yaml").read_text())
    empty = {"dataset": template["dataset"], "inputs": template["inputs"]}
    validate(empty, str(schema), set_default=True)
    validate(template, str(schema), set_default=True)
    resolved, given = _leaves(empty), _leaves(template)
    compared = [k for k in given if k.split(".")[0] != "inputs" and k not in TEMPLATE_PLACEHOLDERS]
    assert len(compared) > 40  # the qc, rna, hic, graph, train, model, amp and evaluate keys
    differ = {k: (resolved.get(k, "<no default>"), given[k]) for k in compared if resolved.get(k, "<no default>") != given[k]}
    assert differ == {}, f"schema default != template value: {differ}"
    # the typed settings the trainer builds from a config without model/train keys
    assert ModelConfig.from_dict(empty["model"]) == ModelConfig.from_dict(template["model"])
    assert TrainConfig.from_dict(empty["train"]) == TrainConfig.from_dict(template["train"])
