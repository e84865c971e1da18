"""The megatron backend's multi-token prediction: megatron-core's own MTP block.

``get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=False)`` on the local spec
(each MTP layer's transformer layer is the decoder's last layer spec: dense or MoE), handed to
``GPTModel(mtp_block_spec=)``; TransformerConfig's ``mtp_num_layers``,
``mtp_use_repeated_layer`` and ``mtp_loss_scaling_factor``. megatron-core computes each depth's
loss in ``process_mtp_loss`` and adds its gradient through ``MTPLossAutoScaler`` (the schedule
sets its scale, 1 / micro-batches). This module also records each depth's per-sample loss:
the model's ``compute_language_model_loss`` is called once per depth, in order, before the
main head's, and the wrapper here (an attribute of this model only) reads its per-token losses
under the depth's rolled loss mask.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from harness.backends import mtp as depths
from harness.capture.api import Capture


def config_kwargs(job) -> dict:
    """TransformerConfig's MTP fields (none without MTP)."""
    m = job.model
    if not m.mtp_num_layers:
        return {}
    return {"mtp_num_layers": m.mtp_num_layers, "mtp_use_repeated_layer": m.mtp_use_repeated_layer,
            "mtp_loss_scaling_factor": m.mtp_loss_scaling_factor}


def block_spec(job, config, layer_spec):
    """``GPTModel``'s ``mtp_block_spec`` (None without MTP)."""
    if not job.model.mtp_num_layers:
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    return get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=False)


def reset_tracker() -> None:
    """Forget MTP's loss-logging tracker, a process-global whose per-depth buffers are sized by
    the first model that logged into it (``MTPLossLoggingHelper.save_metrics_to_tracker``): the
    next side in this process may have another depth count."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()


def attach(model, cap: Capture, job, modules: dict, loss_mask: Callable[[], torch.Tensor]) -> None:
    """Record the MTP block's activations, logits and per-depth losses of ``model`` (the
    unwrapped GPTModel). ``loss_mask``: the micro-batch's loss mask [b, s] as the model gets it."""
    if not getattr(model, "mtp_process", False):  # a pipeline stage before the last: no MTP block
        return
    state = depths.attach(cap, model, job.model.mtp_num_layers, modules, job.side.sequence_parallel,
                          decoder_embeds=getattr(model, "pre_process", True))
    if state is None:
        return
    original = model.compute_language_model_loss

    def compute_language_model_loss(labels, logits):
        losses = original(labels, logits)
        if not depths.in_backward():
            depth, state.loss_calls = state.loss_calls, state.loss_calls + 1
            if depth < state.depths:
                state.record_loss(depth,
                                  depths.per_sample(losses.float(), depths.shifted(loss_mask(), depth)))
        return losses

    model.compute_language_model_loss = compute_language_model_loss
