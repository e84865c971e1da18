"""What the multi-token prediction (MTP) block records, in every backend, named per depth.

megatron-core's GPTModel and the golden GPT both run, per forward: the decoder, then the MTP
block's depths in order (under ``mtp_use_repeated_layer`` one layer object at every depth),
then the output layer once per depth and once for the main head. A hook on a module fires
once per call, so the names here come from call order, not from the module: the MTP layer's
modules record as ``mtp.layers.{depth}.<module>`` (:mod:`harness.common.mtp`), the embedding's
first call as ``embedding`` and depth d's as ``mtp.layers.{d}.embedding``, the output
layer's first D calls as each depth's logits and its last as ``output_layer``, and each
depth's per-sample loss as kind ``mtp_loss``. A pre-hook on the model starts every forward at
depth 0; a recompute inside backward advances nothing (:meth:`Capture.output` skips it too).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate

from harness.capture.api import Capture
from harness.common import mtp as names
from harness.common.layout import Layout


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class DepthCapture:
    """The depth counters of one model's forward and the hooks that read them."""

    def __init__(self, cap: Capture, depths: int, sequence_parallel: bool = False,
                 decoder_embeds: bool = True):
        # Under sequence parallelism the embedding's and the MTP layers' outputs are cut over TP by
        # sequence, as the decoder's are (the output layer gathers the sequence first).
        self.cap, self.depths, self.sp = cap, depths, sequence_parallel
        # On the MTP stage of a pipeline the embedding (a copy of the first stage's) embeds only
        # the depths' shifted inputs: its first call is depth 0's.
        self.first_depth_call = 1 if decoder_embeds else 0
        self.depth = self.output_calls = self.embedding_calls = self.loss_calls = 0

    def start(self, *unused) -> None:
        if not in_backward():
            self.depth = self.output_calls = self.embedding_calls = self.loss_calls = 0

    def module_hook(self, module_name: str):
        def hook(module, args, output):
            self.cap.output("activation", names.depth_name(self.depth, module_name), output, self.sp)
            if not module_name and not in_backward():
                self.depth += 1  # the MTP layer itself finishes its depth
        return hook

    def embedding_hook(self, module, args, output) -> None:
        depth = self.embedding_calls - self.first_depth_call  # the decoder's input, then each depth's
        self.cap.output("activation", "embedding" if depth < 0 else names.depth_name(depth, "embedding"),
                        output, self.sp)
        if not in_backward():
            self.embedding_calls += 1

    def output_layer_hook(self, module, args, output) -> None:
        calls = self.output_calls
        name = names.logits_name(calls) if calls < self.depths else "output_layer"
        self.cap.output("logits", name, output)
        if not in_backward():
            self.output_calls += 1

    def record_loss(self, depth: int, per_sample: torch.Tensor) -> None:
        """Depth ``depth``'s loss of each sample of the micro-batch ([b]): its token mean over the
        positions the depth's rolled loss mask keeps, unscaled."""
        cap = self.cap
        name = names.loss_name(depth)
        if (in_backward() or cap.step is None or cap.micro_batch_index is None
                or not cap.wants(names.LOSS_KIND, name)):
            return
        value = per_sample.detach().reshape(-1)
        layout = Layout(tuple(value.shape), {"tp": cap.mesh.get("tp", 1)}, {"tp": Replicate()})
        cap.tensor(names.LOSS_KIND, name, value, layout=layout, micro_batch=cap.micro_batch_index,
                   sample_ids=cap.sample_ids)


def attach(cap: Capture, model, depths: int, modules: dict, sequence_parallel: bool = False,
           decoder_embeds: bool = True) -> DepthCapture | None:
    """Hook ``model``'s MTP block, embedding and output layer (``model.mtp.layers``, as
    megatron-core names them); ``modules``, the plain captured modules, loses its ``embedding``
    and ``output_layer`` entries, which this names per call. ``decoder_embeds``: the model's
    embedding also embeds the decoder's input (not on the MTP stage of a pipeline). None without MTP."""
    if not depths:
        return None
    state = DepthCapture(cap, depths, sequence_parallel, decoder_embeds)
    modules.pop("output_layer", None)
    modules.pop("embedding", None)
    # The hooks live as long as the model (one side's).
    model.register_forward_pre_hook(state.start)
    model.embedding.register_forward_hook(state.embedding_hook)
    model.output_layer.register_forward_hook(state.output_layer_hook)
    for layer in model.mtp.layers:
        layer.register_forward_hook(state.module_hook(""))
        for sub in names.LAYER_MODULES:
            layer.get_submodule(sub).register_forward_hook(state.module_hook(sub))
    return state


def shifted(t: torch.Tensor, depth: int) -> torch.Tensor:
    """The labels or loss mask [b, s] megatron-core applies at ``depth`` (0-based): shifted left
    by ``depth + 1`` positions, the positions shifted in zero (``roll_tensor``, once per depth)."""
    out = torch.roll(t, shifts=-(depth + 1), dims=-1)
    out[..., t.shape[-1] - depth - 1:] = 0
    return out


def per_sample(losses: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token mean of per-token ``losses`` [b, s] over ``mask`` [b, s], per sample."""
    return (losses * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def depth_objective(losses: torch.Tensor, kept: torch.Tensor, mask: torch.Tensor,
                    variable: bool) -> torch.Tensor:
    """One depth's term of megatron-core's MTP objective (before ``mtp_loss_scaling_factor / D``),
    over a global batch of micro-batches of one sample: per-token ``losses`` [b, s], the depth's
    rolled mask ``kept`` and the unrolled ``mask``. The mean loss (``variable`` False: every
    micro-batch counts the same tokens) averages the micro-batches' token means, which is the
    global token mean. Under a per-token loss (the only one a variable mask runs with)
    ``process_mtp_loss`` scales each micro-batch's token sum by ``original_num_tokens /
    num_tokens`` and finalize divides by the global token count: each sample's token mean
    weighted by its share of the unrolled tokens."""
    if not variable:
        return (losses * kept).sum() / kept.sum().clamp(min=1)
    return (per_sample(losses, kept) * mask.sum(-1)).sum() / mask.sum()
