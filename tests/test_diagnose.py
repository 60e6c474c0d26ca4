"""Diagnose maps signals x devices as DESIGN §4's table says, picks the smallest tp and the
largest chunk that fit, is deterministic, and takes new signals/strategies by registration."""

from __future__ import annotations

import json

import itertools
from dataclasses import dataclass, field

import pytest

from ampflow.amp import diagnose as dg
from ampflow.amp.signals import Signal, register_signal, unregister_signal
from ampflow.amp.strategies import Strategy, register_strategy, unregister_strategy
from ampflow.io.errors import InputError
from ampflow.spec.plan import Plan

GIB = 2**30


def make_profile(high_input: bool, attention: bool, heavy: bool, hic: bool = True) -> dict:
    n_strata = 8 if heavy else 2
    mods = {"rna": {"prob_model": "NB", "n_features": 2000, "n_cells": 1000}}
    if hic:
        mods["hic"] = {
            "prob_model": "HiCZINB",
            "n_features": 40_000 if high_input else 4_000,
            "n_cells": 1000,
            "n_strata": n_strata,
            "n_anchors": 4096,
            "features_per_stratum": [4096] * n_strata,
            "attention": attention,
            "window": 8,
        }
    return {"version": 1, "modalities": mods, "graph": {"n_nodes": 6000, "n_edges": 50000}, "model": {}, "train": {"batch_size": 64}}


@dataclass
class Est:
    total: float
    base: float
    per_stratum: float
    components: dict = field(default_factory=dict)


def toy_estimate(profile, names, dp, tp, chunk):
    """A monotone toy memory model: S5 divides the stratum term by tp, S2 the decode term,
    S3 shrinks attention with the chunk size, S1 divides the batch."""
    hic = profile["modalities"].get("hic")
    if hic is None:
        return Est(1 * GIB / dp, 1 * GIB / dp, 0)
    L = hic["n_strata"]
    attn = (chunk + 16) / 4096 if chunk else 1.0
    stratum = (1.0 * attn) * GIB
    if "hidden_parallel" in names:
        stratum /= tp
    decode = 2 * GIB / (tp if "feature_parallel" in names else 1) / dp
    base = 1 * GIB + decode
    return Est(base + L * stratum, base, stratum)


def typed_plan(p, devices, mem_gib, **kw) -> Plan:
    return dg.diagnose(p, devices, int(mem_gib * GIB), 1.0, estimate=toy_estimate, **kw)


def plan(p, devices, mem_gib, **kw) -> dict:
    """The plan as its JSON object, which the assertions below read."""
    return typed_plan(p, devices, mem_gib, **kw).to_dict()


def expected(high_input, attention, heavy, devices, over):
    names = []
    if devices > 1:
        names.append("data_parallel")
        if high_input:
            names.append("feature_parallel")
    if attention:
        names.append("chunked_attention")
    if high_input:
        names.append("key_first_decode")
    if devices > 1 and heavy and over:
        names.append("hidden_parallel")
    return names


@pytest.mark.parametrize("devices", [1, 2, 4, 8])
@pytest.mark.parametrize("high_input, attention, heavy", [c for c in itertools.product([False, True], repeat=3) if not (c[2] and not c[1])])
@pytest.mark.parametrize("mem_gib", [64.0, 6.0])
def test_signals_times_devices_map_as_the_table_says(devices, high_input, attention, heavy, mem_gib):
    p = make_profile(high_input, attention, heavy)
    out = plan(p, devices, mem_gib)
    raised = {k for k, v in out["signals"].items() if v["raised"]}
    assert raised == {n for n, on in [("HIGH_INPUT_DIMENSIONALITY", high_input), ("ATTENTION_DECODER", attention), ("HEAVY_DECOMPOSITION", heavy)] if on}
    names = [s["name"] for s in out["strategies"]]
    # S5 when even the best chunk size (if any) leaves the tp=1 peak over budget
    without = tuple(n for n in names if n != "hidden_parallel")
    chunks = dg._chunk_candidates(4096) if attention else [0]
    over = all(toy_estimate(p, without, devices, 1, c).total > mem_gib * GIB for c in chunks)
    assert names == expected(high_input, attention, heavy, devices, over)
    assert out["mesh"]["dp"] * out["mesh"]["tp"] == devices
    assert out["key_first"] == high_input


@pytest.mark.parametrize("devices", [1, 2, 4, 8])
def test_without_hic_only_data_parallel(devices):
    out = plan(make_profile(False, False, False, hic=False), devices, 64)
    assert [s["name"] for s in out["strategies"]] == (["data_parallel"] if devices > 1 else [])
    assert out["mesh"] == {"dp": devices, "tp": 1}


def test_smallest_tp_and_largest_chunk_that_fit():
    p = make_profile(True, True, True)
    for mem in (7.0, 9.0, 12.0, 30.0):
        out = plan(p, 8, mem)
        names = tuple(s["name"] for s in out["strategies"])
        tp, c = out["mesh"]["tp"], out["chunk_size"]
        assert out["fits"]
        assert toy_estimate(p, names, 8 // tp, tp, c).total <= mem * GIB
        smaller_tp = [t for t in (1, 2, 4, 8) if t < tp]
        for t in smaller_tp:  # no smaller tp fits with any chunk
            assert all(toy_estimate(p, names, 8 // t, t, cc).total > mem * GIB for cc in dg._chunk_candidates(4096))
        for cc in dg._chunk_candidates(4096):  # no larger chunk fits at this tp
            if cc > c:
                assert toy_estimate(p, names, 8 // tp, tp, cc).total > mem * GIB


def test_one_device_over_budget_says_so_and_recommends():
    out = plan(make_profile(True, True, True), 1, 2.5)
    assert not out["fits"]
    assert out["recommended_devices"] and out["recommended_devices"] > 1
    assert any("exceeds" in r for r in out["reasons"])
    again = plan(make_profile(True, True, True), out["recommended_devices"], 2.5)
    assert again["fits"]


def test_identical_inputs_identical_bytes():
    p = make_profile(True, True, True)
    assert typed_plan(p, 4, 8.0).dumps() == typed_plan(p, 4, 8.0).dumps()
    assert Plan.from_dict(json.loads(typed_plan(p, 4, 8.0).dumps())) == typed_plan(p, 4, 8.0)


def test_registering_a_signal_and_strategy_needs_no_diagnose_change():
    register_signal(Signal("MANY_CELLS", "more than 500 cells", lambda prof, s: (prof["modalities"]["rna"]["n_cells"] > 500, {"n": prof["modalities"]["rna"]["n_cells"]})))
    register_strategy(Strategy("S9", "dummy_offload", "a test strategy", 60, False, False, lambda ctx: "many cells" if ctx.raised("MANY_CELLS") else None))
    try:
        out = plan(make_profile(False, False, False), 1, 64)
        assert out["signals"]["MANY_CELLS"]["raised"]
        assert [s["name"] for s in out["strategies"]] == ["dummy_offload"]
        assert any(r.startswith("S9 dummy_offload") for r in out["reasons"])
    finally:
        unregister_strategy("dummy_offload")
        unregister_signal("MANY_CELLS")


def test_bad_inputs_are_clear():
    with pytest.raises(InputError, match="modalities"):
        dg.diagnose({"model": {}, "train": {}}, 1, GIB, estimate=toy_estimate)
    with pytest.raises(InputError, match="devices"):
        plan(make_profile(False, False, False), 0, 8)
    with pytest.raises(InputError, match="budget_fraction"):
        dg.diagnose(make_profile(False, False, False), 1, GIB, 1.5, estimate=toy_estimate)


def test_cli_diagnose_and_explain(tmp_path, capsys):
    from ampflow.cli import main

    bad = tmp_path / "profile.json"
    bad.write_text("{not json")
    assert main(["diagnose", str(bad), "--devices", "2", "--device-memory", "8", "--out", str(tmp_path / "plan.json")]) == 2
    assert f"{bad}:1" in capsys.readouterr().err
    assert not (tmp_path / "plan.json").exists()
    assert main(["diagnose", str(tmp_path / "missing.json"), "--devices", "2", "--device-memory", "8", "--out", str(tmp_path / "plan.json")]) == 2
    assert main(["plan-explain", str(tmp_path / "missing.json")]) == 2


def test_explain_prints_a_table():
    text = dg.explain(typed_plan(make_profile(True, True, True), 4, 9.0))
    for word in ("mesh", "strategies", "chunk size", "predicted peak", "RAISED", "HIGH_INPUT_DIMENSIONALITY", "why"):
        assert word in text
