"""Planted faults of the architecture switches (:data:`harness.scenario.arch_faults.ARCH_FAULTS`):
run-time patches of megatron-core's finalize and GTP gather, undone with the side's other patches.

- ``gtp-bias-grad-unreduced``, ``gtp-qk-norm-grad-unreduced``: megatron-core completes a replicated
  parameter's grad (a bias, the query norm) over the GTP group
  in ``finalize_model_grads._allreduce_replicated_grads_over_gtp_remat_group``, which skips every
  parameter tagged ``is_gtp_weight_remat`` (GTP-sharded weights mean over the group in their
  reduce-scatter). The fault tags the target for the duration of that call, as a GTP module
  wrapper that tagged it with its weight would: it keeps the local partial.
- ``gtp-glu-halves-crossed``, ``gtp-qkv-groups-reordered``, ``gtp-expert-glu-halves-crossed`` (a
  routed expert's gated fc1 under expert GTP): the forward hand-out of the target's
  gathered (unpadded) TP block is rolled along dim 0, half the block (the gate and up halves
  swapped) or one GTP shard (each shard's query groups in the next shard's place). The faults'
  reach admits them only where that is a permutation of GTP's shard blocks, an order GTP's own
  all-gather could put the shards in. The backward's re-gather is left alone.
- ``tied-grad-one-use``: the output layer's forward is handed a detached view of the shared
  word-embedding weight (GPTModel passes it as ``weight``): its use's grad is dropped.
- ``gtp-vocab-pad-rows-in-loss``: the output layer's forward hand-out (a padded vocabulary) is its
  gathered TP block with GTP's zero pad rows read in front (the last rows cut off): the padding
  leaks into the logits and the loss. The backward's re-gather is left alone.
"""

from __future__ import annotations

import importlib

import torch

from harness.backends.patching import patch
from harness.scenario.arch_faults import ARCH_FAULTS, BIAS, EXPERT_GLU, GLU, QK_NORM, QKV, TIED, VOCAB


def _target(ctx, name: str):
    target = ARCH_FAULTS[name].target
    for n, p in ctx.named_params:
        if n == target:
            return p
    raise RuntimeError(f"planted fault {name}: the model has no {target}")


def _grad_unreduced(ctx, name: str) -> None:
    # The package re-exports the function under the module's name: import the module itself.
    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    param = _target(ctx, name)
    original = fmg._allreduce_replicated_grads_over_gtp_remat_group

    def allreduce_replicated(*args, **kwargs):
        had = "is_gtp_weight_remat" in vars(param)
        old = getattr(param, "is_gtp_weight_remat", None)
        param.is_gtp_weight_remat = True
        try:
            return original(*args, **kwargs)
        finally:
            if had:
                param.is_gtp_weight_remat = old
            else:
                del param.is_gtp_weight_remat

    patch(fmg, "_allreduce_replicated_grads_over_gtp_remat_group", allreduce_replicated)


def _rolled_gather(ctx, name: str, shift) -> None:
    """The target's forward hand-out rolled by ``shift(rows)`` rows along dim 0."""
    _changed_gather(ctx, name, lambda out, param: torch.roll(out, shifts=shift(out.shape[0]), dims=0))


def _changed_gather(ctx, name: str, change) -> None:
    """The target's forward hand-out replaced by ``change(out, param)`` (a new tensor: the gather
    buffer itself is left as GTP filled it)."""
    from megatron.core.tensor_parallel.generalized_tensor_parallelism import GTPShardedParam

    target = _target(ctx, name)
    original = GTPShardedParam.all_gather_and_prefetch

    def all_gather_and_prefetch(self, fwd=True, nvtx_label=None):
        out = original(self, fwd=fwd, nvtx_label=nvtx_label)
        return change(out, self) if fwd and self is target else out

    patch(GTPShardedParam, "all_gather_and_prefetch", all_gather_and_prefetch)


def _glu_halves_crossed(ctx) -> None:
    _rolled_gather(ctx, GLU, lambda rows: rows // 2)  # [gate; up] -> [up; gate]


def _qkv_groups_reordered(ctx) -> None:
    _rolled_gather(ctx, QKV, lambda rows: rows // ctx.side.gtp)  # shard k's groups in shard k + 1's place


def _tied_grad_one_use(ctx) -> None:
    shared = _target(ctx, TIED)
    layers = [m for c in ctx.model for n, m in c.named_modules() if n.split(".")[-1] == "output_layer"]
    if not layers:
        raise RuntimeError(f"planted fault {TIED}: the model has no output layer")
    for layer in layers:
        forward = layer.forward

        def detached(input_, weight=None, *args, _forward=forward, **kwargs):
            if weight is shared:  # the tied use: its grad no longer reaches the parameter
                weight = weight.detach()
            return _forward(input_, weight, *args, **kwargs)

        patch(layer, "forward", detached)


def _pad_in_front(out: torch.Tensor, param) -> torch.Tensor:
    pad = int(param.pad_length)  # GTP's pad rows of the TP block, zero as its gather buffer holds them
    return torch.cat([out.new_zeros((pad, *out.shape[1:])), out[:out.shape[0] - pad]])


def _vocab_pad_rows_in_loss(ctx) -> None:
    _changed_gather(ctx, VOCAB, _pad_in_front)


def _expert_glu_halves_crossed(ctx) -> None:
    _rolled_gather(ctx, EXPERT_GLU, lambda rows: rows // 2)  # a routed expert's [gate; up] -> [up; gate]


ARCH_INSTALLERS = {BIAS: lambda ctx: _grad_unreduced(ctx, BIAS),
                   QK_NORM: lambda ctx: _grad_unreduced(ctx, QK_NORM),
                   GLU: _glu_halves_crossed, QKV: _qkv_groups_reordered,
                   TIED: _tied_grad_one_use, VOCAB: _vocab_pad_rows_in_loss,
                   EXPERT_GLU: _expert_glu_halves_crossed}
