"""The demo's claim over training seeds and torch builds: one row per (torch, seed,
configuration), the held-out ARI of the joint embedding, the RNA latent and the Hi-C
latent, and whether joint >= each modality + 0.05 (the bar of `make demo`'s test).

The demo's data and its held-out split are fixed (``ampflow demo-data --seed 0``,
``evaluate.seed``); only ``train.seed`` changes. Each (python, seed) runs the workflow up to
the evaluation in a folder of its own, with the ``ampflow`` of that python's environment,
so one run compares torch builds installed in separate virtual environments::

    python scripts/demo_seed_table.py --python .venv/bin/python /path/to/other/venv/bin/python

About ten demo-length runs (minutes each on 2 cores): not part of `make test`, whose
README test keeps seed 0. Exit 1 when a row misses the bar.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
CONFIGS = ("500kb_s10", "250kb_s12")
MARGIN = 0.05
METHODS = ("joint", "rna_latent", "hic_latent")


def torch_version(python: Path) -> str:
    out = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def prepare_copy(dest: Path, data: Path, seed: int) -> Path:
    """A copy of what Snakemake needs, the shared demo data linked in, the demo config
    with ``train.seed`` = ``seed``."""
    for name in ("workflow", "config", "profiles", "envs"):
        shutil.copytree(REPO / name, dest / name, dirs_exist_ok=True)
    (dest / "resources").mkdir(exist_ok=True)
    link = dest / "resources" / "demo"
    if not link.exists():
        link.symlink_to(data.resolve())
    cfg = yaml.safe_load((REPO / "config" / "demo.yaml").read_text())
    cfg["train"]["seed"] = seed
    path = dest / "config" / f"demo_seed{seed}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def run_one(python: Path, dest: Path, config: Path, cores: int, log) -> float:
    bin_dir = python.parent
    targets = [f"results/demo/eval/{c}/scores.json" for c in CONFIGS]
    t0 = time.monotonic()
    proc = subprocess.run(
        [str(bin_dir / "snakemake"), *targets, "--cores", str(cores), "--profile", "profiles/local", "--configfile", str(config)],
        cwd=dest, env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"},
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"{dest}: snakemake exited {proc.returncode}; see {log.name}")
    return time.monotonic() - t0


def held_out_ari(dest: Path, cfg: str) -> dict[str, float]:
    held = json.loads((dest / f"results/demo/eval/{cfg}/scores.json").read_text())["groups"]["heldout"]
    return {m: held["methods"][m]["ari"] for m in METHODS}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--python", nargs="+", type=Path, default=[Path(sys.executable)], help="interpreters of environments with ampflow installed (one per torch build)"
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--work", type=Path, default=Path("/tmp/ampflow-demo-seeds"))
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    a = ap.parse_args(argv)
    # absolute, not resolved: a venv's python is a link out of the venv
    a.python = [p if p.is_absolute() else Path.cwd() / p for p in a.python]

    a.work.mkdir(parents=True, exist_ok=True)
    data = a.work / "data"
    if not (data / "cells.tsv").exists():
        subprocess.run([str(a.python[0].parent / "ampflow"), "demo-data", str(data), "--cells", "200", "--seed", "0"], check=True)
    rows, total = [], len(a.python) * len(a.seeds)
    t_start = time.monotonic()
    print(f"{'torch':<16} {'seed':>4} {'config':<10} {'joint':>6} {'rna':>6} {'hic':>6} {'margin':>7}  pass", flush=True)
    for python in a.python:
        version = torch_version(python)
        for seed in a.seeds:
            dest = a.work / f"torch{version}" / f"seed{seed}"
            dest.mkdir(parents=True, exist_ok=True)
            config = prepare_copy(dest, data, seed)
            with open(dest / "run.log", "w") as log:
                seconds = run_one(python, dest, config, a.cores, log)
            for cfg in CONFIGS:
                ari = held_out_ari(dest, cfg)
                margin = ari["joint"] - max(ari["rna_latent"], ari["hic_latent"])
                row = {"torch": version, "seed": seed, "config": cfg, **ari, "margin": margin, "pass": margin >= MARGIN, "seconds": seconds}
                rows.append(row)
                print(
                    f"{version:<16} {seed:>4} {cfg:<10} {ari['joint']:>6.3f} {ari['rna_latent']:>6.3f} {ari['hic_latent']:>6.3f} "
                    f"{margin:>+7.3f}  {'yes' if row['pass'] else 'NO'}",
                    flush=True,
                )
            done = len(rows) // len(CONFIGS)
            rate = (time.monotonic() - t_start) / done
            print(f"# {done}/{total} runs, {seconds:.0f} s this one, ETA {rate * (total - done) / 60:.1f} min", file=sys.stderr, flush=True)
    n_pass = sum(r["pass"] for r in rows)
    print(f"{n_pass}/{len(rows)} rows with joint >= each modality + {MARGIN}")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if n_pass == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
