"""Launching a training run: torchrun for the plan's world (across the nodes of a SLURM
job: the job's own srun, one torchrun per node), the device checks, joining the process
group, and the run itself.

``ampflow train --launch`` in one process starts ``torchrun`` with the plan's dp x tp
processes (:func:`torchrun_command`), each of which runs :func:`run_training` again under
torchrun's environment; without ``--launch``, or already under torchrun, this process
trains. The command line stays argument parsing only; the process groups are set up here.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass

import torch.distributed as dist

from ..base.errors import InputError
from ..contract.config import ModelConfig, TrainConfig
from ..contract.plan import Plan
from ..parallel.mesh import init_distributed, launched_world
from .device import local_device_count, run_device, uses_cuda

log = logging.getLogger(__name__)

RDZV_PORT = 29500


@dataclass(frozen=True)
class SlurmJob:
    """The allocation of a SLURM job as ``scontrol show job`` reports it: its nodes (the
    first one hosts the rendezvous), tasks and GPUs per node (None: not known)."""

    job_id: str
    hosts: tuple[str, ...]
    tasks: int
    gpus_per_node: int | None = None

    @property
    def nodes(self) -> int:
        return len(self.hosts)


def _scontrol(args: list[str]) -> str:
    try:
        res = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60, check=False)
    except FileNotFoundError:
        raise InputError(
            "scontrol not found on PATH, so the job's allocation cannot be read", key="SLURM_JOB_ID", value=os.environ.get("SLURM_JOB_ID")
        ) from None
    if res.returncode != 0:
        raise InputError(f"scontrol {' '.join(args)} failed: {(res.stderr or res.stdout).strip()}", key="SLURM_JOB_ID", value=args[-1])
    return res.stdout


def _gres_gpus(text: str) -> int | None:
    """GPUs in a TRES/GRES string (``gres:gpu:4``, ``gres/gpu=4``, ``gpu:a100:4``)."""
    m = re.search(r"gpu(?::[\w.-]+)?[:=](\d+)", text or "")
    return int(m.group(1)) if m else None


def parse_scontrol_job(text: str) -> dict:
    """``Key=Value`` fields of ``scontrol show job -o`` (one line; values without spaces
    are read whole; the first of a key wins, so a ``Command=`` or ``Comment=`` holding
    ``NumNodes=...`` after the real field cannot replace it)."""
    fields: dict[str, str] = {}
    for key, value in re.findall(r"(?:^|\s)([A-Za-z][\w/:]*)=(\S*)", text.strip()):
        fields.setdefault(key, value)
    return fields


def slurm_job(job_id: str) -> SlurmJob:
    """The allocation of job ``job_id``, from ``scontrol`` (the executor plugin hands a
    rule's command only SLURM_JOB_ID, no SLURM_NODELIST or SLURM_NTASKS)."""
    fields = parse_scontrol_job(_scontrol(["show", "job", "-o", str(job_id)]))
    nodelist = fields.get("NodeList", "")
    if not nodelist or nodelist == "(null)":
        raise InputError("the job has no nodes yet (scontrol show job -o reports NodeList=(null))", key="SLURM_JOB_ID", value=job_id)
    hosts = tuple(_scontrol(["show", "hostnames", nodelist]).split())
    num = re.match(r"\d+", fields.get("NumNodes", ""))
    if num and int(num.group()) != len(hosts):
        raise InputError(f"scontrol reports NumNodes={fields['NumNodes']} but NodeList {nodelist} names {len(hosts)} host(s)", key="SLURM_JOB_ID", value=job_id)
    tasks = re.match(r"\d+", fields.get("NumTasks", ""))
    gpus = _gres_gpus(fields.get("TresPerNode", ""))
    return SlurmJob(str(job_id), hosts, int(tasks.group()) if tasks else len(hosts), gpus)


def check_fits(processes: int, cuda: bool, what: str = "this node") -> None:
    """Refuse ``processes`` processes on ``what`` when it has fewer devices: one process
    per GPU (two NCCL ranks never share a GPU), or per CPU core. On CUDA the message
    names both ways out: plan for the GPUs there are, or train on CPU cores."""
    have = local_device_count(cuda)
    if processes <= have:
        return
    kind = "GPU" if cuda else "CPU core"
    seen = f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!s}" if cuda else "its CPU affinity"
    fixes = f"give the job {processes} {kind}s, or plan for {have} (amp.devices: {have})"
    if cuda:
        fixes += f", or train the {processes} processes on CPU cores (train.device: cpu)"
    raise InputError(f"the plan's {processes} process(es) on {what} need {processes} {kind}s, {have} visible ({seen}); {fixes}",
                     key="mesh", value=processes)  # fmt: skip


def check_rank_device(env=None) -> None:
    """Under torchrun on CUDA: this rank's LOCAL_RANK names a GPU of its own."""
    env = os.environ if env is None else env
    local_world = int(env.get("LOCAL_WORLD_SIZE") or 1)
    if local_world > 1:
        check_fits(local_world, True, f"node {socket.gethostname()}")


def torchrun_command(n: int, argv: list[str], env=None, job: SlurmJob | None = None) -> list[str]:
    """The command that runs ``ampflow <argv>`` in one world of ``n`` processes.

    One node (no SLURM job, or a job of one node however many tasks it has): one
    ``torchrun --standalone``. A SLURM job of N nodes (``job``): an ``srun`` of one task on
    each node, each starting ``torchrun`` with ``n / N`` processes; the nodes meet through
    a c10d rendezvous on the job's first node, keyed by the job id (port 29500, or
    AMPFLOW_RDZV_PORT).
    """
    env = os.environ if env is None else env
    run = [sys.executable, "-m", "torch.distributed.run"]
    tail = ["-m", "ampflow.cli", *argv]
    if job is None or job.nodes <= 1:
        return [*run, "--standalone", f"--nproc-per-node={n}", *tail]
    if n % job.nodes:
        raise InputError(f"the plan's {n} processes do not divide over the job's {job.nodes} nodes ({','.join(job.hosts)})", key="mesh", value=n)
    port = int(env.get("AMPFLOW_RDZV_PORT") or RDZV_PORT)
    srun = ["srun", f"--jobid={job.job_id}", f"--nodes={job.nodes}", f"--ntasks={job.nodes}", "--ntasks-per-node=1",
            "--overlap", "--kill-on-bad-exit=1"]  # fmt: skip
    return [*srun, *run, f"--nnodes={job.nodes}", f"--nproc-per-node={n // job.nodes}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={job.hosts[0]}:{port}", f"--rdzv-id={job.job_id}", *tail]  # fmt: skip


def launch_command(n: int, argv: list[str], device: str = "auto", env=None) -> list[str]:
    """Check the allocation, then :func:`torchrun_command` for it.

    Refused (an InputError, before any process starts): a launcher started as one of
    several tasks of an srun step (each would start a world of its own); a world that
    does not divide over the job's nodes; more processes on a node than it has GPUs
    (CPU cores on CPU), so that two NCCL ranks never share a GPU.
    """
    env = os.environ if env is None else env
    step_tasks = int(env.get("SLURM_STEP_NUM_TASKS") or 1)
    if step_tasks > 1:
        raise InputError(
            f"ampflow train --launch runs once per job and starts the plan's processes itself; it was started as one of "
            f"{step_tasks} tasks of an srun step", key="SLURM_STEP_NUM_TASKS", value=step_tasks,
        )  # fmt: skip
    job = slurm_job(env["SLURM_JOB_ID"]) if env.get("SLURM_JOB_ID") else None
    cuda = uses_cuda(device)
    if job is not None and job.nodes > 1:
        if n % job.nodes:
            raise InputError(f"the plan's {n} processes do not divide over the job's {job.nodes} nodes ({','.join(job.hosts)})", key="mesh", value=n)
        per_node = n // job.nodes
        if cuda and job.gpus_per_node is not None and per_node > job.gpus_per_node:
            raise InputError(
                f"the plan's {n} processes over {job.nodes} nodes need {per_node} GPUs per node; the job has "
                f"{job.gpus_per_node}", key="mesh", value=n,
            )  # fmt: skip
        # the other nodes' ranks check their own GPUs (check_rank_device)
        check_fits(per_node, cuda, f"node {socket.gethostname()}")
    else:
        check_fits(n, cuda)
    return torchrun_command(n, argv, env, job)


def launch(n: int, argv: list[str], device: str = "auto") -> int:
    """Run ``ampflow <argv>`` in a world of ``n`` processes; its exit status."""
    cmd = launch_command(n, argv, device)
    log.info("launching %d processes: %s", n, " ".join(cmd))
    res = subprocess.run(cmd, check=False)
    if res.returncode != 0:
        log.error(
            "torchrun exited with status %d (a rank failed or was killed); running the same command again resumes from the last checkpoint", res.returncode
        )
    return res.returncode


def run_training(data_dir, out_dir, model_cfg: ModelConfig, train_cfg: TrainConfig, plan: Plan | None = None,
                 name: str = "", relaunch_argv: list[str] | None = None, split=None) -> int:  # fmt: skip
    """Train one configuration; an exit status.

    The device is the plan's when it records one, else ``train.device``'s
    (:func:`~ampflow.train.device.run_device`).

    With ``relaunch_argv`` (``ampflow train --launch``), a plan of more than one process
    and no torchrun around this process, the plan's world is started under torchrun
    running ``ampflow <relaunch_argv>``; otherwise this process joins torchrun's group (if
    any) and trains, rank 0 speaking for the group. ``split`` (``qc/split.tsv``) is
    checked against the split the data files were built with (see
    :func:`~ampflow.train.data.load_paired`).
    """
    from .data import load_paired
    from .trainer import Trainer

    # the plan's device (train.device without one); a plan for cuda without a GPU is
    # refused here, before torchrun starts anything
    device, _ = run_device(train_cfg, plan)
    if relaunch_argv is not None and launched_world() == 1 and plan is not None and plan.world > 1:
        return launch(plan.world, relaunch_argv, device)
    if launched_world() > 1 and device == "cuda":
        check_rank_device()
    if plan is not None:
        log.info("%s", plan.summary())
    world = init_distributed(device)
    try:
        if world > 1 and dist.get_rank() > 0:
            logging.getLogger().setLevel(logging.WARNING)
        data = load_paired(data_dir, split=split)
        log.info(
            "training %s: %d cells (%d held out), %d genes, %d Hi-C features in %d strata",
            name or out_dir, data.n_cells, data.n_cells - len(data.train_rows), data.rna.shape[1], data.hic.shape[1], data.n_strata,
        )  # fmt: skip
        Trainer(data, model_cfg, train_cfg, out_dir, name=name, plan=plan).fit()
    finally:
        if world > 1:
            dist.destroy_process_group()
    return 0
