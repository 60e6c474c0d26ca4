"""rules.targets: a run's folders, its default target's files, the inputs
some rules take from the config, and the wildcard patterns; file lists written out by
hand."""

from __future__ import annotations

import re
from types import SimpleNamespace

from ampflow.rules.targets import RunPaths, alternatives, extract_model_input, tiny_model_folder


def test_folders():
    p = RunPaths("demo")
    assert (p.results, p.logs, p.report) == ("results/demo", "logs/demo", "results/demo/figures")
    assert p.block_folder("0003") == "results/demo/binned/blocks/0003"


def test_hic_outputs_with_rna_and_an_embedding_set():
    out = RunPaths("d").hic_outputs({"1mb": 1_000_000, "500kb": 500_000}, {"1mb_s4": {}}, {"raw": {}}, has_rna=True)
    r, f = "results/d", "results/d/figures"
    assert out == [
        f"{r}/qc/cells.tsv", f"{r}/qc/split.tsv", f"{r}/binned/pseudobulk.mcool", f"{r}/amp/devices.json",
        f"{r}/binned/1mb.scool", f"{r}/binned/500kb.scool",
        f"{r}/data/1mb_s4/rna.h5ad", f"{r}/data/1mb_s4/hic.h5ad", f"{r}/data/1mb_s4/graph", f"{r}/amp/1mb_s4/plan.json",
        f"{r}/train/1mb_s4/model.pt", f"{r}/eval/1mb_s4/scores.json", f"{r}/eval/1mb_s4/umap.png",
        f"{f}/1mb_s4/plan.html", f"{f}/1mb_s4/memory.png", f"{f}/1mb_s4/training.png",
        f"{r}/embed/1mb_s4/raw/embeddings.h5ad",
        f"{f}/qc/contacts.png", f"{f}/qc/distance_decay.png", f"{f}/qc/rna.png", f"{f}/qc/failed_cells.html",
        f"{f}/summary.html", f"{f}/scores.png",
    ]  # fmt: skip


def test_hic_outputs_of_a_hic_only_dataset_with_two_configurations():
    out = RunPaths("h").hic_outputs(["1mb"], ["1mb_s4", "1mb_s8"], [], has_rna=False)
    assert not [p for p in out if p.endswith("rna.h5ad") or "/embed/" in p]
    assert [p for p in out if p.endswith("model.pt")] == ["results/h/train/1mb_s4/model.pt", "results/h/train/1mb_s8/model.pt"]
    # 4 + 1 scool + 2 x 9 per configuration + 4 QC figures + 2 summary figures
    assert len(out) == 4 + 1 + 18 + 4 + 2


def test_extract_outputs_per_input_and_model_in_config_order():
    inputs = {"a": {"models": ["m", "n"]}, "b": {"models": ["m"]}}

    def files(name, model):
        return {"h5ad": f"{name}.{model}.h5ad"} | ({"windows": f"{name}.{model}.windows.h5ad"} if name == "b" else {})

    figs = ["throughput.png", "gpus.png", "records.html"]
    assert RunPaths("x").extract_outputs(inputs, files) == [
        "results/x/extract/a.m.h5ad", *[f"results/x/figures/extract/a.m/{g}" for g in figs],
        "results/x/extract/a.n.h5ad", *[f"results/x/figures/extract/a.n/{g}" for g in figs],
        "results/x/extract/b.m.h5ad", "results/x/extract/b.m.windows.h5ad", *[f"results/x/figures/extract/b.m/{g}" for g in figs],
    ]  # fmt: skip
    assert RunPaths("x").extract_outputs({}, files) == []


def test_embed_input_of_a_prepared_folder_and_of_raw_cells():
    sets = {"prep": {"data": "some/folder"}, "raw": {"cells": "c.tsv", "rna": "r.tsv"}}
    paths = RunPaths("demo")
    rna, hic = paths.embed_input(sets, "rna"), paths.embed_input(sets, "hic")
    prep, raw = SimpleNamespace(cells="prep", cfg="1mb_s4"), SimpleNamespace(cells="raw", cfg="1mb_s4")
    assert (rna(prep), hic(prep)) == ("some/folder/rna.h5ad", "some/folder/hic.h5ad")
    assert (rna(raw), hic(raw)) == ("results/demo/embed/cells/raw/rna.h5ad", "results/demo/embed/cells/raw/1mb_s4/hic.h5ad")


def test_extract_model_input(tmp_path):
    local = tmp_path / "weights"
    local.mkdir()
    models = {
        "t": SimpleNamespace(tiny=True, source=""),
        "local": SimpleNamespace(tiny=False, source=str(local)),
        "hub": SimpleNamespace(tiny=False, source="facebook/esm2_t6_8M_UR50D"),
    }
    assert extract_model_input(models, "t") == tiny_model_folder("t") == "resources/models/t"
    assert extract_model_input(models, "local") == str(local)
    assert extract_model_input(models, "hub") == []


def test_alternatives_match_exactly_the_names():
    pattern = alternatives(["a.b", "c"])
    assert pattern == r"a\.b|c"
    assert [n for n in ("a.b", "axb", "c", "cc", "") if re.fullmatch(pattern, n)] == ["a.b", "c"]
    nothing = alternatives([])
    assert not any(re.fullmatch(nothing, n) for n in ("", "x", "(?!x)x"))
