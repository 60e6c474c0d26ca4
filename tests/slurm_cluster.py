"""A real one-node SLURM for the tests marked ``slurm``: start it (tests/slurm/start_cluster.sh),
fit the copied profile to it, and find, cancel and account for one workflow folder's jobs.

The cluster is Debian's slurm-wlm run as root without systemd (see "A real SLURM on one
machine" in the notes): munged, MariaDB + slurmdbd (the executor plugin polls job states
with sacct), slurmctld and slurmd; this machine's cores and memory, two fake GPUs, a `cpu`
and a `gpu` partition on the same node.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

START = Path(__file__).resolve().parent / "slurm" / "start_cluster.sh"
# squeue states of a job that still holds or waits for resources
ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"}


class ClusterUnavailable(RuntimeError):
    """SLURM cannot be started here; the message says why in one line."""


@dataclass(frozen=True)
class SlurmCluster:
    node: str
    cpus: int
    mem_mb: int
    gpus: int
    cpu_partition: str
    gpu_partition: str


def start_cluster(timeout: float = 900) -> SlurmCluster:
    """Start (or find running) the test cluster; :class:`ClusterUnavailable` where it cannot be."""
    if os.geteuid() != 0:
        raise ClusterUnavailable("needs root to start slurmctld/slurmd/slurmdbd/munged/mariadbd")
    try:
        r = subprocess.run(["bash", str(START)], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ClusterUnavailable(f"{START.name} did not finish within {timeout:.0f} s") from None
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    if r.returncode != 0:
        raise ClusterUnavailable(lines[-1] if lines else f"{START.name} exited {r.returncode}")
    up = [ln for ln in lines if ln.startswith("slurm cluster up:")]
    if not up:
        raise ClusterUnavailable(f"{START.name} printed no 'slurm cluster up' line")
    kv = dict(item.split("=", 1) for item in up[-1].split(":", 1)[1].split())
    return SlurmCluster(
        node=kv["node"], cpus=int(kv["cpus"]), mem_mb=int(kv["mem_mb"]), gpus=int(kv["gpus"]),
        cpu_partition=kv["cpu_partition"], gpu_partition=kv["gpu_partition"],
    )  # fmt: skip


def fit_profile(workdir: Path, cluster: SlurmCluster) -> dict:
    """Edit ``workdir``'s copy of profiles/slurm-gpu for this cluster, as a site does
    (profiles/README.md, "What to edit"): its partition names, and no job asking for more
    memory or more cores per GPU than the one node has. Returns the profile."""
    path = workdir / "profiles" / "slurm-gpu" / "profile.yaml"
    prof = yaml.safe_load(path.read_text())
    prof["default-resources"]["slurm_partition"] = repr(cluster.cpu_partition)
    prof["default-resources"]["mem_mb"] = min(int(prof["default-resources"]["mem_mb"]), cluster.mem_mb)
    for res in prof.get("set-resources", {}).values():
        if "slurm_partition" in res:
            gpu = "gpu" in str(res["slurm_partition"])
            res["slurm_partition"] = repr(cluster.gpu_partition if gpu else cluster.cpu_partition)
        if "mem_mb" in res:
            res["mem_mb"] = min(int(res["mem_mb"]), cluster.mem_mb)
        if "cpus_per_gpu" in res:
            res["cpus_per_gpu"] = min(int(res["cpus_per_gpu"]), max(1, cluster.cpus // cluster.gpus))
    path.write_text(yaml.safe_dump(prof, sort_keys=False))
    return prof


def _same_dir(a: str, b: Path) -> bool:
    try:
        return Path(a).resolve() == b.resolve()
    except OSError:
        return False


def own_jobs(workdir: Path) -> list[dict]:
    """This user's queued or running jobs whose working directory is ``workdir``."""
    out = subprocess.run(["squeue", "--me", "-h", "-o", "%i|%T|%k|%Z"], capture_output=True, text=True, check=True, timeout=30).stdout
    jobs = []
    for line in out.splitlines():
        job, state, comment, wd = line.split("|", 3)
        if _same_dir(wd, workdir):
            jobs.append({"id": job, "state": state, "rule": rule_of(comment), "comment": comment})
    return jobs


def cancel_own_jobs(workdir: Path, timeout: float = 60) -> list[str]:
    """Cancel the jobs of the workflow run in ``workdir`` (selected by their working
    directory, ``squeue -o %Z``) and wait until SLURM has let them go: a re-run would
    otherwise submit duplicates of jobs that keep running after the head died."""
    ids = [j["id"] for j in own_jobs(workdir)]
    if not ids:
        return []
    subprocess.run(["scancel", *ids], check=True, capture_output=True, timeout=30)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = {j["id"] for j in own_jobs(workdir) if j["state"] in ACTIVE}
        if not left & set(ids):
            return ids
        time.sleep(0.5)
    raise AssertionError(f"jobs {sorted(set(ids))} still queued {timeout:.0f} s after scancel")


def rule_of(comment: str) -> str:
    """The rule of a job from the plugin's ``--comment rule_<name>[_wildcards_...]``."""
    return comment.removeprefix("rule_").split("_wildcards_")[0] if comment.startswith("rule_") else ""


def accounted_jobs(workdir: Path, since: str) -> list[dict]:
    """Every job (allocation lines, no steps) that slurmdbd recorded for ``workdir`` since
    ``since`` (``YYYY-MM-DDTHH:MM:SS``): id, state, rule, partition, nodes, allocated TRES."""
    fields = "JobIDRaw,State,Comment,Partition,NNodes,AllocTRES,WorkDir"
    out = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-S", since, f"--format={fields}"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout  # fmt: skip
    jobs = []
    for line in out.splitlines():
        job, state, comment, part, nnodes, tres, wd = line.split("|", 6)
        if _same_dir(wd, workdir):
            tres_map = dict(kv.split("=", 1) for kv in tres.split(",") if "=" in kv)
            jobs.append({"id": job, "state": state.split()[0], "rule": rule_of(comment), "comment": comment,
                         "partition": part, "nnodes": nnodes, "tres": tres_map})  # fmt: skip
    return jobs


def sacct_steps(job: str) -> list[dict]:
    """``sacct -j JOB --format=JobID,NTasks,NNodes``: the allocation and each of its steps."""
    out = subprocess.run(
        ["sacct", "-j", job, "-n", "-P", "--format=JobID,NTasks,NNodes,State"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout  # fmt: skip
    return [dict(zip(("id", "ntasks", "nnodes", "state"), ln.split("|"))) for ln in out.splitlines() if ln]


def scontrol_job(job: str) -> dict[str, str]:
    """``scontrol show job JOB`` as key=value pairs (kept MinJobAge after the job ended)."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, check=True, timeout=30).stdout
    return dict(item.split("=", 1) for item in out.split() if "=" in item)
