"""The architecture switches of [model] as megatron-core's arguments, where a key does not reach
its argument one to one (:func:`harness.scenario.options.mcore_kwargs` passes those): the MLP's
activation as ``gated_linear_unit`` and ``activation_func``."""

from __future__ import annotations

import torch.nn.functional as F

from harness.scenario.schema import GATED, ModelConfig


def activation_func(name: str):
    """megatron-core's function for an activation's name (the gate's, for a gated one)."""
    from megatron.core.activations import squared_relu

    funcs = {"gelu": F.gelu, "swiglu": F.silu, "geglu": F.gelu, "relu": F.relu, "squared_relu": squared_relu}
    return funcs[name]


def config_kwargs(m: ModelConfig) -> dict:
    """The derived ``TransformerConfig`` arguments of the model's switches."""
    return {"gated_linear_unit": m.activation in GATED, "activation_func": activation_func(m.activation)}
