"""The rules of GTP's other code paths (megatron-core's switches a side may turn) beyond what
their declarations say (choices, backends, the rules between two keys: :mod:`harness.scenario.side`):
megatron-core's guards over several keys, the loss mask and a caller-supplied process-group
collection. Part of :mod:`harness.scenario.rules`."""

from __future__ import annotations

from harness.common.errors import BadInput
from harness.scenario.schema import Scenario, Side


def validate_paths(s: Scenario, side: Side, where: str) -> None:
    """GTP's other code paths: the megatron backend's switches, with megatron-core's own guards."""
    if side.sequence_parallel and s.model.seq_length * s.data.micro_batch_size % side.tp:
        raise BadInput(f"{where}.sequence_parallel",
                       f"TP {side.tp} must divide the sequence length {s.model.seq_length}")
    _validate_loss_mask(s, side, where)
    _validate_process_groups(side, where)


def _validate_process_groups(side: Side, where: str) -> None:
    """A caller-supplied collection is built for the dense decoder's axes (TP, GTP, DP)."""
    if side.process_groups == "parallel-state":
        return
    if side.pipeline_parallel > 1 or side.ep * side.expert_gtp > 1 or side.save_step or side.load_step:
        raise BadInput(f"{where}.process_groups",
                       "a caller-supplied collection is built here for TP x GTP x DP "
                       "only: not with pipeline stages, experts or checkpoints")
    if side.process_groups == "collection-permuted" and (side.gtp == 1 or side.replicate_dp == 1):
        raise BadInput(f"{where}.process_groups",
                       "collection-permuted pairs GTP peers across replicate DP: it "
                       f"needs G > 1 and DP > 1 (got G {side.gtp}, DP {side.replicate_dp})")


def _validate_loss_mask(s: Scenario, side: Side, where: str) -> None:
    """A variable loss mask needs a loss normalized by the global token count on every side,
    as the golden computes it."""
    mask = s.data.loss_mask
    if mask == "none":
        return
    if side.backend == "megatron" and side.per_token_loss == "none":
        # megatron-core's mean loss averages each micro-batch's token mean: with token counts
        # differing per micro-batch that is another objective than the global token mean.
        raise BadInput(f"{where}.per_token_loss",
                       "a variable loss mask needs per_token_loss (\"both\" or \"transformer-config\"): "
                       "the mean loss averages per-micro-batch token means, not the global token mean")
    if side.backend == "mlm":
        raise BadInput(f"{s.source}: [data].loss_mask", "the mlm backend reads Megatron-LM's own loss mask")
    if side.backend == "torch" and (side.world_size > 1 or side.recipe != "none" or side.precision == "bf16"):
        raise BadInput(f"{s.source}: [data].loss_mask",
                       "the torch backend applies a loss mask on its single-process golden path only "
                       "(world_size 1, no recipe, fp32 or fp64)")
