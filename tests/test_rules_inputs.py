"""rules.inputs: the workflow config's checks beyond its schema (branches,
the template's placeholders, retired keys, embed sets, extraction inputs)."""

from __future__ import annotations

import pytest

from ampflow.base.errors import InputError
from ampflow.rules.inputs import check_config, check_template_inputs, embed_sets, extract_inputs


def config(**inputs) -> dict:
    return {"inputs": inputs, "configs": [{"resolution": 500000, "strata": 4}], "train": {"threads": 1}}


@pytest.fixture
def files(tmp_path, monkeypatch):
    """A working directory holding cells.tsv, rna.tsv, genes.bed and chrom.sizes."""
    monkeypatch.chdir(tmp_path)
    for name in ("cells.tsv", "rna.tsv", "genes.bed", "chrom.sizes"):
        (tmp_path / name).write_text("x\n")
    return {"cells": "cells.tsv", "rna": "rna.tsv", "genes": "genes.bed", "chromsizes": "chrom.sizes"}


def test_branches(files):
    assert check_config(config(**files), template=True) == (True, True)
    assert check_config(config(cells="cells.tsv", chromsizes="chrom.sizes", rna=None, genes=None), template=True) == (True, False)
    # extraction only: no sheet, no configuration needed
    assert check_config({"inputs": {}, "configs": [], "train": {}}, template=False) == (False, False)


@pytest.mark.parametrize(
    "inputs, configs, key",
    [
        ({"cells": "c.tsv"}, [{"resolution": 1}], "inputs.chromsizes"),
        ({"cells": "c.tsv", "chromsizes": "s"}, [], "configs"),
        ({"rna": "r.tsv"}, [], "inputs.genes"),
    ],
)
def test_what_a_branch_needs(inputs, configs, key):
    with pytest.raises(InputError) as e:
        check_config({"inputs": inputs, "configs": configs, "train": {}}, template=False)
    assert e.value.key == key


def test_template_placeholders_say_how_to_give_a_config(files):
    # the first of cells, rna, genes, chromsizes that is missing: rna (genes is missing too)
    cfg = config(cells="cells.tsv", rna="my/rna.tsv", genes="my/genes.bed", chromsizes="chrom.sizes")
    with pytest.raises(InputError) as e:
        check_config(cfg, template=True)
    assert (e.value.key, e.value.path) == ("inputs.rna", "my/rna.tsv")
    msg = str(e.value)
    assert msg.startswith("my/rna.tsv: inputs.rna: does not exist.")
    for text in ("cp config/config.yaml config/my.yaml", "--configfile config/my.yaml", "make demo"):
        assert text in msg
    # given with --configfile, a missing file is for the rules to report
    assert check_config(cfg, template=False) == (True, True)
    check_template_inputs({"cells": None, "rna": ""})  # absent inputs are not files


def test_train_gpus_is_retired(files):
    cfg = config(**files)
    cfg["train"]["gpus"] = 2
    with pytest.raises(InputError) as e:
        check_config(cfg, template=False)
    assert (e.value.key, e.value.value) == ("train.gpus", 2)
    assert "cluster.gpus_per_node" in str(e.value)


def test_embed_sets():
    ok = {"prepared": {"data": "d"}, "raw": {"cells": "c.tsv", "rna": "r.tsv"}}
    assert embed_sets(ok, has_rna=True) == ok
    assert embed_sets({"raw": {"cells": "c.tsv"}}, has_rna=False) == {"raw": {"cells": "c.tsv"}}
    assert embed_sets({}, has_rna=True) == {}


@pytest.mark.parametrize(
    "entry, has_rna, value, text",
    [
        ({"cells": "c.tsv"}, True, ["cells"], "both cells and rna"),
        ({"data": "d", "cells": "c.tsv"}, True, ["cells", "data"], "both cells and rna"),
        ({"cells": "c.tsv", "rna": "r.tsv"}, False, ["cells", "rna"], "this dataset has no RNA"),
    ],
)
def test_embed_set_neither_prepared_nor_raw(entry, has_rna, value, text):
    with pytest.raises(InputError) as e:
        embed_sets({"x": entry}, has_rna=has_rna)
    assert (e.value.key, e.value.value) == ("embed.x", value)
    assert "give either data (a prepared folder) or" in str(e.value) and text in str(e.value)


def test_extract_inputs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "here.fa").write_text(">a\nMK\n")
    extract = {
        "inputs": {
            "here": {"fasta": "here.fa", "models": ["esm"], "optional": True},
            "gone": {"fasta": "gone.fa", "models": ["esm"], "optional": True},
            # not optional: kept, and the extract rule reports the missing file
            "needed": {"fasta": "needed.fa", "models": ["esm", "dna"]},
        }
    }
    said = []
    assert list(extract_inputs(extract, {"esm": 1, "dna": 2}, said.append)) == ["here", "needed"]
    assert said == ["extract: gone.fa not found; optional input gone left out"]


def test_extract_input_with_an_unknown_model():
    extract = {"inputs": {"a": {"fasta": "a.fa", "models": ["esm", "nope"]}}}
    with pytest.raises(InputError) as e:
        extract_inputs(extract, ["esm", "dna"])
    assert (e.value.key, e.value.value) == ("extract.inputs.a.models", "nope")
    assert "unknown model; known: ['dna', 'esm']" in str(e.value)
