"""Launching a training run: torchrun for the plan's world, the SLURM rendezvous across
nodes, joining the process group, and the run itself.

``ampflow train --launch`` in one process starts ``torchrun`` with the plan's dp x tp
processes (:func:`torchrun_command`), each of which runs :func:`run_training` again under
torchrun's environment; without ``--launch``, or already under torchrun, this process
trains. The command line stays argument parsing only; the process groups are set up here.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import torch.distributed as dist

from ..io.errors import InputError
from ..parallel.mesh import init_distributed, launched_world
from ..spec.config import ModelConfig, TrainConfig
from ..spec.plan import Plan

log = logging.getLogger(__name__)

RDZV_PORT = 29500


def torchrun_command(n: int, argv: list[str], env=os.environ) -> list[str]:
    """The torchrun command that runs ``ampflow <argv>`` in a world of ``n`` processes.

    One node: ``--standalone``. Inside a SLURM job step that srun started with one task
    on each of several nodes (the train rule under ``mpi: srun``, ``nodes = tasks = N``):
    this task's node runs ``n / N`` processes and the nodes meet through a c10d
    rendezvous on the allocation's first node, keyed by the job id.
    """
    head = [sys.executable, "-m", "torch.distributed.run"]
    nodes = int(env.get("SLURM_STEP_NUM_NODES") or 1)
    if nodes <= 1:
        return [*head, "--standalone", f"--nproc-per-node={n}", "-m", "ampflow.cli", *argv]
    tasks = int(env.get("SLURM_STEP_NUM_TASKS") or 0)
    if tasks != nodes:
        raise InputError(f"multi-node training needs one task per node (srun with tasks = nodes = {nodes})", key="SLURM_STEP_NUM_TASKS", value=tasks)
    if n % nodes:
        raise InputError(f"the plan's {n} processes do not divide over {nodes} nodes", key="mesh", value=n)
    hosts = subprocess.run(["scontrol", "show", "hostnames", env["SLURM_JOB_NODELIST"]], capture_output=True, text=True, check=True)
    first = hosts.stdout.split()[0]
    port = int(env.get("AMPFLOW_RDZV_PORT") or RDZV_PORT)
    return [*head, f"--nnodes={nodes}", f"--nproc-per-node={n // nodes}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={first}:{port}", f"--rdzv-id={env.get('SLURM_JOB_ID', 'ampflow')}",
            "-m", "ampflow.cli", *argv]  # fmt: skip


def launch(n: int, argv: list[str]) -> int:
    """Run ``ampflow <argv>`` under torchrun with ``n`` processes; its exit status."""
    cmd = torchrun_command(n, argv)
    log.info("launching %d processes: %s", n, " ".join(cmd))
    res = subprocess.run(cmd)
    if res.returncode != 0:
        log.error("torchrun exited with status %d (a rank failed or was killed); running the same command again resumes from the last checkpoint", res.returncode)
    return res.returncode


def run_training(data_dir, out_dir, model_cfg: ModelConfig, train_cfg: TrainConfig, plan: Plan | None = None,
                 name: str = "", stop_after: int | None = None, relaunch_argv: list[str] | None = None, split=None) -> int:  # fmt: skip
    """Train one configuration; an exit status.

    With ``relaunch_argv`` (``ampflow train --launch``), a plan of more than one process
    and no torchrun around this process, the plan's world is started under torchrun
    running ``ampflow <relaunch_argv>``; otherwise this process joins torchrun's group (if
    any) and trains, rank 0 speaking for the group. ``split`` (``qc/split.tsv``) is
    checked against the split the data files were built with (see
    :func:`~ampflow.train.data.load_paired`).
    """
    from .data import load_paired
    from .trainer import Trainer

    if relaunch_argv is not None and launched_world() == 1 and plan is not None and plan.world > 1:
        return launch(plan.world, relaunch_argv)
    if plan is not None:
        log.info("%s", plan.summary())
    world = init_distributed(train_cfg.device)
    try:
        if world > 1 and dist.get_rank() > 0:
            logging.getLogger().setLevel(logging.WARNING)
        data = load_paired(data_dir, split=split)
        log.info(
            "training %s: %d cells (%d held out), %d genes, %d Hi-C features in %d strata",
            name or out_dir, data.n_cells, data.n_cells - len(data.train_rows), data.rna.shape[1], data.hic.shape[1], data.n_strata,
        )  # fmt: skip
        Trainer(data, model_cfg, train_cfg, out_dir, name=name, stop_after=stop_after, plan=plan).fit()
    finally:
        if world > 1:
            dist.destroy_process_group()
    return 0
