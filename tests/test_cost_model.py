"""The cost model and the plans that choose the chunk by it.

Referees independent of the code under test: the wall-clock time of the banded kernel
measured here (at chunk settings the calibration did not see), the memory model's own
estimate of what a candidate holds (``estimate_for_profile``: peak plus one query
block's transient scores) and the bytes of the plan file.
"""

from __future__ import annotations

import json
import math
import shlex
import time
from dataclasses import fields, replace

import pytest
import torch
import torch.utils._pytree as pytree
from helpers import mm10_profile
from torch.utils._python_dispatch import TorchDispatchMode

from ampflow.amp.cost import model as cm
from ampflow.amp.cost.calibrate import calibrate
from ampflow.amp.decide.diagnose import _chunk_candidates, diagnose
from ampflow.amp.memory.predict import estimate_for_profile
from ampflow.base.errors import InputError
from ampflow.cli import main
from ampflow.contract.config import EarlyStoppingConfig, LossWeights, ModelConfig, StageConfig, TrainConfig, calibration_sections
from ampflow.contract.plan import Plan
from ampflow.contract.strategies import CHUNKED_ATTENTION, FEATURE_PARALLEL, HIDDEN_PARALLEL, KEY_FIRST_DECODE
from ampflow.model.attention import local_attention_banded
from ampflow.report.plan_text import step_text
from ampflow.rules.args import calibration_args

GIB = 2**30


def need(profile, names, dp, tp, chunk) -> int:
    """The memory model's bytes for a candidate: peak + one query block's scores."""
    est = estimate_for_profile(profile, names, dp, tp, chunk)
    return est.total + est.transient["attention_scores"]


# ------------------------------------------------------------------ the model itself
def test_solve_recovers_the_constants_of_synthetic_timings():
    flops, dense_flops, enc_flops, blocks = 3.0e7, 1.0e8, 5.0e7, 64
    rate, dense_rate, enc_rate, overhead = 2.5e9, 4.0e10, 6.0e10, 1.2e-3
    one = flops / rate + overhead
    many = flops / rate + blocks * overhead
    c = cm.solve_calibration(one, many, blocks, flops, dense_flops / dense_rate, dense_flops, enc_flops / enc_rate, enc_flops, 17)
    assert c.attention_flops_per_s == pytest.approx(rate, rel=5e-3)
    assert c.dense_flops_per_s == pytest.approx(dense_rate, rel=5e-3)
    assert c.encoder_flops_per_s == pytest.approx(enc_rate, rel=5e-3)
    assert c.chunk_overhead_s == pytest.approx(overhead, rel=5e-3)
    # noise that makes chunks look free or faster never gives a negative overhead
    noisy = cm.solve_calibration(one, one * 0.9, blocks, flops, 1.0, dense_flops, 1.0, enc_flops, 17)
    assert noisy.chunk_overhead_s > 0 and noisy.attention_flops_per_s > 0


def test_more_chunks_cost_more_and_tp_divides_the_attention():
    shape = cm.StepShape.from_profile(mm10_profile())
    c = cm.DEFAULT_CONSTANTS
    s3 = {CHUNKED_ATTENTION}
    costs = [cm.step_cost(shape, c, s3, 1, 1, ch).seconds for ch in (0, 2048, 512, 64, 16)]
    assert costs == sorted(costs) and len(set(costs)) == len(costs)
    # one block is what S3 without a chunk, or no S3 at all, runs
    assert cm.step_cost(shape, c, (), 1, 1, 512).seconds == costs[0]
    one = cm.step_cost(shape, c, s3, 1, 1, 512)
    s5 = cm.step_cost(shape, c, s3 | {HIDDEN_PARALLEL}, 1, 2, 512)
    assert s5.attention_s < one.attention_s and s5.dense_s < one.dense_s
    # S5 all-reduces every chunk's scores forward and their gradient backward
    assert s5.collectives == 9 * (2 * one.blocks + cm.S5_PER_BLOCK) and one.collectives == 0
    assert cm.step_cost(shape, c, s3 | {HIDDEN_PARALLEL}, 1, 1, 512).collectives == 0  # tp 1: nothing to reduce
    s2 = cm.step_cost(shape, c, {FEATURE_PARALLEL}, 1, 2, 0)
    assert s2.collectives == 10 * cm.S2_PER_STRATUM
    # key-first decodes |F_k| < n features per stratum instead of n anchors
    assert cm.step_cost(shape, c, {KEY_FIRST_DECODE}, 1, 1, 0).dense_s < cm.step_cost(shape, c, (), 1, 1, 0).dense_s
    assert cm.cost_for_profile({"modalities": {"rna": {"n_features": 10}}, "model": {}, "train": {}}, (), 1, 1, 0) is None


def test_calibration_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "calibration.json"
    bad.write_text(json.dumps({"constants": {"attention_flops_per_s": 1e9}}))
    with pytest.raises(InputError, match="missing"):
        cm.read_calibration(bad)
    # a file from before the encoders were timed: calibrate again
    old = {"attention_flops_per_s": 1e9, "dense_flops_per_s": 1e10, "chunk_overhead_s": 1e-4, "band_width": 17}
    bad.write_text(json.dumps({"version": 2, "constants": old}))
    with pytest.raises(InputError, match="calibrate") as e:
        cm.read_calibration(bad)
    assert "encoder_flops_per_s" in str(e.value) and "ampflow calibrate" in str(e.value)
    bad.write_text(json.dumps({"constants": {**old, "attention_flops_per_s": -1, "encoder_flops_per_s": 1}}))
    with pytest.raises(InputError, match="attention_flops_per_s"):
        cm.read_calibration(bad)
    bad.write_text("{nope")
    with pytest.raises(InputError, match="not valid JSON"):
        cm.read_calibration(bad)
    with pytest.raises(InputError, match="does not exist"):
        cm.read_calibration(tmp_path / "missing.json")


# ------------------------------------------------------------------ (a) calibration vs a measured third setting
def _time_kernel(n, heads, head_dim, window, chunk, reps=5) -> float:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(heads, n, head_dim, generator=g, requires_grad=True)
    v = torch.randn(heads, n, head_dim, generator=g, requires_grad=True)
    best = math.inf
    for r in range(reps + 1):
        t = time.perf_counter()
        local_attention_banded(q, q, v, window, chunk).sum().backward()
        if r:  # the first run warms up
            best = min(best, time.perf_counter() - t)
    return best


def test_calibrated_constants_predict_the_kernel_at_other_chunk_sizes():
    """Calibrated at one block and 32 chunks, the constants predict the measured time at
    8 and at 128 chunks within a factor of 3, and get the order right: more chunks, slower."""
    model, n = ModelConfig(heads=4, latent_dim=32, window=8), 2048
    threads = torch.get_num_threads()
    doc = calibrate(model, TrainConfig(device="cpu", threads=1), anchors=n, blocks=32, reps=3)
    assert torch.get_num_threads() == threads  # the benchmark leaves the process as it was
    c = cm.constants_from_doc(doc)
    assert c.chunk_overhead_s > 0 and c.band_width == 17 and doc["device"].startswith("cpu")
    torch.set_num_threads(1)
    try:
        measured = {blocks: _time_kernel(n, 4, 8, 8, n // blocks) for blocks in (8, 128)}
    finally:
        torch.set_num_threads(threads)
    flops = cm.attention_flops(n, 8, 4, 8)
    predicted = {b: flops / c.attention_flops_per_s + b * c.chunk_overhead() for b in measured}
    for b in measured:
        assert 1 / 3 < predicted[b] / measured[b] < 3, (b, predicted, measured, doc["measured"])
    assert measured[128] > measured[8] and predicted[128] > predicted[8]


def _time_encoder(encoder, x, reps=5) -> float:
    best = math.inf
    for r in range(reps + 1):
        t = time.perf_counter()
        loc, std = encoder(x)
        (loc.sum() + std.sum()).backward()
        if r:
            best = min(best, time.perf_counter() - t)
    return best


def test_calibrated_encoder_rate_predicts_the_models_encoder():
    """Referee: the wall-clock time of the model's own encoder (its LeakyReLU, BatchNorm,
    dropout and Normal heads included), forward and backward, at input widths the
    calibration did not time: predicted by ``encoder_flops`` over the calibrated rate
    within a factor of 3, and the wider input the slower in both.

    Calibration and measurement alternate over a few rounds, each keeping its fastest
    (the highest rate, the shortest time): a neighbour that loads the memory bus for a
    while (another test, ``stress --vm 2``) slows whichever of the two it overlaps, and
    one round of each failed 2 times in 4 beside it, in both directions."""
    from ampflow.model.encoders import Encoder

    threads = torch.get_num_threads()
    torch.manual_seed(0)
    for batch, hidden in ((64, 128), (32, 256)):
        rate, measured = 0.0, {}
        encoders = {n_in: (Encoder(n_in, hidden, 12, 0.1).train(), torch.rand(batch, n_in)) for n_in in (2000, 12000)}
        for _ in range(ENCODER_ROUNDS):
            doc = calibrate(ModelConfig(hidden_dim=hidden), TrainConfig(device="cpu", threads=1, batch_size=batch), anchors=256, blocks=4, reps=3)
            assert doc["shape"]["hidden_dim"] == hidden and doc["shape"]["batch_size"] == batch
            rate = max(rate, cm.constants_from_doc(doc).encoder_flops_per_s)
            torch.set_num_threads(1)
            try:
                for n_in, (encoder, x) in encoders.items():
                    measured[n_in] = min(measured.get(n_in, math.inf), _time_encoder(encoder, x))
            finally:
                torch.set_num_threads(threads)
        predicted = {n_in: cm.encoder_flops(batch, n_in, hidden, 12) / rate for n_in in measured}
        for n_in in measured:
            assert 1 / 3 < predicted[n_in] / measured[n_in] < 3, (batch, hidden, n_in, predicted, measured, doc["measured"])
        assert measured[12000] > measured[2000] and predicted[12000] > predicted[2000]


#: Alternations of calibration and measurement (test_calibrated_encoder_rate_...)
ENCODER_ROUNDS = 4


# ------------------------------------------------------------------ (b) tight and loose budgets
def test_a_tight_budget_gets_a_chunk_that_fits_and_a_loose_one_the_fastest():
    p = mm10_profile()
    s3 = (CHUNKED_ATTENTION, KEY_FIRST_DECODE)  # 13x the RNA's features: S4 is on
    one, c2048, c256 = need(p, s3, 1, 1, 0), need(p, s3, 1, 1, 2048), need(p, s3, 1, 1, 256)
    assert c256 < c2048 < one  # a chunk saves only transient scores
    loose = diagnose(p, 1, 80 * GIB, 1.0)
    assert loose.chunk_size is None and CHUNKED_ATTENTION not in loose.names and loose.fits
    for budget, chunk in ((c2048 + (one - c2048) // 2, 2048), (c256, 256), (c256 + 1, 256)):
        tight = diagnose(p, 1, budget, 1.0)
        assert tight.fits and tight.chunk_size == chunk and CHUNKED_ATTENTION in tight.names
        assert need(p, tight.names, 1, 1, tight.chunk) <= budget < need(p, tight.names, 1, 1, 0)  # the referee
        # a larger chunk (fewer blocks, faster) would not fit
        assert all(need(p, s3, 1, 1, c) > budget for c in _chunk_candidates(2700) if c > chunk)
        assert any(r.startswith(f"chunk {chunk}: the fastest that fits") and "one block (no chunk)" in r for r in tight.reasons)
        assert tight.predicted_step_seconds > loose.predicted_step_seconds
    # nothing fits: the smallest chunk, and the plan says it does not fit
    worst = diagnose(p, 1, need(p, s3, 1, 1, 16) - 1, 1.0)
    assert not worst.fits and worst.chunk_size == 16


# ------------------------------------------------------------------ (c) identical inputs, identical bytes
def test_identical_inputs_give_byte_identical_plans(tmp_path):
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps(mm10_profile()))
    cal = tmp_path / "calibration.json"
    assert main(["calibrate", "--model", json.dumps({"window": 8}), "--train", json.dumps({"device": "cpu", "threads": 1}),
                 "--anchors", "512", "--blocks", "8", "--reps", "1", "--out", str(cal)]) == 0  # fmt: skip
    doc = json.loads(cal.read_text())
    assert set(doc["constants"]) == {"attention_flops_per_s", "dense_flops_per_s", "encoder_flops_per_s", "chunk_overhead_s", "band_width",
                                     "collective_s"}  # fmt: skip
    assert all(cm.sig(v) == v for v in doc["constants"].values())  # written rounded
    plans = []
    for i in range(2):
        out = tmp_path / f"plan{i}.json"
        args = ["diagnose", str(prof), "--devices", "4", "--device-memory", "80", "--calibration", str(cal), "--out", str(out)]
        assert main(args) == 0
        plans.append(out.read_bytes())
    assert plans[0] == plans[1]
    plan = Plan.read(tmp_path / "plan0.json")
    assert plan.version == 4 and plan.cost_model.source == f"calibrated on {doc['device']}"
    assert plan.cost_model.constants == doc["constants"]
    assert plan.predicted_step_seconds == plan.cost_model.terms["seconds"] > 0
    assert any("calibrated on cpu" in r for r in plan.reasons)
    assert Plan.from_dict(json.loads(plans[0])) == plan and plan.dumps().encode() == plans[0]
    # without a calibration file: the documented defaults, and the plan says so
    assert main(["diagnose", str(prof), "--devices", "4", "--device-memory", "80", "--out", str(tmp_path / "d.json")]) == 0
    default = Plan.read(tmp_path / "d.json")
    assert default.cost_model.source == "defaults" and default.cost_model.constants == cm.DEFAULT_CONSTANTS.to_dict()
    assert any("the documented defaults: no calibration file" in r for r in default.reasons)
    # a version 1 plan (no cost fields) still reads
    old = json.loads(plans[0])
    for key in ("predicted_step_seconds", "cost_model"):
        old.pop(key)
    old["version"] = 1
    assert Plan.from_dict(old).predicted_step_seconds is None and step_text(Plan.from_dict(old)) == "not predicted"


# ------------------------------------------------------------------ (d) the shape
@pytest.mark.parametrize("devices", [1, 4])
def test_mm10_at_1mb_no_longer_gets_chunk_2048_unless_memory_forces_it(devices):
    """The old rule took the largest power of two below 2,700 anchors (2048) whatever the
    budget; with room, one block is faster and is chosen."""
    p = mm10_profile()
    roomy = diagnose(p, devices, 80 * GIB)
    assert roomy.chunk_size is None and roomy.fits
    (why,) = [r for r in roomy.reasons if r.startswith("S3 chunked_attention not taken")]
    cands = {c.chunk: c for c in roomy.cost_model.candidates}
    assert f"one block (no chunk) fits and is the fastest: {cands[None].seconds:.3g} s/step predicted vs {cands[2048].seconds:.3g} s at chunk 2048" in why
    assert cands[None].seconds < cands[2048].seconds and all(c.fits for c in cands.values())
    # the memory model's referee: one block's bytes are within the budget
    dp = roomy.mesh.dp
    assert need(p, roomy.names, dp, 1, 0) <= roomy.inputs.budget_bytes
    # memory forces 2048: one block does not fit, 2048 does
    s3 = (CHUNKED_ATTENTION, KEY_FIRST_DECODE)
    budget = (need(p, s3, dp, 1, 2048) + need(p, s3, dp, 1, 0)) // 2
    forced = diagnose(p, devices, budget, 1.0)
    assert forced.chunk_size == 2048 and forced.fits and forced.mesh.dp == devices


# ------------------------------------------------------------------ (e) what the calibration measures with
class _OpLog(TorchDispatchMode):
    """Every tensor operation the benchmark runs (forward and backward): its name, the
    torch threads at the time, and its arguments' shapes, dtypes, devices and scalars."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = pytree.tree_leaves((args, kwargs))
        self.ops.append((str(func), torch.get_num_threads(), tuple(map(_describe, leaves))))
        return func(*args, **kwargs)


def _describe(a):
    if isinstance(a, torch.Tensor):
        return ("tensor", tuple(a.shape), str(a.dtype), str(a.device))
    if isinstance(a, (bool, int, float, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return a
    return type(a).__name__  # a generator: its address is not the measurement


def _measured_with(model: ModelConfig, train: TrainConfig):
    """What one small calibration ran, less its timings: its operations and the shape and
    device it records."""
    log = _OpLog()
    with log:
        doc = calibrate(model, train, anchors=32, blocks=2, reps=1)
    return log.ops, {k: v for k, v in doc.items() if k not in ("measured", "constants")}


# another value of every key (stages: of each of their keys), none of them the default
MODEL_CHANGES = {
    "latent_dim": [24], "private_dim": [2], "hidden_dim": [32], "decoder_dim": [8], "heads": [2], "window": [5],
    "attention": [False], "chunk": [4], "key_first": [True], "ffn_mult": [3], "dropout": [0.2], "neg_samples": [3],
    "graph_batch": [128], "batch_key": [None], "hic_band_weight": ["sqrt"], "hic_diagonal": [False], "hic_transform": ["linear"],
    "hic_max_stratum": [3], "hic_max_distance": [3_000_000], "hic_pcs": [4], "hic_likelihood": ["all"],
}  # fmt: skip
STAGE = StageConfig(5, 0.01, LossWeights())
TRAIN_CHANGES = {
    "seed": [7], "batch_size": [16], "checkpoint_every": [9], "checkpoint_seconds": [5], "keep_checkpoints": [2], "threads": [2], "device": ["auto"],
    "dtype": ["float64"], "deterministic": [False], "log_every": [5], "compile": [True], "cuda_graphs": [False], "clip_grad_norm": [None, 1e-3, "zscore"],
    "weight_decay": [0.1], "hic_keep_min": [0.5], "hic_thinned": ["both"], "early_stopping": [EarlyStoppingConfig(patience=0)],
    "pretrain": [replace(STAGE, epochs=50), replace(STAGE, lr=0.5), replace(STAGE, weights=LossWeights(align=3.0, hic_kl=1.0))],
    "finetune": [replace(STAGE, epochs=50), replace(STAGE, lr=0.5), replace(STAGE, weights=LossWeights(kl=2.0, cross=1.0))],
}  # fmt: skip


def test_every_config_key_has_a_change_to_try():
    """A key added to the sections must be placed: measured with or not."""
    assert set(MODEL_CHANGES) == {f.name for f in fields(ModelConfig)}
    assert set(TRAIN_CHANGES) == {f.name for f in fields(TrainConfig)}


@pytest.mark.parametrize("decoder_dim", [None, 16], ids=["D=latent", "D=decoder_dim"])
def test_calibration_sections_hold_exactly_what_the_benchmark_runs_with(decoder_dim):
    """Referee: the operations the benchmark runs (shapes, dtypes, devices, threads) and
    the shape and device it records. From the sections alone it runs what it runs from
    the whole config; one key changed changes what it runs exactly when it changes the
    sections, so the devices rule (whose params they are) re-times the machine for every
    change that matters and for no other."""
    model = ModelConfig(latent_dim=12, decoder_dim=decoder_dim, hidden_dim=64, heads=4, window=3)
    train = TrainConfig(device="cpu", threads=1, seed=3)
    sections = calibration_sections(model, train)
    base = _measured_with(model, train)
    assert base[1]["shape"]["D"] == (decoder_dim or 12) and base[1]["device"] == "cpu (1 thread)"
    from_sections = _measured_with(ModelConfig.from_dict(sections["model"]), TrainConfig.from_dict(sections["train"]))
    assert from_sections == base
    changes = [(ModelConfig, k, v) for k, vs in MODEL_CHANGES.items() for v in vs]
    changes += [(TrainConfig, k, v) for k, vs in TRAIN_CHANGES.items() for v in vs]
    moved = {}
    for cls, key, value in changes:
        m, t = (replace(model, **{key: value}), train) if cls is ModelConfig else (model, replace(train, **{key: value}))
        moved[(cls.__name__, key, str(value))] = (calibration_sections(m, t) != sections, _measured_with(m, t) != base)
    # train.device auto is CUDA where the job runs when a GPU is there: the sections keep
    # it as given, though on a host without one it runs on the CPU like "cpu"
    if not torch.cuda.is_available():
        assert moved.pop(("TrainConfig", "device", "auto")) == (True, False)
    assert [k for k, (in_sections, ran) in moved.items() if in_sections != ran] == []
    # the keys that matter: D (latent_dim where no decoder_dim is set), heads, window,
    # ffn_mult, the encoder's hidden_dim and batch_size, threads
    measured = sorted({k[1] for k, (in_sections, _) in moved.items() if in_sections})
    expected = ["batch_size", "decoder_dim", "ffn_mult", "heads", "hidden_dim", "threads", "window"]
    expected += ["latent_dim"] if decoder_dim is None else []
    assert measured == sorted(expected)


def test_the_calibrate_command_measures_the_same_from_the_rules_arguments(tmp_path):
    """``ampflow calibrate`` given the devices rule's arguments (the sections of a whole
    config) records the shape and device it records given the whole config."""
    model = {"latent_dim": 16, "hidden_dim": 64, "heads": 2, "window": 3, "dropout": 0.2}
    train = {"device": "cpu", "threads": 1, "seed": 5, "pretrain": {"epochs": 3, "lr": 0.01, "weights": {"align": 2.0}}}
    docs = []
    for i, args in enumerate([shlex.split(calibration_args(model, train)), ["--model", json.dumps(model), "--train", json.dumps(train)]]):
        out = tmp_path / f"calibration{i}.json"
        assert main(["calibrate", *args, "--anchors", "32", "--blocks", "2", "--reps", "1", "--out", str(out)]) == 0
        docs.append({k: v for k, v in json.loads(out.read_text()).items() if k not in ("measured", "constants")})
    assert docs[0] == docs[1] and docs[0]["shape"]["D"] == 16 and docs[0]["shape"]["heads"] == 2
