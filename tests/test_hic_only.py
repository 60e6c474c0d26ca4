"""Hi-C-only datasets (no RNA matrix): QC, the anchor-only graph, the profile and plan,
the memory model against measured steps, training, evaluation and ``ampflow embed`` of
the Hi-C-only model, and its parallel strategies against one process.

The referees are independent of the code under test: QC decisions are recomputed from
the contact table, the graph from ``hic.h5ad``, the memory prediction is compared with
the allocator's peak of a real steady-state training step
(:func:`~ampflow.train.measured_memory.measured_step`), and
the sharded steps with the single-process model.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import torch
from dist_helpers import run_world
from helpers import SETTINGS as FIXED_SCHEDULE
from parallel_equivalence import CONFIGS, LR, SETS, WEIGHTS, _plan, _snapshot, assert_rank_matches, fit_hic_input
from synthetic_shapes import synthetic_features, synthetic_graph

from ampflow.amp.decide.diagnose import diagnose
from ampflow.amp.memory.predict import ShapeSpec, estimate_for_profile, predict
from ampflow.amp.profile import main_profile
from ampflow.cli import main
from ampflow.contract.config import LossWeights, ModelConfig, TrainConfig
from ampflow.contract.model_shapes import paired_model_params
from ampflow.contract.strategies import CHUNKED_ATTENTION, DATA_PARALLEL, KEY_FIRST_DECODE
from ampflow.demo import write_demo
from ampflow.evaluate.run import main_evaluate
from ampflow.model.paired import PairedModel
from ampflow.parallel.data_parallel import DataParallelStep, balanced_split, draw_noise
from ampflow.parallel.mesh import Mesh
from ampflow.parallel.parallelize import parallelize
from ampflow.train.data import load_paired
from ampflow.train.measured_memory import measured_step
from ampflow.train.trainer import Trainer, make_optimizer

HIC_TERMS = {"hic_nll", "hic_kl", "graph_nll", "graph_kl", "total"}
MODEL = ModelConfig(latent_dim=8, hidden_dim=32, heads=2, window=2)
# the shared fixed schedule (keep_checkpoints 3 is the default), two epochs and one
SETTINGS = {**FIXED_SCHEDULE, "pretrain": {"epochs": 2}, "finetune": {"epochs": 1}}
MIN_CONTACTS, MIN_CIS = 100, 0.5


# ----------------------------------------------------------------- a Hi-C-only data folder
@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """The prepare commands on a 24-cell demo without its RNA matrix, as the workflow
    runs them for a config without ``inputs.rna`` (each cell held out with chance 0.2; split
    seed 1 draws six of the 24, enough to score, where seed 0 draws two)."""
    root = tmp_path_factory.mktemp("hic-only")
    paths = write_demo(root / "demo", n_cells=24, seed=0, n_genes=300)
    work, sheet, sizes = root / "work", paths["sheet"], paths["chromsizes"]
    data, scool, qc, split = work / "data", work / "binned" / "1000000.scool", work / "qc" / "cells.tsv", work / "qc" / "split.tsv"
    steps = [
        ["bin-cells", "--sheet", sheet, "--chromsizes", sizes, "--resolutions", "1000000", "--out-scool", scool,
         "--stats", work / "qc" / "contacts.tsv", "--cache-dir", work / "cache", "--threads", "1"],
        ["qc-cells", "--sheet", sheet, "--contacts", work / "qc" / "contacts.tsv", "--min-contacts", MIN_CONTACTS,
         "--min-cis-fraction", MIN_CIS, "--out", qc],
        ["split-cells", "--qc", qc, "--holdout", 0.2, "--label-key", "cell_type", "--seed", "1", "--out", split],
        ["pseudobulk", "--scool", f"1000000={scool}", "--qc", qc, "--out", work / "binned" / "pseudobulk.mcool"],
        ["strata", "--scool", scool, "--qc", qc, "--chromsizes", sizes, "--strata", "4", "--min-cells", "2",
         "--min-count", "2", "--split", split, "--out", data / "hic.h5ad"],
        ["graph", "--hic", data / "hic.h5ad", "--mcool", work / "binned" / "pseudobulk.mcool", "--chromsizes", sizes,
         "--out", data / "graph"],
    ]  # fmt: skip
    for step in steps:
        assert main([str(x) for x in step]) == 0, step[0]
    assert not (data / "rna.h5ad").exists()
    return work


def test_qc_passes_cells_on_contacts_alone(work):
    contacts = pd.read_csv(work / "qc" / "contacts.tsv", sep="\t", index_col="cell_id", dtype={"cell_id": str})
    qc = pd.read_csv(work / "qc" / "cells.tsv", sep="\t", index_col="cell_id", dtype={"cell_id": str}, keep_default_na=False)
    assert list(qc.index) == list(contacts.index)
    kept = contacts["cis"] + contacts["trans"]
    expect = (kept >= MIN_CONTACTS) & (contacts["cis"] / kept.where(kept > 0, 1) >= MIN_CIS)
    assert qc["pass"].astype(str).eq("True").tolist() == expect.tolist()
    assert 0 < expect.sum() < len(expect) or expect.all()
    assert (qc["in_rna"].astype(str) == "False").all()
    assert (qc["rna_umis"] == "").all()  # empty, not zero
    assert not any("RNA" in r for r in qc["reason"])


def test_graph_has_anchors_and_contact_edges_only(work):
    data = work / "data"
    hic = ad.read_h5ad(data / "hic.h5ad")
    nodes = pd.read_parquet(data / "graph" / "nodes.parquet")
    edges = pd.read_parquet(data / "graph" / "edges.parquet")
    anchors = hic.var[hic.var["stratum"] == 0].sort_values("anchor")
    assert list(nodes["name"]) == list(anchors.index)
    assert set(nodes["kind"]) == {"anchor"}
    assert set(edges["kind"].astype(str)) == {"bin_bin", "self"}
    bb = edges[edges["kind"] == "bin_bin"]
    assert len(bb) > 0
    pairs = set(zip(bb["source"], bb["target"]))
    assert all((t, s) in pairs for s, t in pairs)  # both directions
    assert (bb["source"] != bb["target"]).all()
    loops = edges[edges["kind"] == "self"]
    assert sorted(loops["source"]) == list(range(len(nodes)))
    assert ((edges["weight"] > 0) & (edges["weight"] <= 1)).all()
    meta = json.loads((data / "graph" / "graph.json").read_text())
    assert meta["n_genes"] == 0 and meta["n_anchors"] == len(nodes)


def test_load_paired_without_rna(work):
    d = load_paired(work / "data")
    assert not d.has_rna and d.rna.shape == (d.n_cells, 0) and d.genes == []
    assert d.graph.gene_nodes.numel() == 0 and "rna" not in d.meta
    rna, hic = d.batch(np.arange(3))
    assert rna.shape == (3, 0) and hic.shape == (3, d.hic.shape[1])


# ----------------------------------------------------------------- profile and plan
def test_profile_and_plan_of_a_hic_only_folder(work, tmp_path):
    prof = main_profile(work / "data", MODEL.to_dict(), SETTINGS, tmp_path / "profile.json")
    assert set(prof["modalities"]) == {"hic"}
    mem = prof["memory"]
    assert "rna_encoder" not in mem["components"] and "rna_decoder" not in mem["components"]
    assert mem["total_bytes"] > 0
    # a generous budget: one block of attention fits and is the fastest, so no S3 (its
    # signal is raised: a reason says why not), and nothing else is needed
    roomy = diagnose(prof, 1, 10**10)
    assert [s.name for s in roomy.strategies] == [] and roomy.fits and not roomy.key_first and roomy.chunk_size is None
    assert any(r.startswith("S3 chunked_attention not taken") and "one block (no chunk) fits and is the fastest" in r for r in roomy.reasons)
    # more devices: S1 as the substrate
    assert DATA_PARALLEL in [s.name for s in diagnose(prof, 2, 10**10).strategies]


def _hic_profile(n=400, L=5, B=64):
    """A Hi-C-only profile big enough for the decoder to be the bottleneck, with sparse
    strata above 0 (a fifth of the bin pairs kept), where key-first saves keys."""
    cfg = ModelConfig(latent_dim=16, hidden_dim=32, decoder_dim=64, heads=4, window=3)
    fps = [n] + [(n - k) // 5 for k in range(1, L)]
    return {
        "modalities": {"hic": {"n_features": sum(fps), "n_strata": L, "n_anchors": n, "features_per_stratum": fps, "attention": True, "window": 3}},
        "graph": {"n_nodes": n, "n_edges": 8 * n},
        "model": cfg.to_dict(),
        "train": {"batch_size": B, "dtype": "float32", "optimizer": "adam", "cross_reconstruction": False},
    }


def _need(prof, names, chunk):
    """The memory model's bytes for a one-device candidate: the predicted peak plus one
    query block's transient attention scores."""
    est = estimate_for_profile(prof, names, 1, 1, chunk)
    return est.total + est.transient["attention_scores"], est


def test_plan_for_hic_alone_picks_chunking_and_key_first_when_the_decoder_does_not_fit():
    prof = _hic_profile()
    plain_need, plain = _need(prof, [], 0)
    kf_need, kf = _need(prof, [KEY_FIRST_DECODE], 0)
    assert kf.total < plain.total
    # the banded kernel holds the same bytes at every chunk: a chunk saves only its
    # transient scores, and 256 (the largest candidate below 400 anchors, the fewest
    # blocks) saves the least of them
    c256_need, c256 = _need(prof, [CHUNKED_ATTENTION, KEY_FIRST_DECODE], 256)
    assert c256.total == kf.total and c256_need < kf_need
    # key-first needed and one block's scores just too many: the fastest chunk that fits
    tight = diagnose(prof, 1, (c256_need + kf_need) // 2, budget_fraction=1.0)
    names = [s.name for s in tight.strategies]
    assert names == [CHUNKED_ATTENTION, KEY_FIRST_DECODE] and tight.key_first and tight.fits
    assert tight.chunk_size == 256 and tight.predicted_peak_bytes == c256.total
    assert any(r.startswith("chunk 256: the fastest that fits") and "one block (no chunk)" in r for r in tight.reasons)
    assert any("only modality" in r for r in tight.reasons)
    # room for one block with key-first: no S3
    kf_only = diagnose(prof, 1, kf_need, budget_fraction=1.0)
    assert [s.name for s in kf_only.strategies] == [KEY_FIRST_DECODE] and kf_only.chunk_size is None and kf_only.fits
    # and with room for one block of the plain decoder, neither
    assert [s.name for s in diagnose(prof, 1, plain_need, budget_fraction=1.0).strategies] == []
    sig = tight.signals["HIGH_INPUT_DIMENSIONALITY"]
    assert not sig["raised"] and sig["evidence"]["reason"] == "no other modality"


def test_plan_for_rna_alone_is_data_parallel_only():
    prof = _hic_profile()
    prof["modalities"] = {"rna": {"n_features": 2000, "n_cells": 100}}
    plan = diagnose(prof, 4, 10**9)
    assert [s.name for s in plan.strategies] == [DATA_PARALLEL]
    assert plan.mesh.dp == 4 and plan.mesh.tp == 1 and plan.chunk_size is None and not plan.key_first
    assert plan.n_strata == 0
    assert not any(k.startswith("stratum") and v for k, v in plan.memory_components.items())
    assert plan.memory_components["rna_decoder"] > 0


# ----------------------------------------------------------------- memory model
def _model(n, L, B, cfg, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    anchor, stratum = synthetic_features(n, L, 0.5, 0, g)
    graph = synthetic_graph(0, n, g)
    if L == 1:  # the diagonal alone holds none of the default reach's strata: score it
        cfg = dataclasses.replace(cfg, hic_likelihood="all")
    torch.manual_seed(seed)
    model = PairedModel(cfg, 0, anchor, stratum, L, graph).to(dtype)
    hic = torch.poisson(torch.full((B, len(anchor)), 0.5), generator=g).to(dtype)
    fps = torch.bincount(stratum, minlength=L).tolist()
    spec = ShapeSpec.from_model(cfg, B, 0, fps, n, graph.n_nodes, graph.src.numel(), dtype_bytes=torch.finfo(dtype).bits // 8)
    # the trainer's Adam on CPU: the fused kernel, no temporaries
    return model, torch.zeros(B, 0, dtype=dtype), hic, dataclasses.replace(spec, optimizer_foreach=False)


@pytest.mark.parametrize(
    "L, chunk, key_first, decoder_dim, dtype",
    [(2, 0, False, None, torch.float32), (5, 8, True, 32, torch.float32), (4, 6, False, None, torch.float64)],
)
def test_hic_only_prediction_matches_a_measured_training_step(L, chunk, key_first, decoder_dim, dtype):
    """The memory model of a spec with no genes against the allocator's peak of a real
    Hi-C-only training step in the steady state (the second: Adam's moments exist),
    total and after every stratum, within 10 %."""
    cfg = ModelConfig(latent_dim=16, hidden_dim=32, decoder_dim=decoder_dim, heads=4, window=3, chunk=chunk, key_first=key_first)
    model, rna, hic, spec = _model(60, L, 8, cfg, dtype)
    opt = make_optimizer(model.parameters(), 1e-3, 0.0, capturable=False)
    # a cross weight is ignored: with one modality there is nothing to cross
    for seed in (1, 2):
        terms, memory = measured_step(model, opt, rna, hic, LossWeights(cross=1.0), torch.Generator().manual_seed(seed))
    assert set(terms) == HIC_TERMS
    measured, marks = memory.peak, memory.marks
    est = predict(spec, chunk=chunk, key_first=key_first)
    assert abs(est.total - measured) <= 0.10 * measured, (est.total, measured)
    assert len(est.marks) == len(marks) == L
    for p, m in zip(est.marks, marks):
        assert abs(p - m) <= 0.10 * m
    assert not {"rna_encoder", "rna_decoder"} & set(est.components)


@pytest.mark.parametrize("L, decoder_dim", [(1, None), (4, 32)])
def test_the_shape_description_is_the_hic_only_models(L, decoder_dim):
    cfg = ModelConfig(latent_dim=16, hidden_dim=32, decoder_dim=decoder_dim, heads=4, window=3)
    model, _, _, spec = _model(30, L, 4, cfg)
    described = paired_model_params(cfg, 0, L, spec.n_features, spec.n_nodes)
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == [(n, p.shape) for n, p in described.items()]
    assert not any(n.startswith("rna_") for n in model.state_dict())


# ----------------------------------------------------------------- train, evaluate, embed
@pytest.fixture(scope="module")
def trained(work, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hic-only-train") / "run"
    data = load_paired(work / "data")
    assert Trainer(data, MODEL, TrainConfig.from_dict(SETTINGS), out).fit() is True
    return out


def test_training_writes_hic_only_outputs(trained, work):
    rows = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(set(r["loss"]) == HIC_TERMS for r in rows)
    assert all(math.isfinite(r["loss"]["total"]) for r in rows)
    emb = ad.read_h5ad(trained / "embeddings.h5ad")
    assert "X_rna" not in emb.obsm
    np.testing.assert_array_equal(emb.obsm["X_joint"], emb.obsm["X_hic"])
    assert emb.obsm["X_hic"].shape == (ad.read_h5ad(work / "data" / "hic.h5ad").n_obs, MODEL.latent_dim)
    assert list(emb.uns["ampflow"]["modalities"]) == ["hic"]
    m = torch.load(trained / "model.pt", weights_only=True)
    assert m["genes"] == [] and not any(k.startswith("rna_") for k in m["state_dict"])


def test_evaluate_records_rna_scores_as_absent(trained, work, tmp_path):
    scores = main_evaluate(trained / "embeddings.h5ad", tmp_path / "eval", label_key="cell_type", data=work / "data")
    assert scores["modalities"] == ["hic"] and scores["foscttm"] is None
    assert set(scores["baselines"]) == {"hic", "bandnorm"}
    for g, entry in scores["groups"].items():
        assert set(entry["methods"]) == {"joint", "hic_latent", "hic_baseline", "bandnorm_baseline"}, g
        assert "foscttm" not in entry and "shuffled_control" not in entry
        assert {"rna_latent", "rna_baseline"} <= set(entry["absent"])
        for method in entry["methods"].values():
            assert math.isfinite(method["ari"]) and math.isfinite(method["nmi"])
    # the joint latent is the Hi-C latent: the same clustering, the same scores
    head = scores["groups"][scores["headline_group"]]["methods"]
    assert head["joint"]["ari"] == head["hic_latent"]["ari"]
    assert (tmp_path / "eval" / "umap.png").stat().st_size > 0
    on_disk = json.loads((tmp_path / "eval" / "scores.json").read_text())
    assert on_disk["groups"]["heldout"]["absent"]["foscttm"].startswith("no RNA")


def test_embed_a_hic_only_model_without_rna(trained, work, tmp_path):
    out = tmp_path / "e.h5ad"
    assert main(["embed", "--model", str(trained / "model.pt"), "--data", str(work / "data"), "--out", str(out)]) == 0
    again = ad.read_h5ad(out)
    emb = ad.read_h5ad(trained / "embeddings.h5ad")
    assert "X_rna" not in again.obsm and list(again.obs_names) == list(emb.obs_names)
    np.testing.assert_allclose(again.obsm["X_hic"], emb.obsm["X_hic"], rtol=1e-6, atol=1e-7)
    # --hic alone works too
    out2 = tmp_path / "e2.h5ad"
    assert main(["embed", "--model", str(trained / "model.pt"), "--hic", str(work / "data" / "hic.h5ad"), "--out", str(out2)]) == 0
    np.testing.assert_array_equal(ad.read_h5ad(out2).obsm["X_hic"], again.obsm["X_hic"])


# ----------------------------------------------------------------- parallel strategies
B = 12
HIC_SETS = ["S1", "S2+S3+S4+S5", "dp2xtp2 all"]


def _problem(dtype, config, n_anchors=9, L=4, seed=0):
    """The tensor-parallel tests' problem without genes: a Hi-C-only model."""
    g = torch.Generator().manual_seed(seed)
    anchor, stratum = synthetic_features(n_anchors, L, 0.7, 0, g)
    graph = synthetic_graph(0, n_anchors, g)
    cfg = ModelConfig(dropout=0.0, graph_batch=64, **CONFIGS[config])
    torch.manual_seed(seed)
    model = PairedModel(cfg, 0, anchor, stratum, L, graph).to(torch.float64)
    with torch.no_grad():  # move the zero-initialised decoder parameters off zero
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    depth = torch.linspace(2.0, 0.2, B, dtype=torch.float64)
    hic = torch.poisson(depth.unsqueeze(1).expand(B, len(anchor)), generator=g)
    fit_hic_input(model, hic, stratum)
    return model.to(dtype), torch.zeros(B, 0, dtype=dtype), hic.to(dtype)


def _reference(dtype, config, dp):
    model, rna, hic = _problem(dtype, config)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(5)
    torch.manual_seed(7)
    terms = model(rna, hic, WEIGHTS, generator=gen, noise=draw_noise(model, B, gen) if dp > 1 else None)
    terms["total"].backward()
    opt.step()
    return _snapshot(model, terms)


def _assert_close(a, b, dtype, what):
    """fp64 (the exactness proof): elementwise to 1e-9 relative. fp32: the tensor's
    relative error in the 2-norm to 5e-5; without the RNA terms some decoder
    gradients are small sums of cancelling parts (a bias of ~1e-4 measured 1.2e-5), so
    the paired tests' 1e-5 is rounding-tight here."""
    if dtype == torch.float64:
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=lambda m: f"{what}: {m}")
    else:
        a, b = a.double(), b.double()
        err = float((a - b).norm() / b.norm().clamp_min(1e-12))
        assert err <= 5e-5, f"{what}: relative error {err:.3g}"


def _worker(rank, world, cases):
    out = {}
    for name, config, dtype in cases:
        ids, dp, tp = SETS[name](world)
        model, rna, hic = _problem(dtype, config)
        mesh = Mesh.build(dp, tp)
        model = parallelize(model, _plan(ids, dp, tp), mesh)
        model.train()
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        gen = torch.Generator().manual_seed(5)
        torch.manual_seed(7)
        rows = balanced_split(hic.sum(1), dp)[mesh.dp_rank]
        terms = DataParallelStep(mesh).step(model, opt, rna[rows], hic[rows], WEIGHTS, rows, batch_size=B, generator=gen)
        snap = _snapshot(model, terms)
        snap["shards"] = dict(model.shards)
        out[(name, config, dtype)] = snap
    return out


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_hic_only_strategies_equal_one_process(tmp_path, world):
    """S1, S2-S5 over a tp group and a dp 2 x tp 2 mesh on the Hi-C-only model: the same
    loss terms (no RNA ones), every gradient (each rank's slice) and the parameters
    after one Adam step as one process, in fp64 and fp32."""
    cases = [(n, c, dt) for n in HIC_SETS for c in CONFIGS for dt in (torch.float64, torch.float32) if not (world == 2 and n == "dp2xtp2 all")]
    results = run_world(_worker, world, tmp_path, cases)
    for name, config, dtype in cases:
        ref = _reference(dtype, config, SETS[name](world)[1])
        assert set(ref["terms"]) == HIC_TERMS
        for rank, res in enumerate(results):
            got, tag = res[(name, config, dtype)], f"{name} {config} world {world} rank {rank} {dtype}"
            assert_rank_matches(got, ref, dtype, tag, close=_assert_close)  # this module's fp32 tolerance
            if name != "S1":
                assert got["shards"], tag  # the decoder really is sharded
