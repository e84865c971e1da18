"""The golden's MoE layers in a step: their micro-batch size, what they record, and the
load-balancing loss they add to the loss the golden differentiates."""

from __future__ import annotations

import torch

from harness.backends.routing import record_aux_loss, record_routing
from harness.capture.api import Capture
from harness.scenario.schema import ModelConfig

from .moe import MoE


def _moe_layers(model) -> list[tuple[int, MoE]]:
    return [(i, layer.mlp) for i, layer in enumerate(model.decoder.layers) if isinstance(layer.mlp, MoE)]


def set_micro_batch_size(model, micro_batch_size: int) -> None:
    """The load-balancing loss is megatron-core's per micro-batch of this many samples."""
    mtp = [layer.mtp_model_layer.mlp for layer in model.mtp.layers] if hasattr(model, "mtp") else []
    for moe in [moe for _, moe in _moe_layers(model)] + [m for m in mtp if isinstance(m, MoE)]:
        moe.micro_batch_size = micro_batch_size


def set_loss_mask(model, mask: torch.Tensor | None) -> None:
    """The step's [b, s] variable loss mask (None: no mask): it weighs the load-balancing loss as
    megatron-core's per-token loss does, and with moe_router_padding_mask leaves its dropped tokens out."""
    for _, moe in _moe_layers(model):
        moe.kept = mask


def routed_aux_loss(model, cap: Capture, m: ModelConfig, sample_ids: tuple[int, ...]) -> torch.Tensor | float:
    """After a forward of the samples ``sample_ids``: record each MoE layer's router logits,
    routing and load-balancing loss, and return the sum of their losses (0 for a dense model)."""
    total = 0.0
    for i, moe in _moe_layers(model):
        record_routing(cap, i, moe.logits, moe.routing_map, m.seq_length, sample_ids)
        record_aux_loss(cap, i, moe.aux_per_sample, sample_ids)
        total = total + moe.aux_loss
    for aux in getattr(getattr(model, "mtp", None), "aux_losses", []):  # each MTP depth's (not recorded)
        total = total + aux
    return total
