"""The planted faults of the architecture switches ([model]'s biases, gated MLP, grouped-query
attention, query/key norms, tied embeddings, padded vocabulary): one per layout they add to what GTP shards or
replicates or a weight shares. Part of the catalogue (:mod:`harness.scenario.faults` merges them
into ``CATALOG``); :mod:`harness.backends.faults.arch` plants them; torch-free.

Each acts on layer 0 (the padded vocabulary's: on the output layer) of a megatron side with GTP
(the tied one on the embedding, at GTP off); :func:`arch_reach` says why a side cannot take one
(the switch it needs is off, or its layout is not the one the expected signature names).
"""

from __future__ import annotations

from harness.scenario.choices import GATED
from harness.scenario.fault import Fault

BIAS, GLU, QKV = "gtp-bias-grad-unreduced", "gtp-glu-halves-crossed", "gtp-qkv-groups-reordered"
TIED = "tied-grad-one-use"
VOCAB = "gtp-vocab-pad-rows-in-loss"
EXPERT_GLU = "gtp-expert-glu-halves-crossed"
QK_NORM = "gtp-qk-norm-grad-unreduced"

ARCH_FAULTS: dict[str, Fault] = {
    f.name: f
    for f in [
        Fault(
            BIAS, "missing reduction of a partial gradient",
            "decoder.layers.0.mlp.linear_fc1.bias, a bias replicated over the GTP group beside its "
            "GTP-sharded weight, is taken for a GTP-sharded parameter by finalize_model_grads' filter "
            "(it carries the is_gtp_weight_remat tag) and left out of the AVG all-reduce over the GTP "
            "group: each GTP rank keeps the partial gradient of its own samples",
            # Each GTP peer holds its own partial: the replicated grad differs across the group.
            {"step": 1, "phase": "backward", "kind": "main_grad",
             "tensor": "decoder.layers.0.mlp.linear_fc1.bias", "signature": "replica-drift"},
            target="decoder.layers.0.mlp.linear_fc1.bias",
        ),
        Fault(
            QK_NORM, "missing reduction of a partial gradient",
            "decoder.layers.0.self_attention.q_layernorm.weight, the query norm (qk_layernorm) replicated "
            "over the GTP group beside the GTP-sharded fused QKV it follows, is taken for a GTP-sharded "
            "parameter by finalize_model_grads' filter (tagged is_gtp_weight_remat, as a GTP wrapper of the "
            "attention module tagging all its parameters would) and left out of the AVG all-reduce over the "
            "GTP group: each GTP rank keeps the partial gradient of its own samples",
            {"step": 1, "phase": "backward", "kind": "main_grad",
             "tensor": "decoder.layers.0.self_attention.q_layernorm.weight", "signature": "replica-drift"},
            target="decoder.layers.0.self_attention.q_layernorm.weight",
        ),
        Fault(
            GLU, "a fused layout's blocks mis-ordered",
            "the forward all-gather of decoder.layers.0.mlp.linear_fc1.weight, a gated fc1 ([gate; up] per "
            "TP block), assembles the TP block's two halves in the other order ([up; gate]): where the "
            "gate/up boundary is a GTP shard boundary (no pad rows, G even) that is GTP's shards of the "
            "block put together across the boundary, and the gate's rows feed the up projection",
            {"step": 1, "phase": "weights", "kind": "materialized",
             "tensor": "decoder.layers.0.mlp.linear_fc1.weight", "signature": "permuted-blocks"},
            target="decoder.layers.0.mlp.linear_fc1.weight",
        ),
        Fault(
            QKV, "a fused layout's blocks mis-ordered",
            "the forward all-gather of decoder.layers.0.self_attention.linear_qkv.weight (grouped-query "
            "attention: per query group its query heads, a key and a value) moves each GTP shard's query "
            "groups to the next shard's place: the query heads read another group's key and value",
            {"step": 1, "phase": "weights", "kind": "materialized",
             "tensor": "decoder.layers.0.self_attention.linear_qkv.weight", "signature": "permuted-blocks"},
            target="decoder.layers.0.self_attention.linear_qkv.weight",
        ),
        Fault(
            TIED, "a weight used more than once per step",
            "the output layer computes with a detached view of embedding.word_embeddings.weight, the "
            "parameter a tied output layer shares with the embedding lookup: the shared weight's grad "
            "holds the lookup's use only, as a tied copy whose second use's grad is never added would",
            # Every weight used once keeps its grad: the output layer's input grad is untouched.
            {"step": 1, "phase": "backward", "kind": "main_grad",
             "tensor": "embedding.word_embeddings.weight", "signature": "shared-weight-only"},
            target="embedding.word_embeddings.weight",
        ),
        Fault(
            VOCAB, "padding",
            "the forward all-gather of output_layer.weight (a padded vocabulary: its padded rows, then GTP's "
            "pad rows at the tail of the TP block) hands out the gathered block with GTP's zero pad rows in "
            "front: they stand in the first vocabulary entries' places, whose logits become 0 in the loss's "
            "softmax, and every row behind them moves down",
            {"step": 1, "phase": "weights", "kind": "materialized", "tensor": "output_layer.weight",
             "signature": "pad-rows-as-data"},
            target="output_layer.weight",
        ),
        Fault(
            EXPERT_GLU, "a fused layout's blocks mis-ordered",
            "the forward all-gather of decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight, "
            "a routed expert's gated fc1 ([gate; up]) cut by expert GTP, assembles its two halves in the "
            "other order ([up; gate]): with the gate/up boundary on an EGTP shard boundary, the expert GTP "
            "shards put together across it",
            {"step": 1, "phase": "weights", "kind": "materialized",
             "tensor": "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight",
             "signature": "permuted-blocks"},
            target="decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight",
        ),
    ]
}


def _unpadded(rows: int, side) -> bool:
    """Does GTP cut a ``rows``-row TP block into G equal shards with no pad rows?"""
    align = side.gtp_pad_alignment * side.gtp
    return rows % align == 0 if align else rows % side.gtp == 0


def arch_reach(name: str, side, model) -> str | None:
    """Why fault ``name`` of :data:`ARCH_FAULTS` cannot fire on ``side`` of a scenario of ``model``
    (None: it can, or it is not one of them)."""
    if name not in ARCH_FAULTS:
        return None
    if name == TIED:  # under GTP megatron-core raises before any grad (scenarios/architectures.toml)
        if side.backend != "megatron" or side.gtp > 1 or model.untie_embeddings:
            return (f"{name!r} is planted on a megatron side at GTP off with tied embeddings "
                    "([model].untie_embeddings = false)")
        return None
    if name == EXPERT_GLU:
        return _expert_glu_reach(side, model)
    if side.backend != "megatron" or side.gtp == 1:
        return f"{name!r} is planted on a megatron side with GTP (gtp > 1)"
    if name == BIAS and not model.add_bias_linear:
        return f"{name!r} needs add_bias_linear ([model]): the MLP's fc1 has no bias without it"
    if name == QK_NORM and not model.qk_layernorm:
        return f"{name!r} needs qk_layernorm ([model]): the attention has no query norm without it"
    if name == GLU:
        if model.num_experts:
            return f"{name!r} is planted on the dense MLP's fc1: an MoE model ([model].num_experts) has none"
        if model.activation not in GATED:
            return (f"{name!r} needs a gated activation ([model].activation swiglu or geglu), not "
                    f"{model.activation!r}")
        rows = 2 * model.ffn_hidden_size // side.tp
        if not (_unpadded(rows, side) and side.gtp % 2 == 0):  # the halves: whole shards
            return (f"{name!r} needs the gate/up boundary on a GTP shard boundary: fc1's TP block of "
                    f"{rows} rows with no pad rows (a multiple of gtp_pad_alignment x G) and an even G, "
                    f"here G = {side.gtp}")
    if name == QKV:
        if model.num_query_groups is None:
            return f"{name!r} needs grouped-query attention ([model].num_query_groups)"
        groups = model.num_query_groups // side.tp
        head = model.hidden_size // model.num_attention_heads
        rows = model.hidden_size // side.tp + 2 * groups * head
        if not (_unpadded(rows, side) and groups % side.gtp == 0):  # whole groups per shard
            return (f"{name!r} needs whole query groups on each GTP shard: the TP block's {groups} groups "
                    f"({rows} rows) a multiple of G = {side.gtp}, with no pad rows")
    return _vocab_reach(name, side, model) if name == VOCAB else None


def _vocab_reach(name: str, side, model) -> str | None:
    multiple = model.make_vocab_size_divisible_by * side.tp
    rows = -(-model.vocab_size // multiple) * multiple // side.tp  # the output layer's TP block
    if rows * side.tp == model.vocab_size:
        return (f"{name!r} needs a padded vocabulary (vocab_size {model.vocab_size} is not padded at "
                f"TP {side.tp})")
    align = side.gtp_pad_alignment * side.gtp
    pad = (-rows) % align if align else 0
    if not 0 < pad < rows:
        return (f"{name!r} needs GTP pad rows behind the output layer's TP block of {rows} rows, fewer "
                f"than its rows (gtp_pad_alignment x G = {align})")
    return None


def _expert_glu_reach(side, model) -> str | None:
    name = EXPERT_GLU
    if side.backend != "megatron" or side.expert_gtp == 1 or side.ep != 1:
        return (f"{name!r} is planted on a megatron side with expert GTP (expert_gtp > 1) at EP 1 (expert 0 "
                "on every rank)")
    if not model.num_experts or model.activation not in GATED:
        return f"{name!r} needs routed experts ([model].num_experts) with a gated activation (swiglu, geglu)"
    rows, g = 2 * model.ffn_hidden_size, side.expert_gtp
    if not ((rows % (side.gtp_pad_alignment * g) == 0 if side.gtp_pad_alignment else rows % g == 0)
            and g % 2 == 0):
        return (f"{name!r} needs the gate/up boundary on an expert GTP shard boundary: the expert's fc1 of "
                f"{rows} rows with no pad rows (a multiple of gtp_pad_alignment x EG) and an even EG, here "
                f"EG = {g}")
    return None
