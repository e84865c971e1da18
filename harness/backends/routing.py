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
from torch.distributed.tensor import Replicate

from harness.capture.api import Capture
from harness.common.layout import Layout

LOGITS, ROUTING_MAP, TOKENS_PER_EXPERT, AUX_LOSS = "logits", "routing_map", "tokens_per_expert", "aux_loss"


def router_name(layer: int, what: str) -> str:
    """The captured name of a router quantity (``decoder.layers.0.mlp.router.logits``)."""
    return f"decoder.layers.{layer}.mlp.router.{what}"


def _record(cap: Capture, name: str, value: torch.Tensor, sample_ids: tuple[int, ...]) -> None:
    if cap.step is None or cap.micro_batch_index is None or not cap.wants("activation", name):
        return
    layout = Layout(tuple(value.shape), {"tp": cap.mesh.get("tp", 1)}, {"tp": Replicate()})
    cap.tensor("activation", name, value, layout=layout, micro_batch=cap.micro_batch_index,
               sample_ids=sample_ids)


def record_routing(cap: Capture, layer: int, logits: torch.Tensor, routing_map: torch.Tensor,
                   seq_length: int, sample_ids: tuple[int, ...]) -> None:
    """``logits`` and ``routing_map`` are [tokens, experts] with tokens in megatron-core's
    [s, b] order (token = s_i * b + b_i), for the samples ``sample_ids`` (b of them)."""
    if torch._C._current_graph_task_id() != -1:
        return  # a recompute inside backward: recorded once, at the forward
    b = len(sample_ids)
    per_sample = lambda t: t.detach().reshape(seq_length, b, -1).transpose(0, 1)  # noqa: E731
    chosen = per_sample(routing_map).to(torch.float32)
    _record(cap, router_name(layer, LOGITS), per_sample(logits), sample_ids)
    _record(cap, router_name(layer, ROUTING_MAP), chosen, sample_ids)
    _record(cap, router_name(layer, TOKENS_PER_EXPERT), chosen.sum(1), sample_ids)


def record_aux_loss(cap: Capture, layer: int, aux_loss: torch.Tensor, sample_ids: tuple[int, ...]) -> None:
    """The load-balancing loss (coefficient included) of each sample's micro-batch: one value for
    the whole micro-batch, or one per sample ([b])."""
    if torch._C._current_graph_task_id() != -1:
        return
    value = aux_loss.detach().reshape(-1).expand(len(sample_ids)).clone()
    _record(cap, router_name(layer, AUX_LOSS), value, sample_ids)
