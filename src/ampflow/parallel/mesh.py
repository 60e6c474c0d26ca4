"""Who am I in the dp x tp mesh: :class:`Mesh` places a rank in it, and
:func:`init_distributed` / :func:`launched_world` read torchrun's environment. The
trainer's metrics gather and rank 0's writing ask torch.distributed directly, and the
launcher reads ``LOCAL_WORLD_SIZE`` to check one GPU per rank.

Ranks are laid out tp-major inside dp: rank = dp_rank * tp + tp_rank, so the ranks of
one tensor-parallel group are contiguous (on GPUs: the same node where possible).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..base.errors import InputError


@dataclass
class Mesh:
    """Degrees, this process's coordinates, and the process groups it belongs to.

    ``dp_group`` / ``tp_group`` are None for groups of size one: collectives over them
    are no-ops, so one code path serves one and many processes.
    """

    dp: int
    tp: int
    rank: int = 0
    dp_group: object = field(default=None, repr=False)
    tp_group: object = field(default=None, repr=False)

    def __post_init__(self):
        if self.dp < 1 or self.tp < 1:
            raise InputError("mesh degrees must be >= 1", key="mesh", value={"dp": self.dp, "tp": self.tp})
        if not 0 <= self.rank < self.world:
            raise InputError(f"rank outside a world of {self.world}", key="rank", value=self.rank)

    @property
    def world(self) -> int:
        return self.dp * self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @classmethod
    def build(cls, dp: int, tp: int) -> Mesh:
        """The mesh of this process in the initialised default group (or a 1 x 1 mesh
        when torch.distributed is not initialised)."""
        if not (dist.is_available() and dist.is_initialized()):
            if dp * tp != 1:
                raise InputError("a multi-process mesh needs torch.distributed initialised (launch with torchrun)", key="mesh", value={"dp": dp, "tp": tp})
            return cls(1, 1, 0)
        world, rank = dist.get_world_size(), dist.get_rank()
        if dp * tp != world:
            raise InputError(f"dp x tp must equal the world size {world}", key="mesh", value={"dp": dp, "tp": tp})
        mesh = cls(dp, tp, rank)
        # every process must create every group, in the same order
        for d in range(dp):
            ranks = list(range(d * tp, (d + 1) * tp))
            group = dist.new_group(ranks) if tp > 1 else None
            if rank in ranks:
                mesh.tp_group = group
        for t in range(tp):
            ranks = list(range(t, world, tp))
            group = dist.new_group(ranks) if dp > 1 else None
            if rank in ranks:
                mesh.dp_group = group
        return mesh


def init_distributed(device: str = "auto") -> int:
    """Join the process group that ``torchrun`` set up, if any; returns the world size.

    ``torchrun`` exports RANK, WORLD_SIZE and LOCAL_RANK; without them (or with a world
    of one) nothing is initialised and 1 is returned. The backend is NCCL when the run
    trains on CUDA (``device`` "cuda", or "auto" with a GPU visible; each process then
    takes GPU LOCAL_RANK) and gloo otherwise.
    """
    world = launched_world()
    if world <= 1 or not dist.is_available():
        return 1
    if dist.is_initialized():
        return dist.get_world_size()
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    return dist.get_world_size()


def launched_world() -> int:
    """The number of processes torchrun launched this one among (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))
