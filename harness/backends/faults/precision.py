"""Planted faults of the precision bug class ("extra rounding"): one bf16 rounding where
megatron-core keeps fp32, each a run-time wrap of a megatron-core function (or the backend's
``after_step`` hook), undone with the side's other patches. Also the backport of Megatron-LM
e5542e85f2 (#6624), the baseline against which GTP's bf16 wgrad reduce-scatter shows on the
0.19.2 wheel (which already reduce-scatters a bf16 wgrad for bf16 params)."""

from __future__ import annotations

import torch

from harness.backends.patching import on_undo, patch

BF16 = torch.bfloat16


def _gtp():
    from megatron.core.tensor_parallel import generalized_tensor_parallelism as gtp

    return gtp


def _round_bf16_(t: torch.Tensor) -> None:
    """Round ``t``'s values to bf16 in place; its dtype stays."""
    if t.dtype != BF16 and t.is_floating_point():
        t.copy_(t.to(BF16))


def _is_gtp(p) -> bool:
    return getattr(p, "is_gtp_weight_remat", False)


def _wgrad_in_main_grad_dtype(ctx, module_types: tuple) -> None:
    """GTP's wgrad of the weights of ``module_types`` cast to main_grad's dtype where it is
    handed to the reduce-scatter (``GTPShardedParam.wgrad_reduce_scatter``)."""
    weights = {id(m.weight) for chunk in ctx.model for m in chunk.modules()
               if isinstance(m, module_types) and _is_gtp(getattr(m, "weight", None))}
    cls = _gtp().GTPShardedParam
    original = cls.wgrad_reduce_scatter

    def wgrad_reduce_scatter(self, wgrad, nvtx_label=None):
        if id(self) in weights and isinstance(wgrad, torch.Tensor) and wgrad.dtype != self.main_grad.dtype:
            wgrad = wgrad.to(self.main_grad.dtype)
        return original(self, wgrad, nvtx_label=nvtx_label)

    patch(cls, "wgrad_reduce_scatter", wgrad_reduce_scatter)


def _backport_gtp_wgrad_fp32(ctx) -> None:
    # main (layers.py, LinearWithGradAccumulationAndAsyncCommunication.backward) emits the GTP
    # wgrad of megatron's linears in main_grad's dtype: on CPU without TE it copies the bf16
    # GEMM result into an fp32 buffer (get_wgrad_tensor), so only the reduce-scatter's dtype
    # changes. Here: the same cast where the wheel's linear hands its wgrad to GTP. The
    # embedding's wgrad (GTPEmbeddingWeight.backward) stays in its dtype, as on main.
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    _wgrad_in_main_grad_dtype(ctx, (ColumnParallelLinear, RowParallelLinear))


def _gtp_embedding_wgrad_fp32(ctx) -> None:
    # The change repro/FINDINGS.md (I) proposes for the word embedding, still open on Megatron-LM
    # main d98e8a64dd: GTPEmbeddingWeight.backward hands its wgrad to the reduce-scatter in
    # main_grad's dtype, as e5542e85f2 makes the linears do.
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    _wgrad_in_main_grad_dtype(ctx, (VocabParallelEmbedding,))


def _gtp_rs_bf16(ctx) -> None:
    # GTP's wgrad reduce-scatter (GTPShardedParam._reduce_scatter's collective): the pre-scaled
    # wgrad is rounded to bf16 and summed in bf16; the result lands in the dtype GTP expects.
    gtp = _gtp()
    original = gtp.reduce_scatter_along_first_dim

    def reduce_scatter_in_bf16(inp, process_group, async_op=False, output=None):
        if inp.dtype == BF16 or not inp.is_floating_point():
            return original(inp, process_group, async_op=async_op, output=output)
        out16, _ = original(inp.to(BF16), process_group, async_op=False)
        out = output if output is not None else out16.new_empty(out16.shape, dtype=inp.dtype)
        out.copy_(out16)
        return out, None  # complete already (GTP's handle wrapper takes None)

    patch(gtp, "reduce_scatter_along_first_dim", reduce_scatter_in_bf16)


def _distopt_grad_rs_bf16(ctx) -> None:
    # The DDP bucket group's reduce-scatter for the distributed optimizer (start_grad_sync
    # calls the module's dist_reduce_scatter_func on each bucket): the fp32 buffer is cast to
    # bf16 and reduce-scattered in bf16, and the shard written back as fp32 once the bucket
    # group's collectives have completed (start_grad_sync issues them inside a coalescing
    # manager that runs them at its exit; finish_grad_sync calls _copy_back_extra_main_grads
    # when they are done, sync or overlapped).
    from megatron.core.distributed import param_and_grad_buffer as pgb

    original, pending = pgb.dist_reduce_scatter_func, {}

    def reduce_scatter_in_bf16(output, input, *args, **kwargs):
        if input.dtype == BF16 or not input.is_floating_point():
            return original(output, input, *args, **kwargs)
        staged = (output, torch.empty(output.shape, dtype=BF16), input.to(BF16))
        pending[id(input)] = staged
        return original(staged[1], staged[2], *args, **kwargs)

    group_cls = pgb._ParamAndGradBucketGroup
    copy_back = group_cls._copy_back_extra_main_grads

    def copy_back_extra_main_grads(self):
        for bucket in self.buckets:
            if (staged := pending.pop(id(bucket.grad_data), None)) is not None:
                staged[0].copy_(staged[1])
        return copy_back(self)

    patch(pgb, "dist_reduce_scatter_func", reduce_scatter_in_bf16)
    patch(group_cls, "_copy_back_extra_main_grads", copy_back_extra_main_grads)


def _microbatch_accum_bf16(ctx) -> None:
    # After each micro-batch's gradient is added into main_grad it is rounded to bf16.
    # GTP params: GTP adds the reduce-scattered shard into main_grad (wgrad_reduce_scatter's
    # sync and deferred paths, _wait_reduce_scatter's finalize) and then calls
    # _handle_megatron_grad_accum, which fires DDP's post hook: round there, before the hook.
    cls = _gtp().GTPShardedParam
    original = cls._handle_megatron_grad_accum

    def handle_megatron_grad_accum(param):
        _round_bf16_(param.main_grad)
        return original(param)

    patch(cls, "_handle_megatron_grad_accum", staticmethod(handle_megatron_grad_accum))
    # Other params: DDP's post hook on the param's AccumulateGrad node adds param.grad into
    # main_grad; a hook registered after it on the same node rounds the sum.
    for chunk in ctx.model:
        for p in chunk.parameters():
            if p.requires_grad and not _is_gtp(p) and getattr(p, "main_grad", None) is not None:
                node = p.expand_as(p).grad_fn.next_functions[0][0]
                on_undo(node.register_hook(lambda *_, p=p: _round_bf16_(p.main_grad)).remove)


def _exp_avg_sqs_of_gtp_params(ctx) -> list[torch.Tensor]:
    """Adam's exp_avg_sq of every GTP-sharded param this rank steps (its fp32 master's in
    mixed precision; under the distributed optimizer, this rank's range of it)."""
    parts = getattr(ctx.optimizer, "chained_optimizers", None) or [ctx.optimizer]
    gtp = [p for _, p in ctx.named_params if _is_gtp(p)]
    found = []
    for part in parts:
        owned = getattr(part, "model_param_group_index_map", None)
        if owned is not None:  # DistributedOptimizer: the states of this rank's ranges
            found += [part._get_main_param_and_optimizer_states(p).get("exp_avg_sq") for p in gtp
                      if p in owned]
            continue
        master = {id(p16): p32 for g16, g32 in zip(getattr(part, "float16_groups", []),
                                                    getattr(part, "fp32_from_float16_groups", []))
                  for p16, p32 in zip(g16, g32)}
        found += [part.optimizer.state.get(master.get(id(p), p), {}).get("exp_avg_sq") for p in gtp]
    return [t for t in found if t is not None]


def before_build(names) -> None:
    """``grad-reduce-bf16-ignored``: DDP is built with ``grad_reduce_in_fp32`` on whatever the side
    asked (as a frontend that drops the flag would build it); the distributed optimizer reads the
    same config from the model chunks."""
    if "grad-reduce-bf16-ignored" not in names:
        return
    import dataclasses

    from megatron.core.distributed import DistributedDataParallel

    original = DistributedDataParallel.__init__

    def init(self, config, ddp_config, module, *args, **kwargs):
        return original(self, config, dataclasses.replace(ddp_config, grad_reduce_in_fp32=True), module,
                        *args, **kwargs)

    patch(DistributedDataParallel, "__init__", init)


def after_step(ctx) -> None:
    """``adam-exp-avg-sq-bf16-gtp``: Adam's second moment of GTP shards kept in bf16."""
    if "adam-exp-avg-sq-bf16-gtp" in ctx.active:
        with torch.no_grad():
            for t in _exp_avg_sqs_of_gtp_params(ctx):
                _round_bf16_(t)


PRECISION_INSTALLERS = {
    "backport-gtp-wgrad-fp32": _backport_gtp_wgrad_fp32,
    "patch-gtp-embedding-wgrad-fp32": _gtp_embedding_wgrad_fp32,
    "gtp-rs-bf16": _gtp_rs_bf16,
    "distopt-grad-rs-bf16": _distopt_grad_rs_bf16,
    "microbatch-accum-bf16": _microbatch_accum_bf16,
}
