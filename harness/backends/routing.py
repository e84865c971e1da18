"""What a routed MoE layer records, per sample, in every backend: its router logits, which
experts each token went to, the per-expert token counts, and the load-balancing loss.

All are stored [batch, ...] and tagged with the micro-batch's global sample ids, so traces of
different layouts (EP, expert GTP, micro-batch counts) line up sample by sample, as
activations do. The load-balancing loss is one value per micro-batch (megatron-core computes
it over the micro-batch's tokens): each sample of the micro-batch carries it, so two sides
whose micro-batches hold the same samples compare it sample by sample.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from harness.capture.api import Capture
from harness.common.layout import Layout

LOGITS, ROUTING_MAP, TOKENS_PER_EXPERT, AUX_LOSS = "logits", "routing_map", "tokens_per_expert", "aux_loss"


def router_name(layer: int, what: str) -> str:
    """The captured name of a router quantity (``decoder.layers.0.mlp.router.logits``)."""
    return f"decoder.layers.{layer}.mlp.router.{what}"


def _record(cap: Capture, name: str, value: torch.Tensor, sample_ids: tuple[int, ...],
            over_tp: Placement = Replicate()) -> None:
    """``over_tp``: how the TP ranks' values make the logical one (sequence parallelism gives each
    its tokens: ``Shard(1)`` of [b, s, ...], or a part of a sum over them: ``Partial("sum")``)."""
    if cap.step is None or cap.micro_batch_index is None or not cap.wants("activation", name):
        return
    tp, shape = cap.mesh.get("tp", 1), list(value.shape)
    if isinstance(over_tp, Shard):
        shape[over_tp.dim] *= tp
    layout = Layout(tuple(shape), {"tp": tp}, {"tp": over_tp})
    cap.tensor("activation", name, value, layout=layout, micro_batch=cap.micro_batch_index,
               sample_ids=sample_ids)


def record_routing(cap: Capture, layer: int, logits: torch.Tensor, routing_map: torch.Tensor,
                   seq_length: int, sample_ids: tuple[int, ...], sequence_parallel: bool = False) -> None:
    """``logits`` and ``routing_map`` are [tokens, experts] with tokens in megatron-core's
    [s, b] order (token = s_i * b + b_i), for the samples ``sample_ids`` (b of them); under
    ``sequence_parallel`` a TP rank's s / TP of the positions (its sequence chunk)."""
    if torch._C._current_graph_task_id() != -1:
        return  # a recompute inside backward: recorded once, at the forward
    b, split = len(sample_ids), sequence_parallel and cap.mesh.get("tp", 1) > 1
    local = seq_length // cap.mesh["tp"] if split else seq_length
    per_sample = lambda t: t.detach().reshape(local, b, -1).transpose(0, 1)  # noqa: E731
    chosen = per_sample(routing_map).to(torch.float32)
    cut, part = (Shard(1), Partial("sum")) if split else (Replicate(), Replicate())
    _record(cap, router_name(layer, LOGITS), per_sample(logits), sample_ids, cut)
    _record(cap, router_name(layer, ROUTING_MAP), chosen, sample_ids, cut)
    _record(cap, router_name(layer, TOKENS_PER_EXPERT), chosen.sum(1), sample_ids, part)


def record_aux_loss(cap: Capture, layer: int, aux_loss: torch.Tensor, sample_ids: tuple[int, ...],
                    sequence_parallel: bool = False) -> None:
    """The load-balancing loss (coefficient included) of each sample's micro-batch: one value for
    the whole micro-batch, or one per sample ([b]). Under ``sequence_parallel`` each TP rank's is
    its tokens' part (megatron-core's ``switch_load_balancing_loss_func`` over the local probs
    with the TP group's token counts), summed over TP."""
    if torch._C._current_graph_task_id() != -1:
        return
    value = aux_loss.detach().reshape(-1).expand(len(sample_ids)).clone()
    split = sequence_parallel and cap.mesh.get("tp", 1) > 1
    _record(cap, router_name(layer, AUX_LOSS), value, sample_ids, Partial("sum") if split else Replicate())
