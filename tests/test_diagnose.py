"""Diagnose maps signals x devices as DESIGN §4's table says, picks the smallest tp that
fits and the fastest chunk that fits (by the cost model), is deterministic, and takes new
signals/strategies by registration."""

from __future__ import annotations

import itertools
import json

import pytest
from helpers import Est

from ampflow.amp.cost.model import cost_for_profile
from ampflow.amp.decide import diagnose as dg
from ampflow.amp.decide.signals import Signal, register_signal, unregister_signal
from ampflow.amp.decide.strategies import Strategy, register_strategy, unregister_strategy
from ampflow.base.errors import InputError
from ampflow.contract.plan import Plan
from ampflow.contract.profile import as_profile
from ampflow.report.plan_text import explain

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


def toy_estimate(profile, names, dp, tp, chunk):
    """A monotone toy memory model: S5 divides the stratum term by tp, S2 the decode term,
    S3 shrinks attention with the chunk size, S1 divides the batch."""
    hic = as_profile(profile).hic
    if hic is None:
        return Est(1 * GIB / dp, 1 * GIB / dp, 0)
    L = hic.n_strata
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


def expected(high_input, attention, heavy, devices, over, tp, chunked):
    """DESIGN §4's table; the strategies that shard over the tp group only with tp >= 2,
    and S3 only when the plan runs in chunks (one block does not fit)."""
    names = []
    if devices > 1:
        names.append("data_parallel")
        if high_input and tp >= 2:
            names.append("feature_parallel")
    if attention and chunked:
        names.append("chunked_attention")
    if high_input:
        names.append("key_first_decode")
    if devices > 1 and heavy and over and tp >= 2:
        names.append("hidden_parallel")
    return names


def assert_says_what_it_does(out: dict) -> None:
    """The plan's own referees: a strategy sharding over tp is listed if and only if the
    mesh has tp >= 2, and a plan that fits recommends the devices its mesh uses."""
    tp_names = {"feature_parallel", "hidden_parallel"}
    names = {s["name"] for s in out["strategies"]}
    assert bool(names & tp_names) == (out["mesh"]["tp"] >= 2), (names, out["mesh"])
    world = out["mesh"]["dp"] * out["mesh"]["tp"]
    if out["fits"]:
        assert out["recommended_devices"] == world
        assert out["min_fitting_devices"] <= world
    else:
        assert out["recommended_devices"] is None or out["recommended_devices"] > world
        assert out["recommended_devices"] == out["min_fitting_devices"]


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
    chunks = [0, *dg._chunk_candidates(4096)] if attention else [0]
    over = all(toy_estimate(p, without, devices, 1, c).total > mem_gib * GIB for c in chunks)
    # S3 when one block (the fastest) does not fit on the chosen mesh
    dp, tp = out["mesh"]["dp"], out["mesh"]["tp"]
    chunked = attention and toy_estimate(p, names, dp, tp, 0).total > mem_gib * GIB
    assert names == expected(high_input, attention, heavy, devices, over, tp, chunked)
    assert (out["chunk_size"] is not None) == chunked
    not_taken = [r for r in out["reasons"] if r.startswith("S3 chunked_attention not taken")]
    assert len(not_taken) == (attention and not chunked)
    assert out["mesh"]["dp"] * out["mesh"]["tp"] == devices
    assert_says_what_it_does(out)
    assert out["key_first"] == high_input


@pytest.mark.parametrize("devices", [1, 2, 4, 8])
def test_without_hic_only_data_parallel(devices):
    out = plan(make_profile(False, False, False, hic=False), devices, 64)
    assert [s["name"] for s in out["strategies"]] == (["data_parallel"] if devices > 1 else [])
    assert out["mesh"] == {"dp": devices, "tp": 1}


def test_smallest_tp_and_fastest_chunk_that_fit():
    """The toy memory model shrinks with the chunk; the cost model (the referee here,
    computed apart from the diagnosis) says which candidate is faster."""
    p = make_profile(True, True, True)
    candidates = [0, *dg._chunk_candidates(4096)]
    for mem in (7.0, 9.0, 12.0, 30.0, 64.0):
        out = plan(p, 8, mem)
        names = tuple(s["name"] for s in out["strategies"])
        tp, c = out["mesh"]["tp"], out["chunk_size"] or 0
        assert out["fits"]
        assert toy_estimate(p, names, 8 // tp, tp, c).total <= mem * GIB
        smaller_tp = [t for t in (1, 2, 4, 8) if t < tp]
        for t in smaller_tp:  # no smaller tp fits with any chunk
            assert all(toy_estimate(p, names, 8 // t, t, cc).total > mem * GIB for cc in candidates)
        with_s3 = tuple(dict.fromkeys((*names, "chunked_attention")))
        mine = cost_for_profile(p, with_s3, 8 // tp, tp, c).seconds
        for cc in candidates:  # every faster candidate does not fit at this tp
            if cost_for_profile(p, with_s3, 8 // tp, tp, cc).seconds < mine:
                assert toy_estimate(p, names, 8 // tp, tp, cc).total > mem * GIB, (mem, c, cc)
        # and fewer chunks are faster: the fastest that fits is the largest that fits
        assert all(toy_estimate(p, names, 8 // tp, tp, cc).total > mem * GIB for cc in candidates if cc == 0 or cc > c) or c == 0
        assert out["predicted_step_seconds"] == pytest.approx(mine, rel=1e-3)
    assert plan(p, 8, 64.0)["chunk_size"] is None  # room for one block


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
    register_signal(Signal("MANY_CELLS", "more than 500 cells", lambda prof, s: (prof.rna.n_cells > 500, {"n": prof.rna.n_cells})))
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
    text = explain(typed_plan(make_profile(True, True, True), 4, 9.0))
    for word in ("mesh", "strategies", "chunk size", "predicted step", "predicted peak", "RAISED", "HIGH_INPUT_DIMENSIONALITY", "why"):
        assert word in text


# ------------------------------------------------------------------ a plan says what it does
def feature_estimate(profile, names, dp, tp, chunk):
    """A toy model where S2 matters beyond dp: 4 GiB of per-feature state that only
    feature sharding divides, and 1 GiB of activations that the batch split divides."""
    features = 4 * GIB / (tp if "feature_parallel" in names else 1)
    return Est(features + GIB / dp, features + GIB / dp, 0)


@pytest.mark.parametrize("mem_gib, tp", [(64.0, 1), (6.0, 1), (3.0, 2), (1.5, 4)])
def test_feature_parallel_only_when_the_mesh_shards(mem_gib, tp):
    p = make_profile(True, False, False)
    out = dg.diagnose(p, 8, int(mem_gib * GIB), 1.0, estimate=feature_estimate).to_dict()
    assert out["signals"]["HIGH_INPUT_DIMENSIONALITY"]["raised"]
    assert out["fits"] and out["mesh"] == {"dp": 8 // tp, "tp": tp}
    names = [s["name"] for s in out["strategies"]]
    assert ("feature_parallel" in names) == (tp >= 2)
    assert_says_what_it_does(out)
    # the peak is the one of the strategies listed, on the mesh listed
    assert out["predicted_peak_bytes"] == int(feature_estimate(p, names, 8 // tp, tp, 0).total)
    not_taken = [r for r in out["reasons"] if r.startswith("S2 feature_parallel not taken")]
    assert len(not_taken) == (tp == 1)


def test_real_model_at_tp_1_lists_no_sharding():
    """The analytic memory model: a high-dimensional Hi-C on 8 roomy devices trains as
    8 data-parallel groups, and the plan lists no feature sharding."""
    p = make_profile(True, True, False)
    out = dg.diagnose(p, 8, 80 * GIB, 0.9).to_dict()
    assert out["mesh"] == {"dp": 8, "tp": 1} and out["fits"]
    assert "feature_parallel" not in [s["name"] for s in out["strategies"]]
    assert any(r.startswith("S2 feature_parallel not taken") for r in out["reasons"])
    assert_says_what_it_does(out)


def test_hidden_parallel_without_a_usable_tp_is_not_listed():
    """S5's signal and budget call for it, but D / heads = 3 divides by no tp of 2
    devices: the plan stays at tp 1, lists no S5, does not fit, and says why."""
    p = make_profile(False, True, True)
    p["model"] = {"latent_dim": 12, "heads": 4}
    out = plan(p, 2, 1.0)
    assert out["mesh"] == {"dp": 2, "tp": 1} and not out["fits"]
    assert "hidden_parallel" not in [s["name"] for s in out["strategies"]]
    assert any(r.startswith("S5 hidden_parallel not taken") and "no tensor-parallel degree" in r for r in out["reasons"])
    assert_says_what_it_does(out)


@pytest.mark.parametrize("devices", [2, 6, 8])
def test_recommended_devices_are_the_mesh_when_it_fits(devices):
    out = plan(make_profile(True, True, True), devices, 64)
    assert out["fits"] and out["recommended_devices"] == out["mesh"]["dp"] * out["mesh"]["tp"] == devices
    assert out["min_fitting_devices"] == 1  # the fewest: the plan fits on one device too
    assert plan(make_profile(True, True, True), 1, 64)["fits"]
    assert_says_what_it_does(out)
    text = explain(Plan.from_dict(out))
    assert f"recommended devices  {devices} (the devices this mesh uses" in text and "fewest that fit: 1" in text


def test_recommended_devices_when_the_plan_does_not_fit():
    out = plan(make_profile(True, True, True), 1, 2.5)
    assert not out["fits"]
    rec = out["recommended_devices"]
    assert rec == out["min_fitting_devices"] > 1
    assert_says_what_it_does(out)
    again = plan(make_profile(True, True, True), rec, 2.5)  # planned on them, it fits and keeps them
    assert again["fits"] and again["recommended_devices"] == again["mesh"]["dp"] * again["mesh"]["tp"] == rec
    assert not plan(make_profile(True, True, True), rec // 2, 2.5)["fits"]  # and none fewer does
    assert "the fewest that fit; this mesh, for 1, does not" in explain(typed_plan(make_profile(True, True, True), 1, 2.5))


@pytest.mark.parametrize("devices", [1, 3, 8])
def test_peak_scope_names_what_the_peak_counts_and_leaves_out(devices):
    """The peak is the allocator's of a steady-state step: the largest of the end of the
    forward pass, the backward pass and the optimizer step, the data batch and the
    transients included; what no profile can tell is named as left out."""
    p = make_profile(True, True, False)
    p["train"] = {"batch_size": 64, "dtype": "float32"}
    pl = dg.diagnose(p, devices, 80 * GIB, 0.9)
    scope = pl.to_dict()["peak_scope"]
    assert "parameters and buffers" in scope["counts"] and "the data batch" in scope["counts"]
    assert any("transients" in x for x in scope["counts"])
    dp = pl.mesh.dp
    assert scope["data_batch_bytes"] == -(-64 // dp) * (2000 + 40_000) * 4
    phases = scope["phases"]
    assert set(phases) == {"end_of_forward", "backward", "optimizer_step"}
    assert pl.predicted_peak_bytes == max(phases.values()) == phases[scope["peak_phase"]]
    out = scope["leaves_out"]
    assert set(out) == {"not_modelled"}
    assert any("CUDA" in x for x in out["not_modelled"]) and any("fragmentation" in x for x in out["not_modelled"])
    text = explain(pl)
    assert "leaves out" in text and "the data batch" in text and "end of forward" in text and "(peak)" in text
    # canonical: identical inputs, identical bytes, and the scope survives a round trip
    assert pl.dumps() == dg.diagnose(p, devices, 80 * GIB, 0.9).dumps()
    assert Plan.from_dict(json.loads(pl.dumps())) == pl


def test_batch_bytes_follow_the_dtype():
    p = make_profile(False, False, False)
    p["train"] = {"batch_size": 10, "dtype": "float64"}
    assert dg.data_batch_bytes(p, 1) == 10 * (2000 + 4000) * 8
    assert dg.data_batch_bytes(p, 4) == 3 * (2000 + 4000) * 8
