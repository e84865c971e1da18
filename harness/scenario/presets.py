"""Model presets: ``[model].preset`` names a family, and the family's switches at tiny sizes fill
the keys the table does not set itself (a key beside the preset overrides it). Expanded while a
scenario is parsed, before anything else reads ``[model]``: the rules, the backends and the traces
see the switches, never the name alone. Torch-free.

Each family is written as its public configurations set megatron-core's switches; the sizes are
tiny and keep GTP's padding in play (vocabulary 72, FFN widths no multiple of 16 x G). What a
family has that the harness does not cover (DeepSeek's multi-latent attention) is left out and
said so here, never approximated by another switch.
"""

from __future__ import annotations

from typing import get_args

from harness.common.errors import BadInput, shown
from harness.scenario.choices import Preset

# Sizes every family shares: small enough for one CPU, padded under GTP.
_TINY = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 16, "vocab_size": 72}

PRESETS: dict[str, dict] = {
    # Megatron-LM's GPT defaults: linear biases, LayerNorm, GeLU, learned absolute positions,
    # multi-head attention, the output layer tied to the word embedding (Megatron-LM ties unless
    # --untie-embeddings-and-output-weights is given).
    "gpt": {**_TINY, "ffn_hidden_size": 256, "add_bias_linear": True, "activation": "gelu",
            "normalization": "LayerNorm", "position_embedding_type": "learned_absolute",
            "untie_embeddings": False},
    # Llama 3: no biases, RMSNorm, SwiGLU (FFN about 8/3 of the width), RoPE base 500000,
    # grouped-query attention, untied.
    "llama": {**_TINY, "ffn_hidden_size": 176, "activation": "swiglu", "normalization": "RMSNorm",
              "position_embedding_type": "rope", "rotary_base": 500000, "num_query_groups": 2,
              "untie_embeddings": True},
    # Qwen2.5's small models: Llama's switches with a bias on the fused QKV, RoPE base 1000000 and the
    # output layer tied to the word embedding.
    "qwen": {**_TINY, "ffn_hidden_size": 176, "activation": "swiglu", "normalization": "RMSNorm",
             "position_embedding_type": "rope", "rotary_base": 1000000, "num_query_groups": 2,
             "add_qkv_bias": True, "untie_embeddings": False},
    # Mixtral: Llama's dense part with routed SwiGLU experts, top-2 (8 experts there, 4 here).
    "mixtral": {**_TINY, "ffn_hidden_size": 112, "activation": "swiglu", "normalization": "RMSNorm",
                "position_embedding_type": "rope", "rotary_base": 1000000, "num_query_groups": 2,
                "untie_embeddings": True, "num_experts": 4, "moe_topk": 2},
    # DeepSeek-V3's MoE without multi-latent attention (not covered): RMSNorm, SwiGLU experts, RoPE,
    # untied, a shared expert, the sigmoid router's top-k within the best groups (256 experts in 8
    # groups, top-8 of the best 4 there; 8 in 4, top-4 of the best 2 here).
    "deepseek": {**_TINY, "ffn_hidden_size": 48, "activation": "swiglu", "normalization": "RMSNorm",
                 "position_embedding_type": "rope", "untie_embeddings": True, "num_experts": 8,
                 "moe_topk": 4, "moe_router_score_function": "sigmoid", "moe_router_num_groups": 4,
                 "moe_router_group_topk": 2, "moe_shared_expert_intermediate_size": 48},
}


def expand_preset(table: dict, where: str) -> dict:
    """``[model]`` with its preset's switches filled in under the keys it sets itself."""
    if not isinstance(table, dict) or table.get("preset") is None:
        return table
    name = table["preset"]
    if name not in get_args(Preset):
        raise BadInput(f"{where}.preset", f"must be one of {', '.join(map(repr, get_args(Preset)))}, "
                                          f"got {shown(name)}")
    return {**PRESETS[name], **table}
