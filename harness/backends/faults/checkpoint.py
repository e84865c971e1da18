"""Planted faults of checkpoints saved from expert-parallel and pipelined runs (shard ordering):
run-time wraps of megatron-core's ``sharded_state_dict`` methods on the saving side, undone
with the side's other patches. Each saves correct data under the wrong global index, in the
model's sharded tensors and so in the optimizer's built on them (``make_sharded_optimizer_tensor``
copies the model tensor's offsets): a loader reads another expert's or layer's weights and
Adam moments, with no error from megatron-core's access-pattern validation (every index is
still written once)."""

from __future__ import annotations

from harness.backends.patching import patch


def _shift_axis(state: dict, axis: int, new_index, keep=lambda key: True) -> None:
    """Replace the global offset on ``axis`` (a prepended axis: an expert or layer index) of
    every sharded tensor and object of ``state`` whose key ``keep`` accepts."""
    for entry in state.values():
        offset = getattr(entry, "global_offset", None)
        if offset is None or len(offset) <= axis or not keep(entry.key):
            continue
        entry.global_offset = (*offset[:axis], new_index(offset[axis]), *offset[axis + 1:])


def _expert_index_shifted(ctx) -> None:
    # SequentialMLP.sharded_state_dict names local expert i of EP rank r as global expert
    # r * E/EP + i on the axis after the offsets it is handed; here it counts from EP rank r + 1.
    from megatron.core.transformer.moe.experts import SequentialMLP

    if not ctx.side.save_step:  # the loader carries the fault to its saver; it loads as built
        return

    original = SequentialMLP.sharded_state_dict

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        state = original(self, prefix, sharded_offsets, metadata)
        experts = self.ep_group.size() * self.num_local_experts
        _shift_axis(state, len(sharded_offsets), lambda e: (e + self.num_local_experts) % experts)
        return state

    patch(SequentialMLP, "sharded_state_dict", sharded_state_dict)


def _stage_layers_mirrored(ctx) -> None:
    # TransformerBlock.sharded_state_dict stacks its layers on axis 0 at their global layer
    # number; here each stage's offset is counted from the last stage: stage p of P saves its
    # layer p * L/P + j as layer (P - 1 - p) * L/P + j.
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_block import TransformerBlock

    if not ctx.side.save_step:
        return

    original = TransformerBlock.sharded_state_dict

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        state = original(self, prefix, sharded_offsets, metadata)
        stages, stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
        per = self.config.num_layers // stages
        _shift_axis(state, 0, lambda layer: (stages - 1 - stage) * per + layer - stage * per,
                    keep=lambda key: key.startswith(f"{prefix}layers."))
        return state

    patch(TransformerBlock, "sharded_state_dict", sharded_state_dict)


CHECKPOINT_INSTALLERS = {
    "ckpt-expert-index-shifted": _expert_index_shifted,
    "ckpt-stage-layers-mirrored": _stage_layers_mirrored,
}
