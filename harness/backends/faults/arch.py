"""Planted faults of the architecture switches (:data:`harness.scenario.arch_faults.ARCH_FAULTS`):
run-time patches of megatron-core's finalize and GTP gather, undone with the side's other patches.

- ``gtp-bias-grad-unreduced``: megatron-core completes a replicated bias's grad over the GTP group
  in ``finalize_model_grads._allreduce_replicated_grads_over_gtp_remat_group``, which skips every
  parameter tagged ``is_gtp_weight_remat`` (GTP-sharded weights mean over the group in their
  reduce-scatter). The fault tags the target bias for the duration of that call, as a GTP module
  wrapper that tagged its bias with its weight would: the bias keeps the local partial.
- ``gtp-glu-halves-crossed``, ``gtp-qkv-groups-reordered``, ``gtp-expert-glu-halves-crossed`` (a
  routed expert's gated fc1 under expert GTP): the forward hand-out of the target's
  gathered (unpadded) TP block is rolled along dim 0, half the block (the gate and up halves
  swapped) or one GTP shard (each shard's query groups in the next shard's place). The faults'
  reach admits them only where that is a permutation of GTP's shard blocks, an order GTP's own
  all-gather could put the shards in. The backward's re-gather is left alone.
"""

from __future__ import annotations

import importlib

import torch

from harness.backends.patching import patch
from harness.scenario.arch_faults import ARCH_FAULTS, BIAS, EXPERT_GLU, GLU, QKV


def _target(ctx, name: str):
    target = ARCH_FAULTS[name].target
    for n, p in ctx.named_params:
        if n == target:
            return p
    raise RuntimeError(f"planted fault {name}: the model has no {target}")


def _bias_grad_unreduced(ctx) -> None:
    # The package re-exports the function under the module's name: import the module itself.
    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    bias = _target(ctx, BIAS)
    original = fmg._allreduce_replicated_grads_over_gtp_remat_group

    def allreduce_replicated(*args, **kwargs):
        had = "is_gtp_weight_remat" in vars(bias)
        old = getattr(bias, "is_gtp_weight_remat", None)
        bias.is_gtp_weight_remat = True
        try:
            return original(*args, **kwargs)
        finally:
            if had:
                bias.is_gtp_weight_remat = old
            else:
                del bias.is_gtp_weight_remat

    patch(fmg, "_allreduce_replicated_grads_over_gtp_remat_group", allreduce_replicated)


def _rolled_gather(ctx, name: str, shift) -> None:
    """The target's forward hand-out rolled by ``shift(rows)`` rows along dim 0 (a new tensor:
    the gather buffer itself is left as GTP filled it)."""
    from megatron.core.tensor_parallel.generalized_tensor_parallelism import GTPShardedParam

    target = _target(ctx, name)
    original = GTPShardedParam.all_gather_and_prefetch

    def all_gather_and_prefetch(self, fwd=True, nvtx_label=None):
        out = original(self, fwd=fwd, nvtx_label=nvtx_label)
        if fwd and self is target:
            return torch.roll(out, shifts=shift(out.shape[0]), dims=0)
        return out

    patch(GTPShardedParam, "all_gather_and_prefetch", all_gather_and_prefetch)


def _glu_halves_crossed(ctx) -> None:
    _rolled_gather(ctx, GLU, lambda rows: rows // 2)  # [gate; up] -> [up; gate]


def _qkv_groups_reordered(ctx) -> None:
    _rolled_gather(ctx, QKV, lambda rows: rows // ctx.side.gtp)  # shard k's groups in shard k + 1's place


def _expert_glu_halves_crossed(ctx) -> None:
    _rolled_gather(ctx, EXPERT_GLU, lambda rows: rows // 2)  # a routed expert's [gate; up] -> [up; gate]


ARCH_INSTALLERS = {BIAS: _bias_grad_unreduced, GLU: _glu_halves_crossed, QKV: _qkv_groups_reordered,
                   EXPERT_GLU: _expert_glu_halves_crossed}
