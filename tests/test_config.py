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
