"""Layers built from the shape description in :mod:`ampflow.contract.model_shapes`.

The model's sizes are read from the description rather than restated, so the memory model
(which counts the same description) cannot drift from what is built. A name missing from
the description raises KeyError here; ``tests/test_memory_model.py`` checks the built
parameters against the description name by name.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..contract.model_shapes import ParamShape


def linear_from(params: dict[str, ParamShape], name: str) -> nn.Linear:
    """``nn.Linear`` with the shape of ``params[name + ".weight"]`` (out, in), with a
    bias when the description has ``name + ".bias"``."""
    n_out, n_in = params[f"{name}.weight"].shape
    return nn.Linear(n_in, n_out, bias=f"{name}.bias" in params)


def layer_norm_from(params: dict[str, ParamShape], name: str) -> nn.LayerNorm:
    """``nn.LayerNorm`` over the shape of ``params[name + ".weight"]``."""
    return nn.LayerNorm(params[f"{name}.weight"].shape)


def batch_norm_from(params: dict[str, ParamShape], name: str) -> nn.BatchNorm1d:
    """``nn.BatchNorm1d`` over the features of ``params[name + ".weight"]``."""
    (n,) = params[f"{name}.weight"].shape
    return nn.BatchNorm1d(n)


def parameter_from(params: dict[str, ParamShape], name: str, fill: float) -> nn.Parameter:
    """A parameter of the described shape, every entry ``fill``."""
    return nn.Parameter(torch.full(params[name].shape, fill))
