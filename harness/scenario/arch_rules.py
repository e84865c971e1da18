"""The rules of the architecture switches ([model]'s biases, MLP, norm, positions, attention),
checked before anything is launched. Each is megatron-core 0.19.2's own constraint (its reason, as
``TransformerConfig.__post_init__`` or the layer states it) or a limit of what the harness covers,
said as such."""

from __future__ import annotations

from harness.common.errors import BadInput
from harness.scenario.arch_faults import arch_reach
from harness.scenario.schema import GATED, ModelConfig, Scenario, Side

# Megatron-LM's flags reach these activations (--swiglu, --squared-relu, gelu by default) and no other.
MLM_ACTIVATIONS = ("gelu", "swiglu", "squared_relu")


def validate_arch_model(s: Scenario) -> None:
    m, src = s.model, s.source
    if m.add_qkv_bias and m.add_bias_linear:
        raise BadInput(f"{src}: [model].add_qkv_bias",
                       "add_bias_linear already gives the fused QKV projection its bias: set one of the two")
    if m.num_experts and m.add_bias_linear:
        # megatron-core allows it at expert TP 1 (transformer_config.py: "Bias in Moe is only
        # supported when ETP==1"); the harness's expert parameters carry no bias yet.
        raise BadInput(f"{src}: [model].add_bias_linear",
                       "routed experts with linear biases are not covered yet")
    _validate_positions(s)
    if (g := m.num_query_groups) is not None and m.num_attention_heads % g:
        raise BadInput(f"{src}: [model].num_query_groups",
                       f"must divide num_attention_heads = {m.num_attention_heads} (each group's query heads "
                       "share its key and value)")


def _validate_positions(s: Scenario) -> None:
    m, src = s.model, s.source
    if m.position_embedding_type != "learned_absolute" and m.mtp_num_layers:
        raise BadInput(f"{src}: [model].position_embedding_type",
                       "MTP is covered with learned absolute positions only (its depths re-embed positions)")
    if m.position_embedding_type != "rope":
        for key, default in (("rotary_percent", 1.0), ("rotary_base", 10000)):
            if getattr(m, key) != default:
                raise BadInput(f"{src}: [model].{key}",
                               "takes effect only with position_embedding_type = \"rope\"")
        return
    head = m.hidden_size // m.num_attention_heads
    dim = int(head * m.rotary_percent) if m.rotary_percent < 1.0 else head
    if dim <= 0 or dim % 2:
        # megatron-core's RotaryEmbedding takes dim // 2 frequencies, each twice: an odd or empty
        # rotary dimension does not match the channels it rotates.
        raise BadInput(f"{src}: [model].rotary_percent",
                       f"the rotary dimension int(head dim {head} x {m.rotary_percent}) = {dim} must be even "
                       "and > 0")


def validate_arch_side(s: Scenario, side: Side, where: str) -> None:
    m = s.model
    for fault in side.inject:  # the planted faults that need a switch of [model] (arch_faults)
        if (problem := arch_reach(fault, side, m)) is not None:
            raise BadInput(f"{where}.inject", problem)
    if (g := m.num_query_groups) is not None and g % side.tp:
        # megatron-core takes a divisor of TP too (transformer_config.py: "num_query_groups must be a
        # multiple or divisor of tensor_model_parallel_size"), replicating key and value heads over TP.
        why = ("must be a multiple or divisor of tensor_model_parallel_size" if side.tp % g else
               "fewer query groups than TP ranks (key and value heads replicated over TP) are not covered "
               "yet")
        raise BadInput(f"{where}.tp", f"[model].num_query_groups = {g} with TP {side.tp}: {why}")
    if side.backend == "mlm" and m.activation not in MLM_ACTIVATIONS:
        reach = ", ".join(MLM_ACTIVATIONS)
        raise BadInput(f"{s.source}: [model].activation",
                       f"Megatron-LM's flags reach {reach} only, not {m.activation!r} ({where})")
    if side.optimizer == "muon" and m.activation in GATED:
        # Muon orthogonalizes each TP block; a gated fc1's TP block is [gate_r; up_r].
        raise BadInput(f"{where}.optimizer", f"Muon with a gated MLP ({m.activation}) is not covered yet")


def qkv_rows(m: ModelConfig) -> int:
    """Rows of the fused QKV: per query group its query heads, a key head and a value head."""
    head, groups = m.hidden_size // m.num_attention_heads, m.num_query_groups or m.num_attention_heads
    return m.hidden_size + 2 * groups * head


def arch_parameter_count(m: ModelConfig) -> int:
    """The parameters the architecture switches add per layer, over all layers (for the size limit)."""
    h, f = m.hidden_size, m.ffn_hidden_size
    k = 2 if m.activation in GATED else 1
    positions = 0 if m.position_embedding_type == "learned_absolute" else -m.seq_length * h
    qkv = qkv_rows(m)
    bias = (qkv if m.add_bias_linear or m.add_qkv_bias else 0) + (h + k * f + h if m.add_bias_linear else 0)
    norms = m.qk_layernorm * 2 * (1 if m.normalization == "RMSNorm" else 2) * (h // m.num_attention_heads)
    attention = norms + (m.num_attention_heads if m.softmax_type == "learnable" else 0)
    return m.num_layers * (bias + attention + (k - 1) * f * h + (qkv - 3 * h) * h) + positions
