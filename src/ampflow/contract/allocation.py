"""The train job's allocation, derived from its plan and what the cluster offers.

The plan (``plan.json``) decides how many processes train (dp x tp) and whether they
train on GPUs (its ``device``; a plan before version 4: a plan for CPU carries a ``cpu``
section); the config's ``cluster``
section says once what a node offers (GPUs, CPU cores and host memory per GPU, the GPU
partition). :func:`train_allocation` turns the two into the job's nodes, GPUs per node,
tasks, CPUs and memory, and :meth:`Allocation.resources` into Snakemake resources for
the SLURM executor plugin, so the plan and the allocation cannot disagree.

GPU plans: one process per GPU. A world that fits on one node asks for ``gpu = world``
(``--gpus``); a larger one spans ``ceil(world / gpus_per_node)`` nodes with an equal
share of processes each (``--gpus-per-node``), one task per node, and its command runs
on the first node without the plugin's ``srun -n1`` (the ``mpi`` resource), where
``ampflow train --launch`` starts one ``torchrun`` per node itself
(:mod:`ampflow.train.launch`). CPU plans: one node; threads and memory from the plan.

:class:`JobSizing` holds the policy by which the workflow sizes its devices, train and
embed jobs from the config (and, for the train job, the plan) while it is parsed:
``workflow/rules/*.smk`` only look up the config and the host and call it.

Torch-free: the workflow imports it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..base.errors import InputError
from .config import AUTO_DEVICES, AUTO_THREADS, check_amp_devices
from .plan import Plan

MB = 1 << 20
#: Host memory (MB) of one CPU training process beyond what the plan's batch check
#: counts (the interpreter, torch and the data files it reads).
CPU_PROCESS_MB = 1000
#: The least a CPU training job asks for (MB).
CPU_MIN_MB = 2000


@dataclass(frozen=True)
class ClusterOffer:
    """What one node of the cluster offers a GPU job (config section ``cluster``)."""

    gpu_partition: str | None = None
    gpus_per_node: int = 1
    cpus_per_gpu: int = 1
    mem_mb_per_gpu: int = 4000

    def __post_init__(self):
        for key in ("gpus_per_node", "cpus_per_gpu", "mem_mb_per_gpu"):
            v = getattr(self, key)
            least = 0 if key == "gpus_per_node" else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise InputError(f"must be an integer >= {least}", key=f"cluster.{key}", value=v)

    @classmethod
    def from_dict(cls, d: dict | None) -> ClusterOffer:
        d = dict(d or {})
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise InputError("unknown key", key=f"cluster.{unknown[0]}", value=d[unknown[0]])
        return cls(**d)

    def gpu_resources(self, gpus: int) -> dict:
        """Resources that place a job of ``gpus`` GPUs on one node: the GPU count, the
        CPUs and memory they come with, the GPU partition; none without GPUs."""
        if gpus <= 0:
            return {}
        out = {"gpu": gpus, "cpus_per_gpu": self.cpus_per_gpu, "mem_mb": self.mem_mb_per_gpu * gpus}
        if self.gpu_partition:
            out["slurm_partition"] = self.gpu_partition
        return out


@dataclass(frozen=True)
class Allocation:
    """The train job's share of the cluster.

    Attributes
    ----------
    gpus : bool
        One process per GPU (False: processes on CPU cores).
    nodes : int
    per_node : int
        Processes on each node (= GPUs per node for a GPU plan).
    cpus_per_node : int or None
        CPU cores per node (None for a CPU plan: the rule's threads).
    mem_mb : int
        Host memory per node (MB).
    partition : str or None
    """

    gpus: bool
    nodes: int
    per_node: int
    cpus_per_node: int | None
    mem_mb: int
    partition: str | None = None

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    def resources(self) -> dict:
        """Snakemake resources for the SLURM executor plugin (values None are dropped)."""
        if not self.gpus:
            return {"mem_mb": self.mem_mb}
        out = {"mem_mb": self.mem_mb, "slurm_partition": self.partition, "nodes": self.nodes}
        if self.nodes == 1:
            # --gpus=N --cpus-per-gpu; the plugin runs the command as `srun -n1 --gpus=N`
            out.update(gpu=self.per_node, cpus_per_gpu=self.cpus_per_node // self.per_node)
            return out
        # one task per node; the GPUs per node through slurm_extra (with `gpu`, `tasks`
        # would become --ntasks-per-gpu); `mpi`: no `srun -n1` around the command, which
        # starts its own srun over the nodes
        out.update(gpu=0, tasks=self.nodes, cpus_per_task=self.cpus_per_node, mpi="srun",
                   slurm_extra=f"--gpus-per-node={self.per_node} --ntasks-per-node=1")  # fmt: skip
        return out


def plan_on_gpus(plan) -> bool:
    """Whether a plan trains on GPUs: its ``device`` (version 4 on); in an older plan,
    whether it lacks the ``cpu`` section a plan for CPU carries."""
    if getattr(plan, "device", ""):
        return plan.device == "cuda"
    return plan.cpu is None


def train_allocation(plan, offer: ClusterOffer) -> Allocation:
    """The allocation that trains ``plan`` (a :class:`~ampflow.contract.plan.Plan`) on what
    ``offer`` gives; an InputError when a GPU plan does not split over whole nodes."""
    world = plan.world
    if not plan_on_gpus(plan):
        need = plan.cpu.host_need_bytes if plan.cpu is not None else 0
        mem = max(CPU_MIN_MB, world * CPU_PROCESS_MB + math.ceil(need * 1.25 / MB))
        return Allocation(False, 1, world, None, mem)
    if offer.gpus_per_node < 1:
        raise InputError(
            f"the plan trains {world} process(es) on GPUs but the cluster offers none per node",
            key="cluster.gpus_per_node", value=offer.gpus_per_node,
        )  # fmt: skip
    nodes = math.ceil(world / offer.gpus_per_node)
    if world % nodes:
        raise InputError(
            f"the plan's {world} processes (dp {plan.mesh.dp} x tp {plan.mesh.tp}) do not split evenly over "
            f"{nodes} nodes of {offer.gpus_per_node} GPUs; set amp.devices to a multiple of the GPUs per node",
            key="cluster.gpus_per_node", value=offer.gpus_per_node,
        )  # fmt: skip
    per_node = world // nodes
    return Allocation(True, nodes, per_node, offer.cpus_per_gpu * per_node, offer.mem_mb_per_gpu * per_node, offer.gpu_partition)


# ---------------------------------------------------------------- jobs sized before a plan
# The workflow sizes the devices, train and embed jobs from the config before any plan
# exists (the plan is made from what the devices job records); these are its rules.
def planned_devices(amp_devices, visible_gpus: int, offer: ClusterOffer) -> int:
    """``amp.devices`` as a number: as given; for ``auto`` (counted by the diagnosis
    from ``devices.json``) the GPUs visible here, or where none is (a cluster's login
    node, a dry run) one node's, ``cluster.gpus_per_node``, at least 1."""
    if amp_devices != AUTO_DEVICES:
        return int(amp_devices)
    return visible_gpus or max(1, offer.gpus_per_node)


def train_cores(threads, devices: int, snakemake_cores: int | None, cpu_count: int) -> int:
    """Cores a training job reserves (and the devices job, which probes such an
    allocation): ``train.threads`` per process times the ``devices`` processes; for
    ``auto``, the cores Snakemake has (``--cores``; on a cluster what the profile's
    ``set-threads`` gives; None: none given), at most this host's, which the plan
    divides among the processes."""
    if threads != AUTO_THREADS:
        return int(threads) * devices
    return max(1, min(snakemake_cores or cpu_count, cpu_count))


def embed_threads(threads, train_job_cores: int) -> int:
    """Torch threads of an embedding job (one process): ``train.threads``, or for
    ``auto`` the cores a training job reserves."""
    return int(threads) if threads != AUTO_THREADS else train_job_cores


def trains_on_gpus(offer: ClusterOffer, train_device: str) -> bool:
    """Whether training uses GPUs: the cluster offers some and ``train.device`` allows them."""
    return offer.gpus_per_node > 0 and train_device != "cpu"


def devices_job_gpus(offer: ClusterOffer, train_device: str, amp_devices) -> int:
    """GPUs of the devices job: one node's share of ``amp.devices`` (it records what such
    an allocation sees; the plan is made from it); for ``auto``, one node's."""
    if not trains_on_gpus(offer, train_device):
        return 0
    if amp_devices == AUTO_DEVICES:
        return offer.gpus_per_node
    return min(int(amp_devices), offer.gpus_per_node)


def gpu_partition(offer: ClusterOffer, train_device: str, value) -> dict:
    """``slurm_partition`` of a GPU job (``cluster.gpu_partition``), as a dict to unpack
    into a rule's resources: empty when the run uses no GPUs or names no GPU partition,
    so the profile's default partition applies."""
    if trains_on_gpus(offer, train_device) and offer.gpu_partition:
        return {"slurm_partition": value}
    return {}


@dataclass(frozen=True)
class JobSizing:
    """The config's figures that size the devices, train and embed jobs, and the rules
    above applied to them; the workflow builds one from its config while it is parsed.

    Attributes
    ----------
    offer : ClusterOffer
        What a GPU node offers (config ``cluster``).
    threads : int or "auto"
        ``train.threads``.
    device : str
        ``train.device`` (``cpu``, ``cuda`` or ``auto``).
    amp_devices : int, str or "auto"
        ``amp.devices`` as the config gives it (an integer, possibly as text).
    """

    offer: ClusterOffer
    threads: int | str = AUTO_THREADS
    device: str = "auto"
    amp_devices: int | str = AUTO_DEVICES

    @classmethod
    def from_config(cls, config: dict) -> JobSizing:
        """From a workflow config's sections ``cluster``, ``train`` and ``amp``; an
        InputError for a bad ``cluster`` key, then for a bad ``amp.devices``."""
        offer = ClusterOffer.from_dict(config["cluster"])
        check_amp_devices(config["amp"]["devices"])
        return cls(offer, config["train"]["threads"], config["train"]["device"], config["amp"]["devices"])

    def train_cores(self, visible_gpus: int, snakemake_cores: int | None, cpu_count: int) -> int:
        """Cores the train and devices jobs reserve (:func:`train_cores`) for the
        processes :func:`planned_devices` counts with ``visible_gpus`` on this host."""
        devices = planned_devices(self.amp_devices, visible_gpus, self.offer)
        return train_cores(self.threads, devices, snakemake_cores, cpu_count)

    def embed_threads(self, train_job_cores: int) -> int:
        """Threads of an embedding job (:func:`embed_threads`)."""
        return embed_threads(self.threads, train_job_cores)

    def devices_resources(self) -> dict:
        """Resources of the devices job: one node's share of ``amp.devices``' GPUs
        (:func:`devices_job_gpus`) with their CPUs, memory and partition; none for a
        CPU run."""
        return self.offer.gpu_resources(devices_job_gpus(self.offer, self.device, self.amp_devices))

    def gpu_partition(self, value) -> dict:
        """``{"slurm_partition": value}`` for a run on GPUs with a GPU partition, else
        empty (:func:`gpu_partition`)."""
        return gpu_partition(self.offer, self.device, value)

    def train_resource(self, name: str, default=None) -> Callable:
        """A Snakemake resource function ``(wildcards, input)`` of the train job: resource
        ``name`` of :func:`train_allocation` for the plan ``input.plan`` and this offer,
        ``default`` where the allocation does not set it. Before the plan exists (a dry
        run) it raises FileNotFoundError, which Snakemake shows as ``<TBD>``."""

        def value(wildcards, input):
            if not Path(input.plan).exists():
                raise FileNotFoundError(2, "no plan yet", input.plan)
            return train_allocation(Plan.read(input.plan), self.offer).resources().get(name, default)

        return value
