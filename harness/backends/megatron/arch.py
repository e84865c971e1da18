"""The architecture switches of [model] as megatron-core's arguments, where a key does not reach
its argument one to one (:func:`harness.scenario.options.mcore_kwargs` passes those): the MLP's
activation as ``gated_linear_unit`` and ``activation_func``; and the TP cut of the learnable
softmax's offsets, which megatron-core does not tag."""

from __future__ import annotations

import torch.nn.functional as F

from torch.distributed.tensor import Shard

from harness.backends.gpt import vocabulary_described
from harness.common.layout import Layout, from_mcore_param
from harness.scenario.schema import GATED, ModelConfig

SOFTMAX_OFFSET = "core_attention.softmax_offset"


def activation_func(name: str):
    """megatron-core's function for an activation's name (the gate's, for a gated one)."""
    from megatron.core.activations import squared_relu

    funcs = {"gelu": F.gelu, "swiglu": F.silu, "geglu": F.gelu, "relu": F.relu, "squared_relu": squared_relu}
    return funcs[name]


def config_kwargs(m: ModelConfig) -> dict:
    """The derived ``TransformerConfig`` arguments of the model's switches."""
    return {"gated_linear_unit": m.activation in GATED, "activation_func": activation_func(m.activation)}


def softmax_offset_layout(name: str, param, theirs: Layout) -> Layout:
    """The layout of ``softmax_type = "learnable"``'s offsets: megatron-core 0.19.2's
    ``DotProductAttention.__init__`` (transformer/dot_product_attention.py l.126-138) registers
    num_attention_heads / TP of them on each TP rank (its own heads; its sharded_state_dict cuts
    them on dim 0) but sets no ``tensor_model_parallel`` attribute, so its attributes read
    replicated: the cut is read off the shape instead. Any other parameter's layout as read."""
    tp = theirs.mesh.get("tp", 1)
    if not name.endswith(SOFTMAX_OFFSET) or tp == 1 or getattr(param, "tensor_model_parallel", False):
        return theirs
    return Layout((param.shape[0] * tp,), dict(theirs.mesh), {"tp": Shard(0)}, {})


def param_layouts(named, mesh, m: ModelConfig) -> dict[str, Layout]:
    """Each parameter's layout as megatron-core's attributes say it, with what they do not say: the
    learnable softmax's offsets cut as their shape says, the padded vocabulary's rows described."""
    read = {n: softmax_offset_layout(n, p, from_mcore_param(p, mesh)) for n, p in named}
    return vocabulary_described(read, m)
