"""Which configuration a run uses: the template config/config.yaml a user copies, the
demo's config/demo.yaml (``make demo``), or the files given with ``--configfile``, which
then replace the template instead of being merged into it.

The referee is Snakemake's own dry-run: its job table (rule -> count) and the outputs it
lists, against the config files themselves (their ``configs`` and ``extract`` entries).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, workflow_copy

BIN = Path(sys.executable).parent
TEMPLATE = yaml.safe_load((REPO / "config/config.yaml").read_text())
DEMO = yaml.safe_load((REPO / "config/demo.yaml").read_text())
# a record each feature model of the demo can read
FASTA = {"esm2": ">p1\nMKTAYIAKQRQISFVKSHFSRQ\n", "dnabert_s": ">d1\nACGTACGTTAGCCGATCGATCGGATC\n"}


def dry_run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    cmd = [str(BIN / "snakemake"), "-n", "--cores", "1", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def job_counts(r: subprocess.CompletedProcess) -> dict[str, int]:
    """Rule -> jobs of the dry run's first "Job stats" table."""
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    lines = (r.stdout + r.stderr).splitlines()
    start = lines.index("Job stats:")
    counts = {}
    for ln in lines[start + 3 :]:  # past the header and its rule
        rule, n = ln.split()
        if rule == "total":
            assert sum(counts.values()) == int(n)
            return counts
        counts[rule] = int(n)
    raise AssertionError("no total line in the job table")


@pytest.fixture(scope="module")
def root(tmp_path_factory, demo_dir) -> Path:
    """A copy of the workflow beside a ``shared/data`` folder holding the demo's FASTA
    inputs (tiny stand-ins at the paths config/demo.yaml names), so that extraction is
    possible: only the config decides whether it is scheduled."""
    root = workflow_copy(tmp_path_factory.mktemp("cfg") / "ampflow")
    (root / "resources").mkdir()
    (root / "resources/demo").symlink_to(demo_dir, target_is_directory=True)
    models = DEMO["extract"]["models"]
    for inp in DEMO["extract"]["inputs"].values():
        path = root / inp["fasta"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(FASTA[models[inp["models"][0]]["kind"]])
    return root


def is_extraction(rule: str) -> bool:
    return "extract" in rule or rule == "tiny_model"


def user_config(root: Path, dataset: str, name: str) -> None:
    """A user's copy of the template: ``extract`` left out, its inputs pointed at the demo's files."""
    cfg = yaml.safe_load((root / "config/config.yaml").read_text())
    cfg.pop("extract", None)
    cfg["dataset"] = dataset
    cfg["inputs"] = {key: f"resources/demo/{f}" for key, f in
                     [("cells", "cells.tsv"), ("rna", "rna.tsv.gz"), ("genes", "genes.bed"), ("chromsizes", "chrom.sizes")]}  # fmt: skip
    (root / name).write_text(yaml.safe_dump(cfg, sort_keys=False))


def test_template_lists_no_optional_branch():
    """A copy of the template runs no extraction and embeds no extra cells."""
    assert not TEMPLATE.get("extract", {}).get("inputs")
    assert not TEMPLATE.get("embed")
    assert TEMPLATE["inputs"]["cells"] != DEMO["inputs"]["cells"]


def test_user_config_from_the_template_schedules_no_extraction(root):
    """The template copied, its inputs pointed at the demo's files and ``extract`` left
    out: the usual preparation and training jobs for the template's configurations, and
    no extraction job, though the demo's FASTA files are there to be found."""
    user_config(root, "mine", "my.yaml")
    r = dry_run(root, "--configfile", "my.yaml")
    jobs = job_counts(r)
    n = len(TEMPLATE["configs"])
    assert n == 3
    for rule, count in [("bin_block", 1), ("gather_blocks", 1), ("qc_cells", 1), ("split_cells", 1), ("strata", n), ("rna_data", n),
                        ("graph", n), ("diagnose", n), ("train", n), ("evaluate", n)]:  # fmt: skip
        assert jobs.get(rule) == count, (rule, jobs)
    assert not [rule for rule in jobs if is_extraction(rule)], jobs
    assert "/extract/" not in r.stdout + r.stderr
    assert not [rule for rule in jobs if rule.startswith("embed")], jobs
    # nothing of the demo's leaks in: every output is under the user's dataset
    outputs = re.findall(r"^\s+output: (.+)$", r.stdout + r.stderr, re.M)
    paths = [p.strip() for line in outputs for p in line.split(",")]
    assert paths and all(p.startswith(("results/mine/", "logs/mine/")) for p in paths), paths[:10]


def test_demo_config_schedules_extraction(root):
    """config/demo.yaml (as ``make demo`` gives it) still has its extraction jobs: one
    per (input, model) it lists, each model built once."""
    jobs = job_counts(dry_run(root, "--configfile", "config/demo.yaml"))
    pairs = [(name, m) for name, inp in DEMO["extract"]["inputs"].items() for m in inp["models"]]
    assert len(pairs) == 2
    assert jobs.get("extract") == len(pairs), jobs
    assert jobs.get("report_extraction") == len(pairs), jobs
    assert jobs.get("tiny_model") == len({m for _, m in pairs}), jobs
    assert jobs.get("train") == len(DEMO["configs"]), jobs


def test_without_configfile_the_template_is_read_and_named(root):
    """A bare ``snakemake`` reads the template; its placeholder inputs are missing, and
    the one line that says so names the file and the key and tells what to do."""
    r = dry_run(root)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    missing = TEMPLATE["inputs"]["cells"]
    assert not (root / missing).exists()
    line = next((ln for ln in out.splitlines() if missing in ln), None)
    assert line is not None, out[-3000:]
    for text in ("inputs.cells", "does not exist", "cp config/config.yaml config/my.yaml", "--configfile config/my.yaml", "make demo"):
        assert text in line, (text, line)
    assert "Traceback (most recent call last)" not in out


@pytest.mark.slow
def test_user_config_from_the_template_runs_to_the_end(root):
    """The same copied template (shorter training, the only change: a second file merged
    over it) runs the whole workflow to exit 0, writes the summary, and no extraction."""
    user_config(root, "mine_run", "my_run.yaml")
    (root / "quick.yaml").write_text("train: {pretrain: {epochs: 2}, finetune: {epochs: 1}, early_stopping: {patience: 0}}\n")
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    cmd = [str(BIN / "snakemake"), "--profile", "profiles/local", "--cores", "2", "--configfile", "my_run.yaml", "quick.yaml"]
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    out = root / "results/mine_run"
    assert (out / "figures/summary.html").exists()
    assert [(out / f"train/{c}/model.pt").exists() for c in ("1mb_s10", "500kb_s10", "100kb_s20")] == [True] * 3
    assert not (out / "extract").exists()


def test_demo_gpu_config_validates_and_without_a_gpu_stops_before_any_job(root):
    """config/demo-gpu.yaml (``make demo-gpu``): a dry run schedules the demo's jobs under
    its own dataset; a real run on a host where no GPU is visible (CUDA_VISIBLE_DEVICES
    empty hides any) stops at once, one line naming the key and its value, nothing run."""
    gpu = yaml.safe_load((root / "config/demo-gpu.yaml").read_text())
    jobs = job_counts(dry_run(root, "--configfile", "config/demo-gpu.yaml"))
    assert jobs.get("train") == len(gpu["configs"]) and jobs.get("diagnose") == len(gpu["configs"]), jobs
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [str(BIN / "snakemake"), "--cores", "1", "--configfile", "config/demo-gpu.yaml"]
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    line = next((ln for ln in out.splitlines() if "needs a GPU" in ln), None)
    assert line is not None, out[-3000:]
    assert line.startswith("train.device: ") and "(value: 'cuda')" in line and "amp.devices: auto" in line, line
    assert not (root / f"results/{gpu['dataset']}").exists() and not (root / f"logs/{gpu['dataset']}").exists()
