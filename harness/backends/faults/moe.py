"""Planted faults of MoE models (:data:`harness.scenario.faults.MOE_FAULTS`): run-time patches of
megatron-core's router and GTP functions, undone with the side's other patches."""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness.backends.patching import patch


def _aux_loss_wrong_group(ctx) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe import router

    original = router.get_tokens_per_expert_and_token_count

    def counted_over_data_group(routing_map, reduce_group, *args, **kwargs):
        return original(routing_map, ps.get_data_parallel_group(), *args, **kwargs)

    patch(router, "get_tokens_per_expert_and_token_count", counted_over_data_group)


def _expert_gather_wrong_buffer(ctx) -> None:
    from megatron.core.tensor_parallel.generalized_tensor_parallelism import GTPShardedParam

    named = dict(ctx.named_params)
    victim = named.get("decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight")
    donor = named.get("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight")
    original = GTPShardedParam.all_gather_and_prefetch

    def all_gather_and_prefetch(self, fwd=True, nvtx_label=None):
        out = original(self, fwd=fwd, nvtx_label=nvtx_label)
        if fwd and self is victim and donor is not None:
            # The donor's whole weight, gathered over the same group as a buffer reused for it would hold.
            full = torch.empty((donor.shape[0] * self.group.size(), *donor.shape[1:]), dtype=donor.dtype)
            dist.all_gather_into_tensor(full, donor.detach().contiguous(), group=self.group)
            out = out.clone()
            out.copy_(full[: out.shape[0]])
        return out

    if victim is not None:  # held by the ranks of expert 0's EP coordinate only
        patch(GTPShardedParam, "all_gather_and_prefetch", all_gather_and_prefetch)


def _expert_wgrad_dense_group(ctx) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import generalized_tensor_parallelism as gtp

    expert_group, dense_group = ps.get_expert_gtp_weight_remat_group(), ps.get_gtp_weight_remat_group()
    original = gtp.reduce_scatter_along_first_dim

    def over_dense_group(inp, process_group, *args, **kwargs):
        return original(inp, dense_group if process_group is expert_group else process_group, *args, **kwargs)

    patch(gtp, "reduce_scatter_along_first_dim", over_dense_group)


MOE_INSTALLERS = {
    "moe-aux-loss-wrong-group": _aux_loss_wrong_group,
    "moe-expert-gather-wrong-buffer": _expert_gather_wrong_buffer,
    "moe-expert-wgrad-dense-group": _expert_wgrad_dense_group,
}
