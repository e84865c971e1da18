"""The megatron backend's MoE layer: megatron-core's own router, dispatcher and experts.

The local layer spec with ``num_experts`` (``get_gpt_layer_local_spec(num_experts=E,
moe_grouped_gemm=False)``): ``TopKRouter`` (softmax over the top-k logits, ``aux_loss`` load
balancing), the ``alltoall`` token dispatcher over the EP group and ``SequentialMLP`` experts,
each a local-spec MLP (gated as the dense one is: fc1 ``[gate; up]``) whose weights megatron-core
GTP-shards over the *expert* GTP group (``expert_tensor_parallel_num_weight_shards``,
``initialize_model_parallel(expert_gtp_remat_size=)``); with ``moe_shared_expert_intermediate_size``
``SharedExpertMLP`` (``mlp.shared_experts``: not an expert's module, cut by TP and the dense GTP
group), and the router's score function and group-limited top-k as ``[model]`` says.

This module supplies the configuration, names each expert by its global index (rank ep's
local expert i is expert ``ep * E / EP + i``), reads each expert weight's layout off
megatron-core's attributes, and records the router's logits, routing and load-balancing
loss (:mod:`harness.backends.routing`) by wrapping the router's methods of this model only.
"""

from __future__ import annotations

import re

import torch
from torch.distributed.tensor import Shard

from harness.backends.routing import record_aux_loss, record_routing
from harness.capture.api import Capture
from harness.common.layout import Layout

_LOCAL_EXPERT = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)(\.)")


def is_moe(job) -> bool:
    return job.model.num_experts > 0


def parallel_kwargs(side) -> dict:
    """``initialize_model_parallel``'s expert arguments."""
    return {"expert_model_parallel_size": side.ep, "expert_tensor_parallel_size": side.etp,
            "expert_gtp_remat_size": side.expert_gtp}


def config_kwargs(job) -> dict:
    """TransformerConfig's MoE fields (none for a dense model)."""
    m, side = job.model, job.side
    if not is_moe(job):
        return {}
    return {
        "num_moe_experts": m.num_experts,
        "moe_router_topk": m.moe_topk,
        "moe_ffn_hidden_size": m.ffn_hidden_size,
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": m.moe_aux_loss_coeff,
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False,
        "expert_model_parallel_size": side.ep,
        "expert_tensor_parallel_size": side.etp,
        "expert_tensor_parallel_num_weight_shards": side.etp * side.expert_gtp,
        "moe_shared_expert_intermediate_size": m.moe_shared_expert_intermediate_size,
        "moe_router_score_function": m.moe_router_score_function,
        "moe_router_num_groups": m.moe_router_num_groups,
        "moe_router_group_topk": m.moe_router_group_topk,
    }


def layer_spec(job):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    qk = {"qk_layernorm": True} if job.model.qk_layernorm else {}  # q_layernorm / k_layernorm
    if not is_moe(job):
        return get_gpt_layer_local_spec(**qk)
    return get_gpt_layer_local_spec(num_experts=job.model.num_experts, moe_grouped_gemm=False, **qk)


def forward_kwargs(m, loss_mask: torch.Tensor) -> dict:
    """GPTModel.forward's ``padding_mask`` with ``moe_router_padding_mask``: [b, s], True where the loss
    mask drops the token (megatron-core's convention: True = padding, excluded; ``~padding_mask``
    counts the kept tokens in router.py and moe_utils.py)."""
    return {"padding_mask": loss_mask == 0} if m.moe_router_padding_mask else {}


def uses_gtp(side) -> bool:
    """Whether any weight is GTP-sharded: dense GTP or expert GTP."""
    return side.gtp > 1 or side.expert_gtp > 1


def global_name(name: str, job) -> str:
    """An expert parameter's name with its global expert index (other names unchanged)."""
    match = _LOCAL_EXPERT.search(name)
    if match is None:
        return name
    from megatron.core import parallel_state as ps

    per_rank = job.model.num_experts // job.side.ep
    index = ps.get_expert_model_parallel_rank() * per_rank + int(match.group(2))
    return name[: match.start(2)] + str(index) + name[match.end(2):]


def reset_metrics_tracker() -> None:
    """Forget megatron-core's MoE metrics tracker, a process-global whose per-layer buffers are
    sized by the first model that records into it (``MoEMetricsTracker.record``): the next side in
    this process (a warm worker's) may have more layers, and its last pipeline stage raised
    ``IndexError`` recording layer 2 into a buffer of 1."""
    try:
        from megatron.core.transformer.moe import moe_logging
    except ImportError:  # a tree without the tracker
        return
    moe_logging.destroy_moe_metrics_tracker()


def mcore_layout(p: torch.Tensor, ours: Layout) -> Layout:
    """An expert weight's layout as megatron-core built it, on ``ours``'s grid: the EGTP cut and pad
    read off the parameter (``is_gtp_weight_remat``, ``pad_length``), and the expert TP cut
    (``tensor_model_parallel``, ``partition_dim``, ``partition_stride``: fc1 column-parallel, a gated
    one with stride 2, fc2 row-parallel over the expert TP group); the EP coordinate is ``ours``'s
    (the global name already encodes it)."""
    shape, placements, pads, strides = list(p.shape), {}, {}, {}
    if getattr(p, "is_gtp_weight_remat", False):
        placements["gtp"], pads["gtp"] = Shard(0), int(getattr(p, "pad_length", 0))
        shape[0] = shape[0] * ours.mesh.get("gtp", 1) - pads["gtp"]
    if getattr(p, "tensor_model_parallel", False) and (etp := ours.mesh.get("tp", 1)) > 1:
        placements["tp"], shape[p.partition_dim] = Shard(p.partition_dim), shape[p.partition_dim] * etp
        if (stride := int(getattr(p, "partition_stride", 1))) != 1:
            strides["tp"] = stride
    return Layout(tuple(shape), dict(ours.mesh), placements, pads, grid=ours.grid, fixed=dict(ours.fixed),
                  strides=strides)


def attach_router_capture(model, cap: Capture, seq_length: int, sequence_parallel: bool = False) -> None:
    """Record every MoE layer's router logits, routing and load-balancing loss, per micro-batch (under
    sequence parallelism a TP rank routes its sequence chunk)."""
    for i, layer in enumerate(model.decoder.layers):
        router = getattr(layer.mlp, "router", None)
        if router is not None:
            _wrap_router(router, i, cap, seq_length, sequence_parallel)


def _wrap_router(router, layer: int, cap: Capture, seq_length: int, sp: bool) -> None:
    # Instance attributes: this model's routers only, gone with the model.
    routing, attach = router.routing, router.attach_and_log_load_balancing_loss

    def routing_and_record(logits, *args, **kwargs):
        probs, routing_map = routing(logits, *args, **kwargs)
        if cap.sample_ids is not None:
            flat = logits.reshape(-1, logits.shape[-1])
            record_routing(cap, layer, flat, routing_map, seq_length, cap.sample_ids, sp)
        return probs, routing_map

    def attach_and_record(activation, aux_loss_coeff, aux_loss, *args, **kwargs):
        if cap.sample_ids is not None:
            record_aux_loss(cap, layer, aux_loss, cap.sample_ids, sp)
        return attach(activation, aux_loss_coeff, aux_loss, *args, **kwargs)

    router.routing = routing_and_record
    router.attach_and_log_load_balancing_loss = attach_and_record


def expert_layouts(job, named) -> dict[str, Layout]:
    """The layouts of the expert weights among ``named`` (global names), as the harness lays them out
    (checked against megatron-core's at load)."""
    from harness.backends.gpt import layout_of, param_specs

    specs = {s.name: s for s in param_specs(job.model) if s.expert is not None}
    return {n: layout_of(specs[n], job.side, job.model.num_experts) for n, _ in named if n in specs}
