"""Sharded training of the demo's heavy configuration: step time and per-rank peak memory
at world 1, 2 (and 4), as ratios to world 1 measured in the same run, and the per-rank
work imbalance of data parallelism with and without contact balancing.

    python scripts/bench_parallel.py                 # builds the demo data in a temp folder
    python scripts/bench_parallel.py --workdir DIR   # reuse/keep a prepared workflow folder
    python scripts/bench_parallel.py --worlds 1 2 4  # world 4 oversubscribes a 2-core machine

World 1 trains the plan's single-process savers (S3, S4); world 2 the heavy plan's
dp x tp mesh (tp >= 2: S1-S5); world 4 dp 2 x tp 2 with all five. Peaks are each rank's
saved-activation bytes plus parameters and optimizer state on CPU
(``torch.cuda.max_memory_allocated`` on GPUs). With a GPU, a one-process NCCL smoke run
is added.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml

from ampflow.contract.plan import MeshShape, Plan
from ampflow.contract.strategies import CHUNKED_ATTENTION, KEY_FIRST_DECODE

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CFG = "250kb_s12"


def prepare(work: Path) -> tuple[Path, dict]:
    """The heavy configuration's data folder and plan (Snakemake up to diagnose)."""
    plan = work / f"results/demo/amp/{CFG}/plan.json"
    if not plan.exists():
        for name in ("workflow", "config", "profiles", "envs"):
            if not (work / name).exists():
                shutil.copytree(REPO / name, work / name)
        env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
        print("preparing the demo's heavy configuration (Snakemake up to its plan) ...", flush=True)
        for cmd in (
            [str(BIN / "ampflow"), "demo-data", "resources/demo", "--cells", "120", "--seed", "0"],
            [str(BIN / "snakemake"), "--profile", "profiles/local", "--configfile", "config/demo.yaml", "--cores", "2", str(plan.relative_to(work))],
        ):
            res = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
            if res.returncode:
                sys.exit(f"{' '.join(cmd[:2])} failed:\n{res.stderr[-3000:]}")
    return work / f"results/demo/data/{CFG}", Plan.read(plan)


def mesh_plan(plan: Plan, dp: int, tp: int) -> Plan:
    """The heavy plan on another mesh (world 1: its single-process savers only)."""
    single = (CHUNKED_ATTENTION, KEY_FIRST_DECODE)
    strategies = tuple(s for s in plan.strategies if dp * tp > 1 or s.name in single)
    return dataclasses.replace(plan, mesh=MeshShape(dp, tp), strategies=strategies)


def pretrain_epochs(data: Path, batch_size: int, steps: int) -> int:
    """Epochs of pretraining that give at least ``steps`` steps (every training cell
    trains: the demo's early stopping is off)."""
    from ampflow.train.data import load_paired
    from ampflow.train.trainer import epoch_batches

    per_epoch = len(epoch_batches(len(load_paired(data).train_rows), batch_size, 0, 0, 0))
    return -(-steps // per_epoch)


def train(work: Path, data: Path, plan: Plan, steps: int, tag: str, device: str = "cpu") -> list[dict]:
    """The first ``steps`` metrics rows of a run of the demo's training settings that
    pretrains just long enough (no finetuning; the demo holds no validation cells out)."""
    cfg = yaml.safe_load((REPO / "config/demo.yaml").read_text())
    out = work / "bench" / tag
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    plan.write(out / "plan.json")
    t = cfg["train"]
    epochs = pretrain_epochs(data, t["batch_size"], steps)
    train_cfg = {**t, "threads": 1, "device": device, "checkpoint_every": 10_000, "pretrain": {**t["pretrain"], "epochs": epochs},
                 "finetune": {**t["finetune"], "epochs": 0}}  # fmt: skip
    cmd = [str(BIN / "ampflow"), "train", "--launch", "--data", str(data), "--out", str(out / "run"),
           "--model", json.dumps(cfg["model"]), "--train", json.dumps(train_cfg), "--plan", str(out / "plan.json")]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return [json.loads(x) for x in (out / "run/metrics.jsonl").read_text().splitlines()][:steps]


def work_imbalance(data: Path, batch_size: int, seed: int, dps=(2, 4)) -> dict[int, tuple[float, float]]:
    """Mean over one epoch's batches of max/mean contacts per rank: contiguous rows vs balanced."""
    import torch

    from ampflow.parallel.data_parallel import balanced_split, contiguous_split, work_ratio
    from ampflow.train.data import load_paired
    from ampflow.train.trainer import epoch_batches

    paired = load_paired(data)
    contacts = np.asarray(paired.hic.sum(axis=1), dtype=np.float64).ravel()
    out = {}
    for dp in dps:
        plain, balanced = [], []
        for idx in epoch_batches(paired.n_cells, batch_size, seed, 0, 0):
            c = torch.as_tensor(contacts[idx])
            plain.append(work_ratio(c, contiguous_split(len(idx), dp)))
            balanced.append(work_ratio(c, balanced_split(c, dp)))
        out[dp] = (statistics.mean(plain), statistics.mean(balanced))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, help="prepared workflow folder to reuse (default: a temp folder)")
    ap.add_argument("--worlds", type=int, nargs="+", choices=(1, 2, 4), default=[1, 2] + ([4] if (os.cpu_count() or 1) >= 4 else []))
    ap.add_argument("--steps", type=int, default=12, help="steps per run; the first 2 are not timed")
    a = ap.parse_args()
    tmp = None if a.workdir else tempfile.mkdtemp(prefix="bench-parallel-")
    work = a.workdir or Path(tmp)
    work.mkdir(parents=True, exist_ok=True)
    try:
        data, plan = prepare(work)
        print(f"heavy configuration {CFG}: plan {[s.id for s in plan.strategies]}, mesh dp {plan.mesh.dp} x tp {plan.mesh.tp}, chunk {plan.chunk_size}")
        meshes = {1: (1, 1), 2: (plan.mesh.dp, plan.mesh.tp) if plan.world == 2 else (1, 2), 4: (2, 2)}
        rows = {}
        for world in sorted(set(a.worlds) | {1}):
            dp, tp = meshes[world]
            metrics = train(work, data, mesh_plan(plan, dp, tp), a.steps, f"world{world}")
            timed = metrics[2:] or metrics
            step_s = statistics.median(r["seconds"] for r in timed)
            measured = [r for r in metrics if "peak_bytes" in r]  # the trainer measures its first steps
            peaks = [max(r.get("rank_peak_bytes", [r["peak_bytes"]])[i] for r in measured) for i in range(dp * tp)]
            rows[world] = (dp, tp, step_s, peaks)
        s1, p1 = rows[1][2], max(rows[1][3])
        print(f"\n{'world':>5} {'dp x tp':>8} {'step s':>8} {'x world 1':>9} {'peak MiB per rank':>24} {'x world 1':>9}")
        for world, (dp, tp, step_s, peaks) in rows.items():
            mib = ", ".join(f"{p / 2**20:.1f}" for p in peaks)
            print(f"{world:>5} {f'{dp} x {tp}':>8} {step_s:>8.3f} {step_s / s1:>9.2f} {mib:>24} {max(peaks) / p1:>9.2f}")
        cfg = yaml.safe_load((REPO / "config/demo.yaml").read_text())["train"]
        print("\nper-rank work (max/mean Hi-C contacts per rank, mean over one epoch's batches):")
        for dp, (plain, balanced) in work_imbalance(data, cfg["batch_size"], cfg.get("seed", 0)).items():
            print(f"  dp {dp}: contiguous rows {plain:.3f}, contact-balanced {balanced:.3f}  (imbalance {plain - 1:.1%} -> {balanced - 1:.2%})")
        try:
            import torch

            cuda = torch.cuda.is_available()
        except ImportError:
            cuda = False
        if cuda:
            gpu = train(work, data, mesh_plan(plan, 1, 1), a.steps, "gpu", device="cuda")
            print(
                f"\nGPU, one process: median step {statistics.median(r['seconds'] for r in gpu[2:]):.4f} s,"
                f" peak {max(r['peak_bytes'] for r in gpu if 'peak_bytes' in r) / 2**20:.1f} MiB"
            )
        else:
            print("\nno CUDA device: the NCCL smoke run and the largest-fitting-configuration figures are skipped")
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
