"""Extraction through Snakemake (SIGKILL of the whole job, then a re-run) and on the real
FASTA files of ../shared/data/fasta under each policy."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
from conftest import workflow_copy
from extract_doubles import InlinePool, doubles_env, pool_class
from extract_helpers import random_fasta, tiny_models_in

from ampflow.base.errors import InputError
from ampflow.extract.config import ExtractSettings, ModelSpec
from ampflow.extract.run import extract_fasta

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
TARGET = "results/{dataset}/extract/prot.esm_test.h5ad"
# a model of its own: its one job runs on this input alone (the demo's inputs, merged
# in by Snakemake, use the demo's models)
EXTRACT_CONFIG = """
extract:
  inputs:
    prot: {fasta: prot.fa, models: [esm_test]}
  models:
    esm_test: {kind: esm2, tiny: true}
  sequences_per_file: 2
  cpu_workers: 2
"""
N_CHUNKS = 12


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    return tiny_models_in(tmp_path_factory)


def snakemake_cmd(target: str, *options: str) -> list[str]:
    return [
        str(BIN / "snakemake"), target, "--cores", "2", "--profile", "profiles/local", *options,
        "--configfile", "config/demo.yaml", "config/extract.yaml",
    ]  # fmt: skip


def finished_markers(cache: Path) -> list[Path]:
    """The shards' markers, not a killed writer's hidden temporary of one."""
    return [p for p in cache.glob("*/shards/*.done") if not p.name.startswith(".")]


def env(**extra) -> dict:
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", **extra}


def test_sigkill_mid_run_then_rerun(tmp_path):
    """SIGKILL Snakemake, the extract job and its workers (one process group) after some
    chunks are done; unlock and run again: the cached sequences are not computed again
    (shards untouched, the log counts them), the h5ad equals an uninterrupted run's, no
    temporary remains but the killed writers' in the shared cache."""
    from ampflow.demo import write_demo

    root = workflow_copy(tmp_path / "wf")
    write_demo(root / "resources" / "demo", n_cells=8, seed=0)
    (root / "config/extract.yaml").write_text(EXTRACT_CONFIG)
    random_fasta(root / "prot.fa", "esm2", 2 * N_CHUNKS, lengths=(20, 300))
    shards = root / "results/demo/extract/cache"
    target = TARGET.format(dataset="demo")

    log = open(tmp_path / "killed.log", "w")
    # the workers wait 0.4 s after each chunk: a window to kill the job in
    proc = subprocess.Popen(
        snakemake_cmd(target), cwd=root, env=doubles_env(tmp_path / "site", env(), chunk_delay=0.4),
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while len(finished_markers(shards)) < 3:
            assert proc.poll() is None, (tmp_path / "killed.log").read_text()
            assert time.monotonic() < deadline, "no chunk finished within 240 s"
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    time.sleep(0.5)  # the group's other processes are gone too (SIGKILL is not deliverable late)
    done = {p.name: p.read_bytes() for p in finished_markers(shards)}
    n_done = sum(len(json.loads(d)["keys"]) for d in done.values())
    assert 3 <= len(done) < N_CHUNKS, sorted(done)
    assert not (root / target).exists()
    killed_temps = set(shards.rglob(".tmp-*"))

    r = subprocess.run(snakemake_cmd(target, "--unlock"), cwd=root, env=env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run(snakemake_cmd(target), cwd=root, env=env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    text = (root / "logs/demo/extract.esm_test.log").read_text()
    assert f"{n_done} found in the cache, {2 * N_CHUNKS - n_done} to compute" in text, text
    for p in finished_markers(shards):
        assert p.name not in done or p.read_bytes() == done[p.name], f"{p.name} was rewritten"
    assert sum(len(json.loads(p.read_text())["keys"]) for p in finished_markers(shards)) == 2 * N_CHUNKS
    # no temporary outside the cache; in the shared cache only the killed writers' own,
    # left for an hour (another job may be writing one now)
    assert not [p for p in root.rglob(".tmp-*") if not p.is_relative_to(shards)]
    assert set(shards.rglob(".tmp-*")) <= killed_temps, sorted(set(shards.rglob(".tmp-*")) - killed_temps)
    assert (root / "logs/demo/extract.esm_test.benchmark.tsv").exists()

    r = subprocess.run(snakemake_cmd(TARGET.format(dataset="ref"), "--config", "dataset=ref"), cwd=root, env=env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    resumed, ref = ad.read_h5ad(root / target), ad.read_h5ad(root / TARGET.format(dataset="ref"))
    assert f"0 found in the cache, {2 * N_CHUNKS} to compute" in (root / "logs/ref/extract.esm_test.log").read_text()
    assert resumed.X.dtype == np.float32 and resumed.shape == (2 * N_CHUNKS, 32)
    assert np.array_equal(resumed.X, ref.X)
    print(
        f"\nkilled with {len(done)} of {N_CHUNKS} chunks done; the re-run logged "
        f"'{n_done} found in the cache, {2 * N_CHUNKS - n_done} to compute', left their markers byte-identical; "
        f"h5ad X equal to the uninterrupted run's: {np.array_equal(resumed.X, ref.X)} (max abs diff {np.abs(resumed.X - ref.X).max()})"
    )
    pd.testing.assert_frame_equal(resumed.obs, ref.obs)
    assert json.dumps(resumed.uns["extract"], sort_keys=True, default=str) == json.dumps(ref.uns["extract"], sort_keys=True, default=str)


# ------------------------------------------------------------------ real FASTA files
PROTEIN_FILES = ("esm_", ".faa")
POLICIES = {
    "default": {},
    "skip": {"empty": "skip", "invalid": "skip", "ambiguous": "skip", "duplicate_ids": "skip", "too_long": "skip"},
    "repair": {"invalid": "skip", "ambiguous": "replace", "duplicate_ids": "rename", "ids": "header"},
}


def facts(path: Path, kind: str) -> dict:
    """What a plain reading of the file says: records, distinct ids, ambiguous, long."""
    heads, headers, seqs = [], [], []
    for line in path.read_text().splitlines():
        if line.startswith(">"):
            heads.append(line[1:].split()[0])
            headers.append(" ".join(line[1:].split()))
            seqs.append([])
        else:
            seqs[-1].append(line.strip())
    seqs = ["".join(s).upper().rstrip("*") for s in seqs]
    standard, limit = ("ACDEFGHIKLMNPQRSTVWY", 1022) if kind == "esm2" else ("ACGT", 10000)
    return {
        "records": len(seqs),
        "duplicates": len(heads) - len(set(heads)),
        "duplicate_headers": len(headers) - len(set(headers)),
        "ambiguous": sum(bool(set(s) - set(standard)) for s in seqs),
        "long": sum(len(s) > limit for s in seqs),
    }


def test_real_fasta_files_under_each_policy(shared_data, tiny_models, tmp_path):
    """Every file under three policy sets: the report counts what a plain reading of the
    file finds, the h5ad holds the records not skipped. One work folder per file: a
    policy change re-splits, and chunks whose content did not change are reused."""
    files = sorted((shared_data / "fasta").iterdir())
    assert len(files) >= 13
    table = []
    for path in files:
        kind = "esm2" if path.name.startswith(PROTEIN_FILES[0]) or path.suffix == PROTEIN_FILES[1] else "dnabert_s"
        f = facts(path, kind)
        for policy, values in POLICIES.items():
            out = tmp_path / path.name / policy
            settings = ExtractSettings.from_dict({"sequences_per_file": 64, "fasta": values})
            args = (path, ModelSpec(kind=kind, tiny=True), kind, out.parent / "work", out / "x.h5ad", out / "r.tsv", out / "t.jsonl")
            if policy == "default" and f["duplicates"]:
                with pytest.raises(InputError) as e, pool_class(InlinePool):
                    extract_fasta(*args, settings=settings, model_folder=tiny_models[kind])
                assert str(path) in str(e.value) and "duplicate" in str(e.value)
                table.append((path.name, policy, "fails: " + str(e.value).split(": ", 1)[0].rsplit("/", 1)[-1]))
                continue
            with pool_class(InlinePool):
                extract_fasta(*args, settings=settings, model_folder=tiny_models[kind])
            a = ad.read_h5ad(out / "x.h5ad")
            report = pd.read_csv(out / "r.tsv", sep="\t", keep_default_na=False)
            counts = Counter(zip(report["problem"], report["action"]))
            skipped = sum(n for (_, action), n in counts.items() if action == "skipped")
            assert a.n_obs == f["records"] - skipped
            assert a.obs_names.is_unique and np.isfinite(a.X).all()
            assert (a.obs["length"] <= (1022 if kind == "esm2" else 10000)).all()
            if policy == "default":
                assert counts == Counter({k: v for k, v in {("ambiguous", "kept"): f["ambiguous"], ("too_long", "truncated"): f["long"]}.items() if v})
                assert int(a.obs["truncated"].sum()) == f["long"] == a.uns["extract"]["truncations"]["count"]
            elif policy == "skip":
                # a record counts once, under the first problem that skips it
                assert counts[("ambiguous", "skipped")] == f["ambiguous"]
                assert skipped == f["records"] - a.n_obs and not a.obs["truncated"].any()
            else:
                assert counts[("duplicate_ids", "renamed")] == f["duplicate_headers"]
                assert counts[("ambiguous", "replaced")] == f["ambiguous"]
                assert counts[("too_long", "truncated")] == f["long"]
                assert a.n_obs == f["records"]
            rows = ", ".join(f"{p} {act} {n}" for (p, act), n in sorted(counts.items())) or "no problem"
            table.append((path.name, policy, f"{a.n_obs}/{f['records']} embedded; {rows}"))
    print("\nfile | policy | result")
    for row in table:
        print(" | ".join(row))
    by = {(name, policy): res for name, policy, res in table}
    # 12 proteins of one contig: one first word, 6 headers twice
    assert by[("vibrant_Microviridae_MH552510.2.faa", "skip")].startswith("1/12")
    assert "renamed 6" in by[("vibrant_Microviridae_MH552510.2.faa", "repair")]
    assert by[("vibrant_mixed_example_prodigal.faa", "default")].startswith("fails")
    assert by[("vibrant_mixed_example_prodigal.faa", "repair")].startswith("181/181")
    # the 1.18 Mb record is read, truncated to max_length and reported with its length
    big = ad.read_h5ad(tmp_path / "virsorter2_8seq.fa" / "default" / "x.h5ad").obs.loc["NCLDV-linear"]
    assert (big["original_length"], big["length"], big["truncated"]) == (1181549, 10000, True)


def test_extraction_only_config_runs_through_snakemake(tmp_path):
    """A config with a dataset name and an extract section, no inputs (no cell sheet, no
    genome, no training configuration): Snakemake runs the extraction to the end, one
    extract job for the model over both inputs, no Hi-C job."""
    root = workflow_copy(tmp_path / "wf")
    random_fasta(root / "a.fa", "esm2", 30, seed=1, lengths=(10, 80))
    random_fasta(root / "b.fa", "esm2", 20, seed=2, lengths=(10, 80))
    (root / "config/only.yaml").write_text(
        "dataset: prot\n"
        "extract:\n"
        "  inputs:\n"
        "    a: {fasta: a.fa, models: [esm]}\n"
        "    b: {fasta: b.fa, models: [esm], policy: {too_long: window}}\n"
        "  models:\n"
        "    esm: {kind: esm2, tiny: true, max_length: 50}\n"
        "  cpu_workers: 2\n"
    )
    cmd = [str(BIN / "snakemake"), "--cores", "2", "--profile", "profiles/local", "--configfile", "config/only.yaml"]
    r = subprocess.run(cmd, cwd=root, env=env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    jobs = Counter(ln.split()[1].rstrip(":") for ln in r.stderr.splitlines() if ln.startswith(("rule ", "localrule ")))
    print(f"\nextraction-only run: {dict(jobs)}")
    assert jobs == Counter({"tiny_model": 1, "extract": 1, "extract_outputs": 2, "extract_windows": 1, "report_extraction": 2, "all": 1})
    out = root / "results/prot/extract"
    a, b = ad.read_h5ad(out / "a.esm.h5ad"), ad.read_h5ad(out / "b.esm.h5ad")
    assert (a.n_obs, b.n_obs) == (30, 20) and (out / "b.esm.windows.h5ad").exists() and not (out / "a.esm.windows.h5ad").exists()
    assert (a.obs["length"] == a.obs["original_length"].clip(upper=50)).all() and (b.obs["length"] == b.obs["original_length"]).all()
    assert not (root / "results/prot/binned").exists() and not (root / "results/prot/qc").exists()
