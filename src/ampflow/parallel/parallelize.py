"""Apply a plan's strategies to a plain :class:`~ampflow.model.paired.PairedModel`: the one
place a :class:`~ampflow.contract.plan.Plan` meets a model, for any world size (one included).

:func:`parallelize` swaps modules of the built model for their sharded counterparts
(the model's code is not edited, and the sharded modules keep the plain parameter names
in the plain order):

* S3 / S4: the Hi-C decoder's chunk size and key-first switch (single-process savers,
  applied in one process too). A plan sets both, on or off: the config's ``model.chunk``
  and ``model.key_first`` are what a model built without a plan runs, and a plan that
  chose one block runs one block, as its memory was predicted;
* S5 / S2 over the tp group: the Hi-C decoder becomes a
  :class:`~.sharded_decoder.ShardedStratifiedZINBDecoder`; under S2 the Hi-C encoder's
  input projection becomes a :class:`~.feature_parallel.FeatureParallelLinear`;
* S1 over the dp group: BatchNorm synchronised over the group
  (:func:`~.data_parallel.parallelize_data_parallel`); the step itself is a
  :class:`~.data_parallel.DataParallelStep`.

Every rank must build the same plain model first; it is broadcast from global rank 0
before slicing so that they start equal. :func:`full_state` / :func:`load_full_state`
convert between a rank's sharded model and optimizer state and the single-process one,
which is what checkpoints hold (so they resume on any mesh).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ..base.errors import InputError
from ..contract.plan import Plan
from ..contract.strategies import BUILT_IN, FEATURE_PARALLEL, HIDDEN_PARALLEL
from .data_parallel import parallelize_data_parallel
from .feature_parallel import FeatureParallelLinear
from .mesh import Mesh
from .sharded_decoder import ShardedStratifiedZINBDecoder
from .shards import Shard, gather_full


def parallelize(model: nn.Module, plan: Plan | None, mesh: Mesh | None = None) -> nn.Module:
    """The model of this rank under ``plan`` on ``mesh`` (modified in place and returned).

    Parameters
    ----------
    model : PairedModel
        The plain model, built alike on every rank.
    plan : Plan
        From ``plan.json`` (strategies, chunk size, key-first); None: no strategy, and
        the decoder's chunk and key-first stay as the model was built.
    mesh : Mesh, optional
        This process's place in the dp x tp mesh; None: one process (1 x 1). In one
        process only S3 and S4 change anything.

    Returns
    -------
    PairedModel with the attribute ``shards`` (parameter name -> Shard) and ``tp_group``.
    """
    unknown = [n for n in (plan.names if plan is not None else ()) if n not in BUILT_IN]
    if unknown:  # never run a plan with a strategy left out
        raise InputError(f"unknown strategy; this trainer applies {', '.join(BUILT_IN)}", path=plan.source, key="strategies", value=unknown)
    mesh = mesh or Mesh(1, 1)
    dec = model.hic_decoder
    if plan is not None:
        apply_single_device_strategies(dec, plan)
    plan = plan or Plan()
    if mesh.world > 1:
        _broadcast_from_rank0(model)
    features = plan.uses(FEATURE_PARALLEL) and mesh.tp > 1
    hidden = plan.uses(HIDDEN_PARALLEL) and mesh.tp > 1
    names_before = [n for n, _ in model.named_parameters()]
    shards: dict[str, Shard] = {}
    if features or hidden:
        sharded = ShardedStratifiedZINBDecoder(dec, mesh.tp_group, mesh.tp, mesh.tp_rank, features, hidden)
        model.hic_decoder = sharded
        shards.update({f"hic_decoder.{n}": s for n, s in sharded.shards.items()})
    if features:
        first = model.hic_encoder.body[0]
        layer = FeatureParallelLinear(first, sharded.local_features, mesh.tp_group)
        model.hic_encoder.body[0] = layer
        shards.update({f"hic_encoder.body.0.{n}": s for n, s in layer.shards.items()})
    if [n for n, _ in model.named_parameters()] != names_before:  # optimizer states map by position
        raise RuntimeError("sharding changed the model's parameter names or order")
    model = parallelize_data_parallel(model, mesh, broadcast=False)
    model.shards, model.tp_group = shards, mesh.tp_group
    return model


@torch.no_grad()
def _broadcast_from_rank0(model: nn.Module) -> None:
    for t in model.state_dict().values():
        dist.broadcast(t, src=0)


def _shards_of(model: nn.Module) -> dict[str, Shard]:
    return getattr(model, "shards", {}) or {}


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> tuple[dict, dict | None]:
    """The single-process ``state_dict`` of the model (and of the optimizer) from this
    rank's shards: a collective over the tp group; every rank gets the full state."""
    shards, group = _shards_of(model), getattr(model, "tp_group", None)
    state = {n: (gather_full(t, shards[n], group) if n in shards else t.detach().clone()) for n, t in model.state_dict().items()}
    if optimizer is None:
        return state, None
    opt = optimizer.state_dict()
    names = [n for n, _ in model.named_parameters()]
    full_opt = {"param_groups": opt["param_groups"], "state": {}}
    for i, st in opt["state"].items():
        shard = shards.get(names[i])
        full_opt["state"][i] = {k: (gather_full(v, shard, group) if shard is not None and torch.is_tensor(v) and v.dim() > 0 else v) for k, v in st.items()}
    return state, full_opt


def load_full_state(model: nn.Module, state: dict, optimizer: torch.optim.Optimizer | None = None, opt_state: dict | None = None) -> None:
    """Load single-process state into this rank's sharded model (and optimizer)."""
    shards = _shards_of(model)
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    if missing:
        raise InputError("the checkpoint lacks model entries", key="model", value=missing[:5])
    model.load_state_dict({n: (shards[n].take(state[n]) if n in shards else state[n]) for n in own})
    if optimizer is None or opt_state is None:
        return
    names = [n for n, _ in model.named_parameters()]
    local = {"param_groups": opt_state["param_groups"], "state": {}}
    for i, st in opt_state["state"].items():
        shard = shards.get(names[int(i)])
        local["state"][i] = {k: (shard.take(v) if shard is not None and torch.is_tensor(v) and v.dim() > 0 else v) for k, v in st.items()}
    optimizer.load_state_dict(local)


def apply_single_device_strategies(dec, plan: Plan) -> None:
    """Set the plan's strategies that need no other rank, on or off: S3's query chunk in
    every stratum block (0: one block) and S4's key-first decode."""
    for block in dec.blocks:
        block.chunk = int(plan.chunk or 0)
    dec.key_first = bool(plan.uses_key_first)
