"""The rules of GTP's other code paths (megatron-core's switches a side may turn): their choices,
the backends that take them, megatron-core's own guards between them, the loss mask and a
caller-supplied process-group collection. Part of :mod:`harness.scenario.rules`."""

from __future__ import annotations

from harness.common.errors import BadInput
from harness.scenario.schema import (
    COLLECTIVES, LOSS_MASKS, MEGATRON_PATH_OPTIONS, PER_TOKEN_LOSSES, PROCESS_GROUPS, RECOMPUTES, Scenario, Side,
)  # fmt: skip


# The Literal choices of the GTP path options (their types already refuse non-strings).
_PATH_CHOICES = {"gtp_collectives": COLLECTIVES, "recompute": RECOMPUTES, "per_token_loss": PER_TOKEN_LOSSES,
                 "process_groups": PROCESS_GROUPS}


def validate_paths(s: Scenario, side: Side, where: str) -> None:
    """GTP's other code paths: the megatron backend's switches, with megatron-core's own guards."""
    defaults = Side()
    for key, choices in _PATH_CHOICES.items():
        if getattr(side, key) not in choices:
            raise BadInput(f"{where}.{key}", f"{getattr(side, key)!r}: one of {sorted(choices)}")
    if side.backend != "megatron":
        for key in MEGATRON_PATH_OPTIONS:
            if getattr(side, key) != getattr(defaults, key):
                raise BadInput(f"{where}.{key}", f"only the megatron backend takes this option (backend {side.backend!r})")
    if not side.grad_reduce_in_fp32 and side.backend not in ("megatron", "mlm"):
        raise BadInput(f"{where}.grad_reduce_in_fp32", f"a DDP option: megatron and mlm backends only (backend {side.backend!r})")
    if not side.grad_reduce_in_fp32 and side.precision != "bf16":
        # fp32 params keep fp32 main_grads either way: the option would change nothing.
        raise BadInput(f"{where}.grad_reduce_in_fp32", f"false takes effect only with precision bf16 (got {side.precision!r})")
    if side.sequence_parallel and side.tp == 1:
        raise BadInput(f"{where}.sequence_parallel", "needs TP > 1 (it shards the sequence over TP)")
    if side.sequence_parallel and s.model.seq_length * s.data.micro_batch_size % side.tp:
        raise BadInput(f"{where}.sequence_parallel", f"TP {side.tp} must divide the sequence length {s.model.seq_length}")
    if side.bucket_size is not None and side.bucket_size < 1:
        raise BadInput(f"{where}.bucket_size", f"must be >= 1 elements, got {side.bucket_size}")
    if side.distributed_optimizer and side.optimizer != "adam":
        # megatron-core 0.19.2, optimizer/distrib_optimizer.py, DistributedOptimizer.__init__ (l.688-694).
        raise BadInput(f"{where}.distributed_optimizer",
                       "megatron-core's DistributedOptimizer takes Adam only (it asserts Adam or an "
                       "init_state_fn, for its checkpoint format)")  # fmt: skip
    if side.overlap_param_gather and not (side.distributed_optimizer and side.overlap_grad_reduce):
        # Megatron-LM's arguments.py: the param gather it overlaps is the distributed optimizer's,
        # and it "must use --overlap-param-gather with --overlap-grad-reduce".
        raise BadInput(f"{where}.overlap_param_gather", "needs distributed_optimizer and overlap_grad_reduce")
    _validate_loss_mask(s, side, where)
    _validate_process_groups(side, where)
    if side.bucket_size is not None and not side.overlap_grad_reduce:
        # megatron-core buckets only when it overlaps (DistributedDataParallel's bucket_size rule).
        raise BadInput(f"{where}.bucket_size", "takes effect only with overlap_grad_reduce = true")


def _validate_process_groups(side: Side, where: str) -> None:
    """A caller-supplied collection is built for the dense decoder's axes (TP, GTP, DP)."""
    if side.process_groups == "parallel-state":
        return
    if side.pipeline_parallel > 1 or side.ep * side.expert_gtp > 1 or side.save_step or side.load_step:
        raise BadInput(f"{where}.process_groups", "a caller-supplied collection is built here for TP x GTP x DP "
                       "only: not with pipeline stages, experts or checkpoints")  # fmt: skip
    if side.process_groups == "collection-permuted" and (side.gtp == 1 or side.replicate_dp == 1):
        raise BadInput(f"{where}.process_groups", "collection-permuted pairs GTP peers across replicate DP: it "
                       f"needs G > 1 and DP > 1 (got G {side.gtp}, DP {side.replicate_dp})")  # fmt: skip


def _validate_loss_mask(s: Scenario, side: Side, where: str) -> None:
    """A variable loss mask needs a loss normalized by the global token count on every side,
    as the golden computes it."""
    mask = s.data.loss_mask
    if mask not in LOSS_MASKS:
        raise BadInput(f"{s.source}: [data].loss_mask", f"{mask!r}: one of {sorted(LOSS_MASKS)}")
    if mask == "none":
        return
    if side.backend == "megatron" and side.per_token_loss == "none":
        # megatron-core's mean loss averages each micro-batch's token mean: with token counts
        # differing per micro-batch that is another objective than the global token mean.
        raise BadInput(f"{where}.per_token_loss",
                       "a variable loss mask needs per_token_loss (\"both\" or \"transformer-config\"): "
                       "the mean loss averages per-micro-batch token means, not the global token mean")  # fmt: skip
    if side.backend == "mlm":
        raise BadInput(f"{s.source}: [data].loss_mask", "the mlm backend reads Megatron-LM's own loss mask")
    if side.backend == "torch" and (side.world_size > 1 or side.recipe != "none" or side.precision == "bf16"):
        raise BadInput(f"{s.source}: [data].loss_mask",
                       "the torch backend applies a loss mask on its single-process golden path only "
                       "(world_size 1, no recipe, fp32 or fp64)")  # fmt: skip
