"""The GPT both backends build: canonical parameter names, shapes, layouts and initial weights.

Canonical names are megatron-core's (``decoder.layers.0.mlp.linear_fc1.weight``), and a
canonical tensor is the logical weight in megatron-core's TP=1 layout (fused QKV rows ordered
per query group: q heads, k, v). Every side starts from :func:`canonical_state` for its seed,
cut into its own layout by :func:`layout_of`, so step-0 logical weights are equal everywhere.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Shard

from harness.common.layout import Layout, gtp_pad
from harness.common.mesh import Mesh, expert_dp
from harness.scenario.arch_rules import qkv_rows
from harness.scenario.schema import GATED, ModelConfig, Side
from harness.scenario.vocab_rules import padded_vocab_size


@dataclass(frozen=True, slots=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    tp_dim: int | None
    """Dim TP cuts (0: column-parallel / vocab-parallel, 1: row-parallel), None: replicated."""
    gtp: bool
    """GTP-sharded (dim 0 of the TP-local block) when G > 1."""
    init: str
    """normal, scaled_normal, ones or zeros."""
    expert: int | None = None
    """The routed expert (global index) whose weight this is; None: not an expert's."""
    tp_stride: int = 1
    """Blocks TP cuts one by one (megatron-core's ``partition_stride``): 2 for a gated fc1's
    ``[gate; up]``, rank r holding ``[gate_r; up_r]``."""
    vocab_padding: int = 0
    """Rows the padded vocabulary adds at the tail of dim 0 (the word embedding, the output layer)."""


def param_specs(m: ModelConfig) -> list[ParamSpec]:
    """Every parameter of the GPT, in megatron-core's registration order (the vocabulary padded:
    :func:`~harness.scenario.vocab_rules.padded_vocab_size`, equal on every side)."""
    h, v = m.hidden_size, padded_vocab_size(m)
    pad = v - m.vocab_size
    specs = [ParamSpec("embedding.word_embeddings.weight", (v, h), 0, True, "normal", vocab_padding=pad)]
    if m.position_embedding_type == "learned_absolute":  # RoPE and none have no parameters
        specs.append(ParamSpec("embedding.position_embeddings.weight", (m.seq_length, h), None, False,
                               "normal"))
    for i in range(m.num_layers):
        specs += _layer_specs(m, f"decoder.layers.{i}.")
    specs += _norm_specs("decoder.final_layernorm", m)
    specs += _mtp_specs(m)
    if m.untie_embeddings:
        specs.append(ParamSpec("output_layer.weight", (v, h), 0, True, "normal", vocab_padding=pad))
    return specs


def _norm_specs(name: str, m: ModelConfig, size: int | None = None) -> list[ParamSpec]:
    """A norm's parameters (over ``size`` channels, the hidden size unless given): LayerNorm's weight
    and bias, RMSNorm's weight alone."""
    h = size or m.hidden_size
    weight = ParamSpec(name + ".weight", (h,), None, False, "ones")
    if m.normalization == "RMSNorm":
        return [weight]
    return [weight, ParamSpec(name + ".bias", (h,), None, False, "zeros")]


def _layer_specs(m: ModelConfig, p: str) -> list[ParamSpec]:
    """One transformer layer under prefix ``p`` (a decoder layer, or an MTP layer's ``mtp_model_layer``)."""
    h, qkv = m.hidden_size, qkv_rows(m)
    return [
        *_norm_specs(p + "input_layernorm", m),
        *_attention_specs(m, p + "self_attention."),
        ParamSpec(p + "self_attention.linear_proj.weight", (h, h), 1, True, "scaled_normal"),
        *_bias_specs(p + "self_attention.linear_proj", h, 1, m.add_bias_linear),
        ParamSpec(p + "self_attention.linear_qkv.weight", (qkv, h), 0, True, "normal"),
        *_bias_specs(p + "self_attention.linear_qkv", qkv, 0, m.add_bias_linear or m.add_qkv_bias),
        *_qk_norm_specs(m, p + "self_attention."),
        *_norm_specs(p + "pre_mlp_layernorm", m),
        *_mlp_specs(m, p),
    ]


def _attention_specs(m: ModelConfig, p: str) -> list[ParamSpec]:
    """The learnable softmax's offset logit per head (``DotProductAttention``, registered first in
    the attention): cut over TP with the heads, replicated over GTP, from the normal stream as
    megatron-core's ``init_method`` draws it."""
    if m.softmax_type != "learnable":
        return []
    return [ParamSpec(p + "core_attention.softmax_offset", (m.num_attention_heads,), 0, False, "normal")]


def _qk_norm_specs(m: ModelConfig, p: str) -> list[ParamSpec]:
    """``qk_layernorm``'s two norms over the head dim (registered after linear_qkv), replicated over
    TP and GTP."""
    if not m.qk_layernorm:
        return []
    head = m.hidden_size // m.num_attention_heads
    return [*_norm_specs(p + "q_layernorm", m, head), *_norm_specs(p + "k_layernorm", m, head)]


def _bias_specs(layer: str, rows: int, weight_tp_dim: int, present: bool, stride: int = 1) -> list[ParamSpec]:
    """A linear layer's bias (registered after its weight), where the model has one: cut over TP
    with a column-parallel weight's rows, whole beside a row-parallel weight; never GTP-sharded
    (megatron-core's ``wrap_module_params_gtp`` wraps the weight alone: the bias is replicated
    over the GTP group). Initialized from the normal stream (megatron-core zeroes it; the harness
    loads canonical weights, and a nonzero bias makes step 1's forward depend on it)."""
    if not present:
        return []
    tp_dim = 0 if weight_tp_dim == 0 else None
    return [ParamSpec(layer + ".bias", (rows,), tp_dim, False, "normal", tp_stride=stride)]


def _mtp_specs(m: ModelConfig) -> list[ParamSpec]:
    """megatron-core's MTP block (one layer per depth, or one under ``mtp_use_repeated_layer``):
    enorm, hnorm, eh_proj (column-parallel, [h, 2h]: the [embedding, hidden] concatenation), a
    transformer layer, final_layernorm; registered after the decoder, before the output layer."""
    h, specs = m.hidden_size, []
    for k in range(1 if m.mtp_use_repeated_layer else m.mtp_num_layers):
        p = f"mtp.layers.{k}."
        specs += [*_norm_specs(p + "enorm", m), *_norm_specs(p + "hnorm", m),
                  ParamSpec(p + "eh_proj.weight", (h, 2 * h), 0, True, "normal"),
                  *_layer_specs(m, p + "mtp_model_layer."),
                  *_norm_specs(p + "final_layernorm", m)]
    return specs


def _mlp_specs(m: ModelConfig, p: str) -> list[ParamSpec]:
    """The dense MLP, or megatron-core's MoE layer: the router (replicated, never GTP-sharded),
    each routed expert's MLP, named by its global index, then the shared experts' MLP (a dense
    one: TP and the dense GTP group cut it). Gated, every fc1 is [gate; up]."""
    h, f = m.hidden_size, m.ffn_hidden_size
    k = 2 if m.activation in GATED else 1  # a gated fc1: [gate; up], each half cut over TP
    if not m.num_experts:
        return [ParamSpec(p + "mlp.linear_fc1.weight", (k * f, h), 0, True, "normal", tp_stride=k),
                *_bias_specs(p + "mlp.linear_fc1", k * f, 0, m.add_bias_linear, k),
                ParamSpec(p + "mlp.linear_fc2.weight", (h, f), 1, True, "scaled_normal"),
                *_bias_specs(p + "mlp.linear_fc2", h, 1, m.add_bias_linear)]
    specs = [ParamSpec(p + "mlp.router.weight", (m.num_experts, h), None, False, "normal")]
    for e in range(m.num_experts):
        q = f"{p}mlp.experts.local_experts.{e}."
        specs += [ParamSpec(q + "linear_fc1.weight", (k * f, h), 0, True, "normal", e, tp_stride=k),
                  ParamSpec(q + "linear_fc2.weight", (h, f), 1, True, "scaled_normal", e)]
    if s := m.moe_shared_expert_intermediate_size:
        q = p + "mlp.shared_experts."
        specs += [ParamSpec(q + "linear_fc1.weight", (k * s, h), 0, True, "normal", tp_stride=k),
                  ParamSpec(q + "linear_fc2.weight", (h, s), 1, True, "scaled_normal")]
    return specs


def _generator(seed: int, name: str) -> torch.Generator:
    # One stream per (seed, name): a weight does not depend on which others exist or their order.
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def canonical_state(m: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Logical fp32 initial weights, a function of (model, seed) only."""
    scaled = m.init_std / math.sqrt(2.0 * m.num_layers)
    state = {}
    for spec in param_specs(m):
        if spec.init == "ones":
            t = torch.ones(spec.shape)
        elif spec.init == "zeros":
            t = torch.zeros(spec.shape)
        else:
            std = scaled if spec.init == "scaled_normal" else m.init_std
            t = torch.empty(spec.shape).normal_(0.0, std, generator=_generator(seed, spec.name))
        state[spec.name] = t
    return state


def mesh_of(side: Side) -> dict[str, int]:
    """The mesh ``side``'s tensors are laid out on: one pipeline stage's (tp, gtp, dp)."""
    return Mesh.of_side(side).stage_sizes()


def layout_of(spec: ParamSpec, side: Side, num_experts: int = 0) -> Layout:
    """Where the shards of ``spec`` sit on ``side``'s mesh (as megatron-core lays them out)."""
    if spec.expert is not None:
        return _expert_layout(spec, side, num_experts)
    mesh = mesh_of(side)
    placements, pads, strides = {}, {}, {}
    if spec.tp_dim is not None and side.tp > 1:
        placements["tp"] = Shard(spec.tp_dim)
        if spec.tp_stride > 1:
            strides["tp"] = spec.tp_stride
    if spec.gtp and side.gtp > 1:
        local0 = spec.shape[0] // (side.tp if spec.tp_dim == 0 else 1)
        placements["gtp"] = Shard(0)
        pads["gtp"] = gtp_pad(local0, side.gtp, side.gtp_pad_alignment)
    return Layout(spec.shape, mesh, placements, pads, strides=strides, vocab_padding=spec.vocab_padding)


def vocabulary_described(layouts: dict[str, Layout], m: ModelConfig) -> dict[str, Layout]:
    """``layouts`` read off megatron-core's attributes (which do not say which rows the padded
    vocabulary adds) with the vocabulary tables' padding rows described."""
    pad = {s.name: s.vocab_padding for s in param_specs(m) if s.vocab_padding}
    return {n: dataclasses.replace(layout, vocab_padding=pad[n]) if n in pad else layout
            for n, layout in layouts.items()}


def _expert_layout(spec: ParamSpec, side: Side, num_experts: int) -> Layout:
    """A routed expert's weight: on the expert grid (expert TP x EP x EGTP x expert DP) when EP
    or EGTP is on or expert TP is not TP, held by the ranks of its EP coordinate, cut by expert TP
    as the dense MLP is by TP and by EGTP on dim 0 (padded as GTP pads); on the dense mesh
    otherwise (the expert grid is the dense one then)."""
    ep, eg, etp = side.ep, side.expert_gtp, getattr(side, "etp", side.tp)
    placements = {"tp": Shard(spec.tp_dim)} if etp > 1 else {}
    strides = {"tp": spec.tp_stride} if etp > 1 and spec.tp_stride > 1 else {}  # a gated fc1: [gate_r; up_r]
    if ep * eg == 1 and etp == side.tp:
        return Layout(spec.shape, mesh_of(side), placements, strides=strides)
    mesh = {"tp": etp, "gtp": eg, "dp": expert_dp(side.world_size, etp, ep, eg, side.pipeline_parallel)}
    pads = {}
    if eg > 1:
        local0 = spec.shape[0] // (etp if spec.tp_dim == 0 else 1)
        placements["gtp"] = Shard(0)
        pads["gtp"] = gtp_pad(local0, eg, side.gtp_pad_alignment)
    owner = spec.expert // (num_experts // ep)
    return Layout(spec.shape, mesh, placements, pads, grid="expert", fixed={"ep": owner}, strides=strides)


def captured_modules(model) -> dict[str, torch.nn.Module]:
    """The modules whose outputs are captured, by megatron-core's module names.

    Serves megatron-core's GPTModel and the torch backend's GPT alike: both name their
    submodules as megatron-core does.
    """
    modules = {"embedding": model.embedding, "output_layer": model.output_layer,
               "decoder.final_layernorm": model.decoder.final_layernorm}
    for i, layer in enumerate(model.decoder.layers):
        modules[f"decoder.layers.{i}"] = layer
        for sub in ("input_layernorm", "self_attention", "pre_mlp_layernorm", "mlp"):
            modules[f"decoder.layers.{i}.{sub}"] = getattr(layer, sub)
    return modules
