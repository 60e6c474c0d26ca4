"""JobSizing (contract.allocation): the workflow's sizing of the devices, train and embed
jobs from its config, and the train job's resources read from its plan. Every expected
value is worked out by hand in the comment beside it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from ampflow.base.errors import InputError
from ampflow.contract.allocation import ClusterOffer, JobSizing


def config(cluster=None, threads=1, device="auto", devices=2) -> dict:
    """The sections JobSizing reads of a workflow config."""
    return {"cluster": cluster or {}, "train": {"threads": threads, "device": device}, "amp": {"devices": devices}}


FOUR = {"gpu_partition": "gpu", "gpus_per_node": 4, "cpus_per_gpu": 8, "mem_mb_per_gpu": 1000}


def test_from_config_keeps_the_config_values():
    s = JobSizing.from_config(config(FOUR, threads=2, device="cuda", devices="3"))
    assert s.offer == ClusterOffer("gpu", 4, 8, 1000)
    # amp.devices as the config gives it (text stays text: the rules pass it on as given)
    assert (s.threads, s.device, s.amp_devices) == (2, "cuda", "3")


def test_fixed_threads_and_devices():
    s = JobSizing.from_config(config(FOUR, threads=2, device="cuda", devices="3"))
    # 2 threads x 3 processes, whatever Snakemake or the host have
    assert s.train_cores(visible_gpus=0, snakemake_cores=64, cpu_count=16) == 6
    assert s.train_cores(visible_gpus=8, snakemake_cores=None, cpu_count=1) == 6
    # embedding: one process of train.threads
    assert s.embed_threads(99) == 2
    # devices job: min(3 devices, 4 per node) = 3 GPUs, 8 CPUs and 1000 MB each
    assert s.devices_resources() == {"gpu": 3, "cpus_per_gpu": 8, "mem_mb": 3000, "slurm_partition": "gpu"}
    assert s.gpu_partition("p") == {"slurm_partition": "p"}


def test_auto_threads_take_the_cores_snakemake_has_at_most_the_hosts():
    s = JobSizing.from_config(config({"gpus_per_node": 2}, threads="auto", device="auto", devices="auto"))
    assert s.train_cores(visible_gpus=0, snakemake_cores=4, cpu_count=12) == 4
    assert s.train_cores(visible_gpus=0, snakemake_cores=64, cpu_count=12) == 12
    assert s.train_cores(visible_gpus=1, snakemake_cores=None, cpu_count=12) == 12  # no --cores: the host's
    assert s.embed_threads(7) == 7
    # devices: auto is one node's 2 GPUs, with the default 1 CPU and 4000 MB each; no partition named
    assert s.devices_resources() == {"gpu": 2, "cpus_per_gpu": 1, "mem_mb": 8000}
    assert s.gpu_partition("p") == {}  # no cluster.gpu_partition: the profile's default


def test_auto_devices_count_the_visible_gpus_else_one_nodes():
    s = JobSizing.from_config(config({"gpus_per_node": 2}, threads=3, devices="auto"))
    assert s.train_cores(visible_gpus=5, snakemake_cores=None, cpu_count=1) == 15  # 3 x 5 visible
    assert s.train_cores(visible_gpus=0, snakemake_cores=None, cpu_count=1) == 6  # 3 x 2 per node
    none = JobSizing.from_config(config({"gpus_per_node": 0}, threads=3, devices="auto"))
    assert none.train_cores(visible_gpus=0, snakemake_cores=None, cpu_count=1) == 3  # 3 x at least 1


@pytest.mark.parametrize("cluster, device", [(FOUR, "cpu"), ({"gpus_per_node": 0, "gpu_partition": "gpu"}, "cuda")])
def test_no_gpus_for_a_cpu_run(cluster, device):
    s = JobSizing.from_config(config(cluster, device=device))
    assert s.devices_resources() == {}
    assert s.gpu_partition("gpu") == {}


def test_config_errors_name_the_key_cluster_first():
    with pytest.raises(InputError) as e:
        JobSizing.from_config(config({"bogus": 1}, devices=0))
    assert e.value.key == "cluster.bogus"
    with pytest.raises(InputError) as e:
        JobSizing.from_config(config(FOUR, devices=0))
    assert e.value.key == "amp.devices" and e.value.value == 0


def _plan(tmp_path, **plan) -> SimpleNamespace:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    return SimpleNamespace(plan=str(path))


NAMES = ("slurm_partition", "gpu", "nodes", "tasks", "mpi", "cpus_per_gpu", "cpus_per_task", "slurm_extra", "mem_mb")


def _resources(sizing: JobSizing, inp) -> dict:
    return {name: sizing.train_resource(name, 0 if name == "gpu" else None)(None, inp) for name in NAMES}


def test_train_resource_before_the_plan_exists_is_file_not_found(tmp_path):
    """Snakemake shows a resource function's FileNotFoundError as <TBD> in a dry run."""
    s = JobSizing.from_config(config(FOUR))
    with pytest.raises(FileNotFoundError):
        s.train_resource("mem_mb")(None, SimpleNamespace(plan=str(tmp_path / "plan.json")))


def test_train_resources_of_a_gpu_plan_on_one_node(tmp_path):
    s = JobSizing.from_config(config({"gpu_partition": "gpu-small", "gpus_per_node": 2, "cpus_per_gpu": 1, "mem_mb_per_gpu": 1500}))
    inp = _plan(tmp_path, mesh={"dp": 2, "tp": 1}, world_size=2)
    # 2 processes on a node of 2 GPUs: --gpus=2, 1 CPU and 1500 MB per GPU
    expected = dict.fromkeys(NAMES)
    expected.update(slurm_partition="gpu-small", gpu=2, nodes=1, cpus_per_gpu=1, mem_mb=3000)
    assert _resources(s, inp) == expected


def test_train_resources_of_a_gpu_plan_across_nodes(tmp_path):
    s = JobSizing.from_config(config({"gpu_partition": "gpu", "gpus_per_node": 4, "cpus_per_gpu": 2, "mem_mb_per_gpu": 4000}))
    inp = _plan(tmp_path, mesh={"dp": 2, "tp": 4}, world_size=8)
    # 8 processes on nodes of 4: 2 nodes, one task each with 4 x 2 CPUs and 4 x 4000 MB
    expected = dict.fromkeys(NAMES)
    expected.update(slurm_partition="gpu", gpu=0, nodes=2, tasks=2, mpi="srun", cpus_per_task=8, mem_mb=16000,
                    slurm_extra="--gpus-per-node=4 --ntasks-per-node=1")  # fmt: skip
    assert _resources(s, inp) == expected


def test_train_resources_of_a_cpu_plan(tmp_path):
    s = JobSizing.from_config(config(FOUR))
    inp = _plan(tmp_path, mesh={"dp": 3, "tp": 1}, world_size=3, device="cpu", cpu={"host_need_bytes": 10 * 2**20})
    # memory only: 3 processes x 1000 MB + ceil(10 MiB x 1.25) = 13 MB
    expected = dict.fromkeys(NAMES)
    expected.update(gpu=0, mem_mb=3013)
    assert _resources(s, inp) == expected
