"""What the architecture switches imply of the model megatron-core builds, written out by hand
(shapes, placements, the load-balancing loss), not read from the harness's parameter specs: a
wrong spec there fails the tests of tests/test_architectures.py that read these."""

from __future__ import annotations

import torch

from harness.capture import trace


def expected_linear(m, tp: int, etp: int | None = None) -> dict[str, tuple[tuple[int, ...], dict]]:
    """Layer 0's linear parameters the switches imply, as megatron-core's local spec builds them:
    name -> (TP-local shape at GTP off, placements). Written out here, not read from the harness's
    parameter specs, so a wrong spec there fails this test."""
    h, f = m.hidden_size, m.ffn_hidden_size
    # per query group: its query heads, a key head, a value head
    qkv = h + 2 * (m.num_query_groups or m.num_attention_heads) * (h // m.num_attention_heads)
    col, row = ({"tp": "S(0)"}, {"tp": "S(1)"}) if tp > 1 else ({}, {})
    # A gated fc1 is [gate; up]: twice the rows, each half cut over TP (partition_stride 2).
    k = 2 if m.activation in ("swiglu", "geglu") else 1
    fc1 = {**col, **({"strides": {"tp": 2}} if k == 2 and tp > 1 else {})}
    p = "decoder.layers.0."
    mlp = expected_moe(m, tp, tp if etp is None else etp) if m.num_experts else None
    out = {p + "self_attention.linear_qkv.weight": ((qkv // tp, h), col),
           p + "self_attention.linear_proj.weight": ((h, h // tp), row),
           **(mlp if mlp is not None else {p + "mlp.linear_fc1.weight": ((k * f // tp, h), fc1),
                                           p + "mlp.linear_fc2.weight": ((h, f // tp), row)})}
    if m.add_bias_linear or m.add_qkv_bias:
        out[p + "self_attention.linear_qkv.bias"] = ((qkv // tp,), col)
    if m.add_bias_linear:
        out[p + "self_attention.linear_proj.bias"] = ((h,), {})
        out[p + "mlp.linear_fc1.bias"] = ((k * f // tp,), fc1)
        out[p + "mlp.linear_fc2.bias"] = ((h,), {})
    for norm in ("input_layernorm", "pre_mlp_layernorm"):  # RMSNorm: a weight, no bias
        out[p + norm + ".weight"] = ((h,), {})
        if m.normalization == "LayerNorm":
            out[p + norm + ".bias"] = ((h,), {})
    head = h // m.num_attention_heads
    # qk_layernorm: over the head dim, whole on every rank
    for norm in ("q_layernorm", "k_layernorm") if m.qk_layernorm else ():
        out[p + "self_attention." + norm + ".weight"] = ((head,), {})
        if m.normalization == "LayerNorm":
            out[p + "self_attention." + norm + ".bias"] = ((head,), {})
    if m.softmax_type == "learnable":  # one offset logit per head, each TP rank its own heads'
        out[p + "self_attention.core_attention.softmax_offset"] = ((m.num_attention_heads // tp,), col)
    return out


def expected_moe(m, tp: int = 1, etp: int = 1) -> dict[str, tuple[tuple[int, ...], dict]]:
    """Layer 0's MoE layer at GTP off, EP 1, as megatron-core's local spec builds it: the router [E, h]
    whole on every rank, each routed expert's MLP (fc1 [gate; up] when gated) cut over the expert TP
    group as the dense MLP is over TP, the shared experts' MLP of moe_shared_expert_intermediate_size
    where set (cut over TP)."""
    h, f, shared = m.hidden_size, m.ffn_hidden_size, m.moe_shared_expert_intermediate_size
    p = "decoder.layers.0.mlp."
    k = 2 if m.activation in ("swiglu", "geglu") else 1

    strided = {"tp": "S(0)", **({"strides": {"tp": 2}} if k == 2 else {})}  # column-parallel, by halves
    out = {p + "router.weight": ((m.num_experts, h), {})}
    col, row = (strided, {"tp": "S(1)"}) if etp > 1 else ({}, {})
    for e in range(m.num_experts):
        out[f"{p}experts.local_experts.{e}.linear_fc1.weight"] = ((k * f // etp, h), col)
        out[f"{p}experts.local_experts.{e}.linear_fc2.weight"] = ((h, f // etp), row)
    col, row = (strided, {"tp": "S(1)"}) if tp > 1 else ({}, {})
    if shared:
        out[p + "shared_experts.linear_fc1.weight"] = ((k * shared // tp, h), col)
        out[p + "shared_experts.linear_fc2.weight"] = ((h, shared // tp), row)
    return out


def params_at(path: str, step: int = 0) -> dict[str, tuple[tuple[int, ...], dict]]:
    """Rank 0's parameters at ``step`` in a trace: name -> (shard shape, placements, and the
    layout's strides where it has any)."""
    t = trace.read(path)
    return {e.name: (tuple(e.local_shape), placed(e.layout.to_json())) for e in t.entries
            if e.kind == "param" and e.step == step and e.rank == 0}


def placed(doc: dict) -> dict:
    return {**doc["placements"], **({"strides": doc["strides"]} if "strides" in doc else {})}


def expert_cut(rows: int, cols: int, etp_dim: int, etp: int, eg: int) -> tuple:
    """A weight of [rows, cols] cut by (expert) TP on ``etp_dim``, then its TP-local block padded on dim 0
    to a multiple of 16 x EG (the default alignment) and cut EG ways: (rank 0's shard shape, logical
    shape, placements, pads)."""
    local, placements, pads = [rows, cols], {"tp": f"S({etp_dim})"} if etp > 1 else {}, {}
    local[etp_dim] //= etp
    if eg > 1:
        unit = 16 * eg
        padded = -(-local[0] // unit) * unit
        placements["gtp"], pads["gtp"], local[0] = "S(0)", padded - local[0], padded // eg
    return tuple(local), [rows, cols], placements, pads


def aux_loss(m, logits: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """megatron-core's load-balancing loss of one micro-batch, written out (in fp64) from its own recorded
    logits [t, E] over the tokens ``kept`` [t] (moe_utils.compute_routing_scores_for_aux_loss and
    switch_load_balancing_loss_func: the softmax scores and their plain top-k, both zeroed off ``kept``,
    T the kept tokens)."""
    scores = torch.softmax(logits.double(), dim=-1)
    chosen = torch.zeros_like(scores).scatter(1, scores.topk(m.moe_topk, dim=1)[1], 1.0)
    scores, chosen, t = scores[kept], chosen[kept], kept.sum().double()
    return (scores.sum(0) * chosen.sum(0)).sum() * m.num_experts * m.moe_aux_loss_coeff / (m.moe_topk * t * t)
