"""The typed sections of a plan and the typed profile: a bad value names its key, an
older plan's sections read and write back unchanged, and a profile's reader sees what
its JSON says."""

from __future__ import annotations

import json

import pytest
from helpers import host, plan_for, profile

from ampflow.base.errors import InputError
from ampflow.contract.plan import Plan
from ampflow.contract.plan_sections import PEAK_NOT_MODELLED, CpuSection, PeakScope
from ampflow.contract.profile import Profile, profile_hash


def _doc() -> dict:
    return json.loads(plan_for(2, {"device": "cpu"}, host(8, available=10**9)).dumps())


@pytest.mark.parametrize(
    "section, key, value, named",
    [
        ("cpu", "threads", "many", "cpu.threads"),
        ("cpu", "cores_per_node", 4, "cpu"),
        ("cpu", "threads_source", "guess", "cpu.threads_source"),
        ("cost_model", "candidates", [{"chunk": "big"}], "cost_model.candidates[0].chunk"),
        ("peak_scope", "data_batch_bytes", "lots", "peak_scope.data_batch_bytes"),
        ("peak_scope", "leaves_out", {"gpu": 1}, "peak_scope.leaves_out"),
    ],
)
def test_a_bad_section_value_names_the_file_and_key(tmp_path, section, key, value, named):
    doc = _doc()
    doc.setdefault(section, {})
    if section == "cost_model" and not doc[section]:
        doc[section] = {"candidates": []}
    doc[section][key] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(InputError) as err:
        Plan.read(path)
    assert err.value.key == named and str(path) in str(err.value), str(err.value)


def test_sections_are_typed_and_write_back_byte_identical():
    text = plan_for(2, {"device": "cpu"}, host(8, available=10**9)).dumps()
    plan = Plan.from_dict(json.loads(text))
    assert isinstance(plan.cpu, CpuSection) and isinstance(plan.peak_scope, PeakScope)
    # the referee: the JSON's own numbers, read without the types
    doc = json.loads(text)
    assert plan.cpu.threads == doc["cpu"]["threads"] == 4 and plan.cpu.processes == 2
    assert plan.cpu.host_budget_bytes == doc["cpu"]["host_budget_bytes"] == 10**9
    assert plan.dumps() == text


def test_an_older_peak_scope_reads_and_writes_back():
    """A plan of an earlier version left the data batch out of the peak and said so under
    ``leaves_out``; it still reads, renders and writes back unchanged."""
    doc = _doc()
    doc["peak_scope"]["leaves_out"] = {"not_modelled": list(PEAK_NOT_MODELLED), "data_batch_bytes": 4096, "transient_bytes": {"attention_scores": 2048}}
    plan = Plan.from_dict(doc)
    assert plan.peak_scope.left_out_batch_bytes == 4096 and plan.peak_scope.left_out_transient_bytes == {"attention_scores": 2048}
    assert json.loads(plan.dumps())["peak_scope"] == doc["peak_scope"]


def test_a_gpu_plan_has_no_cpu_section_and_writes_it_empty():
    plan = plan_for(2, {"device": "cuda"}, host(8, gpus=2))
    assert plan.cpu is None and plan.device == "cuda"
    assert json.loads(plan.dumps())["cpu"] == {}


def test_the_profile_reader_sees_what_the_json_says():
    d = profile(batch_size=48)
    p = Profile.from_dict(d)
    assert p.rna.n_features == d["modalities"]["rna"]["n_features"] and p.hic is None
    assert (p.n_nodes, p.n_edges, p.train.batch_size) == (100, 1000, 48)
    assert p.hash == profile_hash(d)
    assert p.with_batch_size(7).train.batch_size == 7 and p.train.batch_size == 48


@pytest.mark.parametrize(
    "edit, named",
    [
        (lambda d: d["modalities"]["rna"].update(n_features="wide"), "modalities.rna.n_features"),
        (lambda d: d["modalities"]["rna"].update(colour=1), "modalities.rna"),
        (lambda d: d.pop("train"), "train"),
        (lambda d: d["modalities"].update(hic=[1, 2]), "modalities.hic"),
    ],
)
def test_a_bad_profile_value_names_its_key(edit, named):
    d = profile()
    edit(d)
    with pytest.raises(InputError) as err:
        Profile.from_dict(d)
    assert err.value.key == named, str(err.value)
