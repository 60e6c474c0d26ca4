"""Cluster profiles: the sbatch lines that profiles/slurm-gpu produces, without a cluster.

Stand-in SLURM commands (sbatch, sacct, sinfo, scontrol, sacctmgr, squeue, ...) on PATH
record their arguments; sbatch hands out job ids and sacct reports every job as
COMPLETED although nothing ran, so Snakemake misses the outputs and the run ends quickly
(non-zero) once the first jobs were submitted. (With FAILED the plugin would wait another
10 s before shutting down: only successes reset its polling interval.) Snakemake's Python
API does not read profiles, hence the subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PROFILES = REPO / "profiles"

# Recorded to <calls>/<name>.jsonl, one JSON list of arguments per call.
STANDIN = textwrap.dedent("""\
    #!{python}
    import fcntl, json, os, sys
    from pathlib import Path

    name = Path(sys.argv[0]).name
    args = sys.argv[1:]
    calls = Path({calls!r})
    with open(calls / (name + ".jsonl"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        fh.write(json.dumps(args) + "\\n")
    ids = calls / "job_ids"
    if name == "sbatch":
        # a job id, as `sbatch --parsable` prints it (the plugin submits from 2 threads)
        with open(calls / "counter.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            n = 1000 + (len(ids.read_text().split()) if ids.exists() else 0)
            with open(ids, "a") as fh:
                fh.write(f"{{n}}\\n")
        print(n)
    elif name == "sacct":
        # status query: `sacct -X --parsable2 ... --format=JobIdRaw,State --name RUN`;
        # account guess (`-o Account%256`) and failure reasons (`-j ID.STEP`): nothing
        if "--format=JobIdRaw,State" in args and ids.exists():
            state = os.environ.get("FAKE_SLURM_STATE", "COMPLETED")
            for job in ids.read_text().split():
                print(f"{{job}}|{{state}}")
    elif name == "sinfo":
        print("PARTITION\\ncpu*\\ngpu")
    elif name == "scontrol":
        if args[:2] == ["show", "config"]:
            print("MaxArraySize            = 1001\\nMinJobAge               = 300 sec")
    elif name in ("sacctmgr", "sshare"):
        print("my_account")
    # squeue, scancel: no output
    """)
COMMANDS = ("sbatch", "sacct", "sinfo", "scontrol", "sacctmgr", "squeue", "sshare", "scancel")


def fake_slurm(root: Path) -> tuple[Path, Path]:
    """Stand-in SLURM commands in root/bin, recording into root/calls."""
    bindir, calls = root / "bin", root / "calls"
    bindir.mkdir()
    calls.mkdir()
    script = STANDIN.format(python=sys.executable, calls=str(calls))
    for name in COMMANDS:
        exe = bindir / name
        exe.write_text(script)
        exe.chmod(0o755)
    return bindir, calls


def recorded(calls: Path, name: str) -> list[list[str]]:
    path = calls / f"{name}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def value(args: list[str], flag: str) -> str | None:
    """The value of ``flag`` in an argument list, as `-p X` or `--flag=X`."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def sbatch_by_rule(calls: Path) -> dict[str, list[str]]:
    """sbatch arguments keyed by rule name (from `--comment rule_<name>[_wildcards_...]`)."""
    out = {}
    for args in recorded(calls, "sbatch"):
        comment = value(args, "--comment") or ""
        assert comment.startswith("rule_"), args
        rule = comment[len("rule_") :].split("_wildcards_")[0]
        out.setdefault(rule, args)
    return out


def flags(args: list[str]) -> list[str]:
    """The sbatch options before the wrapped command, without their values."""
    return [a.split("=", 1)[0] for a in args if a.startswith("-") and not a.startswith("--wrap")]


def unquote(res: object) -> str:
    """A profile's text resource ("'gpu'") as the plugin passes it on (gpu)."""
    return str(res).strip("'\"")


def clean_env(path: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    for k in ("SNAKEMAKE_PROFILE", "SNAKEMAKE_SLURM_PARTITIONS"):
        env.pop(k, None)
    env["PATH"] = path
    return env


# ----------------------------------------------------------------- fast checks


def test_no_default_profile():
    """profiles/default would be merged into every run (also --profile slurm-gpu)."""
    assert not (PROFILES / "default").exists()
    assert (PROFILES / "local" / "profile.yaml").is_file()


def test_slurm_profile_static():
    prof = yaml.safe_load((PROFILES / "slurm-gpu" / "profile.yaml").read_text())
    assert prof["executor"] == "slurm"
    assert prof["rerun-incomplete"] is True
    assert "cores" not in prof  # would cap the threads of SLURM jobs
    assert prof["default-resources"]["slurm_partition"]
    for rule, res in prof["set-resources"].items():
        # GPU rules: `tasks` would become --ntasks-per-gpu; the GPU partition is named
        # once, in the config (cluster.gpu_partition), and the train job's allocation
        # is its plan's
        assert "tasks" not in res and "slurm_partition" not in res, rule
        assert rule != "train", res


# ------------------------------------------------------ submission with stand-ins


@pytest.mark.slow
def test_slurm_gpu_sbatch_lines(tmp_path):
    work = tmp_path / "wf"
    work.mkdir()
    for name in ("workflow", "config", "profiles", "envs"):
        if (REPO / name).exists():
            shutil.copytree(REPO / name, work / name)
    # pin what the sbatch lines depend on: 2 threads for bin_block; what a GPU node
    # offers (a small one: 2 GPUs, 1 core and 1,500 MB each); amp.devices is 2
    cfg_path = work / "config" / "demo.yaml"
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["threads"] = 2
    cfg["cluster"] = {"gpu_partition": "gpu-small", "gpus_per_node": 2, "cpus_per_gpu": 1, "mem_mb_per_gpu": 1500}
    cfg["train"]["device"] = "auto"  # the demo trains on CPU on purpose; a GPU site's config does not
    assert cfg["amp"]["devices"] == 2
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    prof = yaml.safe_load((work / "profiles" / "slurm-gpu" / "profile.yaml").read_text())
    gpu_res = prof["set-resources"].get("devices", {})
    cpu_part = unquote(prof["default-resources"]["slurm_partition"])
    gpu_part = "gpu-small"
    assert cpu_part != gpu_part
    bindir, calls = fake_slurm(tmp_path)
    path = os.pathsep.join([str(bindir), str(BIN), os.environ.get("PATH", "")])
    env = {**clean_env(path), "FAKE_SLURM_STATE": "COMPLETED"}

    subprocess.run(
        [str(BIN / "ampflow"), "demo-data", "resources/demo", "--cells", "8", "--seed", "0"],
        cwd=work, env=env, check=True, capture_output=True, text=True, timeout=120,
    )  # fmt: skip

    cmd = [
        str(BIN / "snakemake"),
        "--profile", "profiles/slurm-gpu",
        "--configfile", "config/demo.yaml",
        # fast polling and no retry for the test; everything else from the profile
        "--latency-wait", "1",
        "--retries", "0",
        "--seconds-between-status-checks", "1",
        "--slurm-init-seconds-before-status-checks", "1",
    ]  # fmt: skip
    try:
        r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=90)
        log = r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        log = f"(timed out)\n{e.stdout or ''}{e.stderr or ''}"

    by_rule = sbatch_by_rule(calls)
    assert {"bin_block", "load_rna", "devices"} <= set(by_rule), log[-4000:]

    # CPU rules: CPU partition, memory, runtime, cpus per task (= threads), no GPUs
    for rule, cpus in (("bin_block", 2), ("load_rna", 1)):
        args = by_rule[rule]
        assert value(args, "-p") == cpu_part, (rule, args)
        assert int(value(args, "--mem") or 0) > 0, (rule, args)
        assert int(value(args, "-t") or 0) > 0, (rule, args)
        assert value(args, "--cpus-per-task") == str(cpus), (rule, args)
        assert value(args, "--ntasks") == "1", (rule, args)
        assert "--parsable" in args
        assert not {"--gpus", "--gres", "--ntasks-per-gpu", "--cpus-per-gpu"} & set(flags(args)), args

    # GPU rule: --gpus=N, one node's share of amp.devices (or --gpus=MODEL:N with
    # gpu_model), the config's GPU partition, CPUs and memory per GPU, and no
    # --ntasks-per-gpu (plugin issue #316)
    args = by_rule["devices"]
    assert value(args, "-p") == gpu_part, args
    model = gpu_res.get("gpu_model")
    assert value(args, "--gpus") == (f"{unquote(model)}:2" if model else "2"), args
    assert value(args, "--cpus-per-gpu") == "1", args
    assert value(args, "--mem") == str(gpu_res.get("mem_mb", 3000)), args
    assert int(value(args, "-t") or 0) > 0, args
    for flag in ("--ntasks-per-gpu", "--ntasks", "--cpus-per-task", "--gres"):
        assert flag not in flags(args), (flag, args)

    # without slurm_account and nothing guessed from sacct: no -A
    for args in by_rule.values():
        assert "-A" not in args
        assert Path(value(args, "-D")).resolve() == work.resolve()
    # the jobs lack their outputs, so nothing beyond the three independent rules was submitted
    assert set(by_rule) == {"bin_block", "load_rna", "devices"}, sorted(by_rule)


# ------------------------------------------------------------ the train job's allocation
def _fake_train_inputs(work: Path, cfg: str, dp: int, tp: int) -> None:
    """Files standing in for the train rule's inputs (only train may run), oldest first
    as the workflow would write them (the split feeds the data files); the plan is a GPU
    plan (no ``cpu`` section) of dp x tp processes."""
    split = work / "results" / "demo" / "qc" / "split.tsv"
    split.parent.mkdir(parents=True)
    split.write_text("cell_id\tsplit\n")
    data = work / "results" / "demo" / "data" / cfg
    (data / "graph").mkdir(parents=True)
    for name in ("rna.h5ad", "hic.h5ad", "graph/nodes.parquet"):
        (data / name).write_text("stand-in")
    plan = work / "results" / "demo" / "amp" / cfg / "plan.json"
    plan.parent.mkdir(parents=True)
    plan.write_text(json.dumps({"mesh": {"dp": dp, "tp": tp}, "world_size": dp * tp}))


def _submit_train(tmp_path: Path, cluster: dict, dp: int, tp: int) -> tuple[list[str] | None, str, str]:
    """Submit the train job of a stand-in plan to stand-in SLURM commands: its sbatch
    arguments, its shell command (dry run) and Snakemake's log."""
    work = tmp_path / "wf"
    work.mkdir()
    for name in ("workflow", "config", "profiles", "envs"):
        shutil.copytree(REPO / name, work / name)
    cfg_path = work / "config" / "demo.yaml"
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["cluster"] = cluster
    cfg["train"]["device"] = "auto"  # the demo trains on CPU on purpose; a GPU site's config does not
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    name = "500kb_s10"  # the first configuration of config/demo.yaml
    _fake_train_inputs(work, name, dp, tp)
    bindir, calls = fake_slurm(tmp_path)
    env = {**clean_env(os.pathsep.join([str(bindir), str(BIN), os.environ.get("PATH", "")])), "FAKE_SLURM_STATE": "COMPLETED"}
    subprocess.run([str(BIN / "ampflow"), "demo-data", "resources/demo", "--cells", "8", "--seed", "0"],
                   cwd=work, env=env, check=True, capture_output=True, text=True, timeout=120)  # fmt: skip
    target = f"results/demo/train/{name}/model.pt"
    base = [str(BIN / "snakemake"), target, "--profile", "profiles/slurm-gpu", "--configfile", "config/demo.yaml",
            "--allowed-rules", "train", "--rerun-triggers", "mtime"]  # fmt: skip
    dry = subprocess.run([*base, "-n", "-p"], cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0, dry.stderr[-3000:]
    shell = [ln.strip().removeprefix("Shell command:").strip() for ln in (dry.stdout + dry.stderr).splitlines() if "ampflow train" in ln]
    cmd = [*base, "--latency-wait", "1", "--retries", "0", "--seconds-between-status-checks", "1",
           "--slurm-init-seconds-before-status-checks", "1"]  # fmt: skip
    try:
        r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=90)
        log = r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        log = f"(timed out)\n{e.stdout or ''}{e.stderr or ''}"
    return sbatch_by_rule(calls).get("train"), shell[0] if shell else "", log


@pytest.mark.slow
def test_train_job_on_one_node_asks_for_the_plans_gpus(tmp_path):
    """A plan of dp 2 x tp 1 on nodes of 2 GPUs: --gpus=2 on the GPU partition, with the
    CPUs and memory that come with 2 GPUs; the plugin runs the command under its own
    `srun -n1`, so the rule's command is the launcher alone."""
    cluster = {"gpu_partition": "gpu-small", "gpus_per_node": 2, "cpus_per_gpu": 1, "mem_mb_per_gpu": 1500}
    args, shell, log = _submit_train(tmp_path, cluster, 2, 1)
    assert args is not None, log[-4000:]
    assert shell.startswith("ampflow train --launch "), shell
    assert value(args, "-p") == "gpu-small", args
    assert value(args, "--gpus") == "2", args
    assert value(args, "--cpus-per-gpu") == "1", args
    assert value(args, "--mem") == "3000", args
    assert value(args, "--nodes") == "1", args
    for flag in ("--ntasks-per-gpu", "--ntasks", "--cpus-per-task", "--gres", "--gpus-per-node"):
        assert flag not in flags(args), (flag, args)


@pytest.mark.slow
def test_train_job_across_nodes_asks_for_the_plans_gpus(tmp_path):
    """A plan of dp 2 x tp 4 on nodes of 4 GPUs: 2 nodes, one task each, 4 GPUs per node,
    the CPUs and memory of 4 GPUs per node; no `gpu` resource (which would turn tasks
    into --ntasks-per-gpu)."""
    cluster = {"gpu_partition": "gpu", "gpus_per_node": 4, "cpus_per_gpu": 2, "mem_mb_per_gpu": 4000}
    args, shell, log = _submit_train(tmp_path, cluster, 2, 4)
    assert args is not None, log[-4000:]
    assert shell.startswith("ampflow train --launch "), shell
    assert value(args, "-p") == "gpu", args
    assert value(args, "--nodes") == "2" and value(args, "--ntasks") == "2", args
    assert value(args, "--cpus-per-task") == "8", args
    assert value(args, "--mem") == "16000", args
    assert "--gpus-per-node=4" in args and "--ntasks-per-node=1" in args, args
    for flag in ("--gpus", "--ntasks-per-gpu", "--gres", "--cpus-per-gpu"):
        assert flag not in flags(args), (flag, args)


def test_train_gpus_in_a_config_is_refused(tmp_path):
    """train.gpus would be a second, disagreeing figure beside the plan: one line naming it."""
    work = tmp_path / "wf"
    work.mkdir()
    for name in ("workflow", "config"):
        shutil.copytree(REPO / name, work / name)
    cfg = yaml.safe_load((work / "config" / "demo.yaml").read_text())
    cfg["train"]["gpus"] = 1
    (work / "config" / "my.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    r = subprocess.run([str(BIN / "snakemake"), "-n", "--cores", "1", "--configfile", "config/my.yaml"], cwd=work,
                       env=clean_env(os.pathsep.join([str(BIN), os.environ.get("PATH", "")])), capture_output=True, text=True, timeout=120)  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert "train.gpus" in out and "cluster.gpus_per_node" in out, out[-2000:]
