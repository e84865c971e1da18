"""Planted faults: the harness's self-test.

Each fault of :mod:`harness.scenario.faults` reproduces one bug class (its ``bug_class``) inside a
real megatron-core run, at run time only: by wrapping an MCore function in the worker
process, or through the backend's hook points below. Installed files are never edited, and
every patch is undone when the side finishes (:func:`uninstall`).

Each catalogue entry says where the localizer should find the first divergence (``expect``);
the fault-injection tests hold the localizer to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from harness.backends.faults import groups, precision, verdicts
from harness.backends.faults.arch import ARCH_INSTALLERS
from harness.backends.faults.checkpoint import CHECKPOINT_INSTALLERS
from harness.backends.faults.evaluation import EVAL_INSTALLERS
from harness.backends.faults.moe import MOE_INSTALLERS
from harness.backends.faults.muon import MUON_INSTALLERS
from harness.backends.faults.mtp import MTP_INSTALLERS
from harness.backends.data import rank_sample_ids
from harness.scenario.faults import CATALOG, RANK_FAULTS, Fault, check_name
from harness.common.mesh import Mesh
from harness.backends.patching import patch, undo_all

__all__ = ["CATALOG", "Context", "Fault", "check_name", "install", "uninstall"]


@dataclass
class Context:
    """What a fault can reach on one rank of one side."""

    backend: str
    side: Any
    model: Any
    optimizer: Any
    rank: int
    coord: dict
    named_params: list
    active: tuple[str, ...] = ()
    saved: dict = field(default_factory=dict)


def _gtp():
    from megatron.core.tensor_parallel import generalized_tensor_parallelism as gtp

    return gtp


def _no_prescale(ctx: Context) -> None:
    patch(_gtp().GTPShardedParam, "_prescale_wgrads_for_mean_rs", lambda self, wgrads: None)


def _swap_gather(ctx: Context) -> None:
    gtp = _gtp()
    original = gtp.gather_along_first_dim

    def swapped(inp, group, *args, **kwargs):
        out, handle = original(inp, group, *args, **kwargs)
        if handle is not None:
            handle.wait()
        chunks = out.chunk(dist.get_world_size(group))
        out.copy_(torch.cat(chunks[::-1]))
        return out, None

    patch(gtp, "gather_along_first_dim", swapped)


def _skip_gtp_replicated_reduce(ctx: Context) -> None:
    import importlib

    # The package re-exports the function under the module's name: import the module itself.
    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")

    patch(fmg, "_allreduce_replicated_grads_over_gtp_remat_group", lambda *a, **k: None)


def _double_count_norm(ctx: Context) -> None:
    from megatron.core import tensor_parallel
    from megatron.core.optimizer import clip_grads

    # The grad-norm path reads it through the package (optimizer.py) and by name (clip_grads).
    patch(tensor_parallel, "param_is_not_gtp_duplicate", lambda param: True)
    patch(clip_grads, "param_is_not_gtp_duplicate", lambda param: True)


# How each fault that patches megatron-core is planted (the others act through the hooks below).
def _prescale_under_per_token_loss(ctx: Context) -> None:
    # What a configuration that reaches TransformerConfig but not GTP's own config does.
    patch(_gtp().GTP_CONFIG, "calculate_per_token_loss", False)


def _param(ctx: Context, name: str):
    for n, p in ctx.named_params:
        if n == name:
            return p
    raise RuntimeError(f"planted fault: the model has no {name}")


def _prefetch_missing_wait(ctx: Context) -> None:
    # The consumer of one prefetched weight reads the gather buffer without waiting on its
    # all-gather (the handle is dropped): it reads what the buffer held before.
    target = _param(ctx, CATALOG["gtp-prefetch-missing-wait"].target)
    cls = _gtp().GTPShardedParam
    original = cls._wait_param_gather

    def wait_param_gather(self):
        if self is target and self._prefetch_handle is not None:
            self._prefetch_handle = None
            return None
        return original(self)

    patch(cls, "_wait_param_gather", wait_param_gather)


def _wgrad_finalized_twice(ctx: Context) -> None:
    # The chain's cascade finalizes one weight's async reduce-scatter (megatron-core's own
    # finalizing drain) and loses the ``_already_finalized`` flag, so the deferred path of its
    # predecessor's wgrad_reduce_scatter adds the reduce-scattered wgrad to main_grad again.
    target = _param(ctx, CATALOG["gtp-wgrad-rs-finalized-twice"].target)
    cls = _gtp().GTPShardedParam
    original = cls.wgrad_reduce_scatter

    def wgrad_reduce_scatter(self, wgrad, nvtx_label=None):
        if self.next_w is target and target._wgrad_rs_handle is not None:
            target._wait_reduce_scatter(finalize_grad=True)
            target._already_finalized = False
        return original(self, wgrad, nvtx_label=nvtx_label)

    patch(cls, "wgrad_reduce_scatter", wgrad_reduce_scatter)


def _distopt_offsets_ignore_pad(ctx: Context) -> None:
    # The distributed optimizer lays GTP shards out in the buffer as if they had no pad rows:
    # on the GTP rank holding them, every parameter after a padded shard is placed pad rows
    # early, so its updated elements are written over the shard before it.
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._build_model_gbuf_param_range_map.__func__

    def build(cls, param_world_index_map, gbuf_world_range, bucket_offset):
        shifted, shift = {}, 0
        for param, (start, end, bucket) in sorted(param_world_index_map.items(), key=lambda kv: kv[1][0]):
            shifted[param] = (start - shift, end - shift, bucket)
            if getattr(param, "is_gtp_weight_remat", False) and _pad_rows_here(ctx, param):
                shift += _pad_rows_here(ctx, param) * (param.numel() // param.shape[0])
        return original(cls, shifted, gbuf_world_range, bucket_offset)

    patch(DistributedOptimizer, "_build_model_gbuf_param_range_map", classmethod(build))


def _pad_rows_here(ctx: Context, param) -> int:
    """Pad rows of this rank's GTP shard of ``param`` (GTP pads the tail of the weight)."""
    pad, rows = getattr(param, "pad_length", 0), param.shape[0]
    g = ctx.coord["gtp"]
    return max(0, min(rows, pad - (ctx.side.gtp - 1 - g) * rows))
def _swap_microbatch_grads(ctx: Context) -> None:
    # On the first stage a backward sends nothing on (no input gradient), so micro-batch 0's
    # backward can wait for micro-batch 1's output gradient: each then runs with the other's.
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import schedules

    if not ps.is_pipeline_first_stage():
        return
    original, per_step = schedules.backward_step, ctx.side.num_microbatches(_data(ctx))
    calls, held = [0], []

    def backward_step(input_tensor, output_tensor, output_tensor_grad, config):
        index, calls[0] = calls[0] % per_step, calls[0] + 1
        if index == 0:
            held.append((input_tensor, output_tensor, output_tensor_grad))
            return None
        if index == 1:
            first = held.pop()
            original(first[0], first[1], output_tensor_grad, config)
            return original(input_tensor, output_tensor, first[2], config)
        return original(input_tensor, output_tensor, output_tensor_grad, config)

    patch(schedules, "backward_step", backward_step)


INSTALLERS: dict[str, Callable[[Context], None]] = {
    "pp-swap-microbatch-grads": _swap_microbatch_grads,
    "gtp-prescale-under-per-token-loss": _prescale_under_per_token_loss,
    "gtp-rs-no-prescale": _no_prescale,
    "gtp-ag-swap-shards": _swap_gather,
    "gtp-ln-grad-not-reduced": _skip_gtp_replicated_reduce,
    "grad-norm-double-count": _double_count_norm,
    "gtp-prefetch-missing-wait": _prefetch_missing_wait,
    "gtp-wgrad-rs-finalized-twice": _wgrad_finalized_twice,
    "distopt-offsets-ignore-gtp-pad": _distopt_offsets_ignore_pad,
}
INSTALLERS.update(MOE_INSTALLERS)
INSTALLERS.update(MUON_INSTALLERS)
INSTALLERS.update(MTP_INSTALLERS)
INSTALLERS.update(EVAL_INSTALLERS)
INSTALLERS.update(verdicts.VERDICT_INSTALLERS)
INSTALLERS.update(precision.PRECISION_INSTALLERS)
INSTALLERS.update(groups.INSTALLERS)
INSTALLERS.update(CHECKPOINT_INSTALLERS)
INSTALLERS.update(ARCH_INSTALLERS)


def install(names: tuple[str, ...], ctx: Context) -> None:
    """Apply the named faults for this side (patches are undone by :func:`uninstall`)."""
    problems = [p for p in map(check_name, names) if p]
    if problems:
        raise ValueError(problems[0])
    ctx.active = tuple(names)
    for name in names:
        if name in INSTALLERS:
            INSTALLERS[name](ctx)


def before_build(names: tuple[str, ...], pgc) -> None:
    """The faults that act on how the model and DDP are built: installed before they are."""
    groups.before_build(names, pgc)
    precision.before_build(names)


def uninstall() -> None:
    """Undo every run-time patch of this side (the faults' and the backend's)."""
    undo_all()


# --- hook points the backend calls (no-ops unless a fault is active) ---


def route_samples(ctx: Context, step: int, ids: list[list[int]]) -> list[list[int]]:
    if "gtp-peers-same-sample" not in ctx.active or ctx.side.gtp == 1:
        return ids
    # Every GTP peer reads what GTP rank 0 of its (tp, dp) slot reads.
    rank0 = Mesh.of_side(ctx.side).rank({"tp": ctx.coord["tp"], "gtp": 0, "dp": ctx.coord["dp"]})
    return rank_sample_ids(step, rank0, ctx.side, _data(ctx))


def _data(ctx: Context):
    return ctx.saved["data"]


def before_micro_batch(ctx: Context, index: int) -> None:
    """Called before each micro-batch's forward (the previous one's backward is done)."""
    if "microbatch-grad-overwrite" in ctx.active and index > 0:
        for _, p in ctx.named_params:
            if getattr(p, "main_grad", None) is not None:
                p.main_grad.zero_()


def finalize_kwargs(ctx: Context, kwargs: dict) -> dict:
    """The keyword arguments the schedule hands ``finalize_model_grads``. Under
    ``token-count-without-gtp-peers`` its process groups count the per-token loss's tokens over
    the replicate-DP group instead of the GTP-inclusive data group."""
    pg = kwargs.get("pg_collection")
    if "token-count-without-gtp-peers" not in ctx.active or pg is None:
        return kwargs
    import copy

    from megatron.core import parallel_state as ps

    wrong = copy.copy(pg)  # finalize reads dp_cp_gtp_remat, else dp_cp (GTP-inclusive by default)
    wrong.dp_cp = wrong.dp_cp_gtp_remat = ps.get_data_parallel_group(with_context_parallel=True,
                                                                     with_gtp_remat=False)
    return {**kwargs, "pg_collection": wrong}


def after_finalize(ctx: Context) -> None:
    verdicts.after_finalize(ctx)
    if "gtp-pad-leak" in ctx.active and ctx.coord["gtp"] == ctx.side.gtp - 1:
        for _, p in ctx.named_params:
            pad = getattr(p, "pad_length", 0)
            if getattr(p, "is_gtp_weight_remat", False) and pad:
                p.main_grad[-pad:] += 1e-3


def _gtp_param_groups(ctx: Context) -> list[dict]:
    """The optimizer's param groups holding a GTP weight (or, in bf16, its fp32 master)."""
    ids = {id(p) for _, p in ctx.named_params if getattr(p, "is_gtp_weight_remat", False)}
    parts = getattr(ctx.optimizer, "chained_optimizers", None) or [ctx.optimizer]
    for part in parts:
        for g16, g32 in zip(getattr(part, "float16_groups", []),
                            getattr(part, "fp32_from_float16_groups", [])):
            ids |= {id(p32) for p16, p32 in zip(g16, g32) if id(p16) in ids}
    return [g for part in parts for g in part.optimizer.param_groups if any(id(p) in ids
                                                                            for p in g["params"])]


# Param-group faults: the group's setting during the step (the scheduler resets it after).
_GROUP_FAULTS = {"gtp-update-no-weight-decay": ("weight_decay", 0.0), "gtp-update-lr-mult": ("lr", 0.5)}


def before_step(ctx: Context) -> None:
    verdicts.before_step(ctx)
    for name, (key, value) in _GROUP_FAULTS.items():
        if name in ctx.active:
            groups = _gtp_param_groups(ctx)
            ctx.saved[name] = []
            for g in groups:
                faulty = value if key == "weight_decay" else g[key] * value
                ctx.saved[name].append((g, g[key], faulty))
                g[key] = faulty
    if "optimizer-skips-weight" in ctx.active:
        for name, p in ctx.named_params:
            if name == CATALOG["optimizer-skips-weight"].expect["tensor"]:
                ctx.saved["stale"] = (p, p.detach().clone())


def after_step(ctx: Context) -> None:
    precision.after_step(ctx)
    verdicts.after_step(ctx)
    for name, (key, _) in _GROUP_FAULTS.items():
        for g, old, faulty in ctx.saved.pop(name, []):
            if g[key] == faulty:  # the LR scheduler has not set the next step's value already
                g[key] = old
    if "optimizer-skips-weight" in ctx.active and "stale" in ctx.saved:
        p, before = ctx.saved["stale"]
        with torch.no_grad():
            p.copy_(before)
        # The fp32 master must stay stale too, or the next step would resurrect the update.
        for part in getattr(ctx.optimizer, "chained_optimizers", None) or [ctx.optimizer]:
            for g16, g32 in zip(getattr(part, "float16_groups", []),
                                getattr(part, "fp32_from_float16_groups", [])):
                for p16, p32 in zip(g16, g32):
                    if p16 is p:
                        p32.data.copy_(before.float())


def amax_reduction_group(ctx: Context, group):
    """Group a GTP weight shard's per-tensor amax is reduced over before the quantized
    all-gather (torch backend); None under ``fp8-unreduced-amax``."""
    return None if "fp8-unreduced-amax" in ctx.active else group


def loss_report_group(ctx: Context, group):
    if "loss-report-wrong-group" in ctx.active:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group(with_gtp_remat=False)
    return group


def eval_report_group(ctx: Context, group):
    """The group an evaluation's loss is reduced over (the harness's loop): under
    ``eval-loss-wrong-group`` the replicate-DP group, leaving out GTP peers (what Megatron-LM's
    ``evaluate()`` does on megatron-core 0.19.2)."""
    if "eval-loss-wrong-group" in ctx.active:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group(with_gtp_remat=False)
    return group


# --- launcher self-test: a rank that dies or hangs (``exit:RANK:STEP``, ``hang:RANK:STEP``) ---


def at_step(ctx: Context, step: int) -> None:
    import os
    import time

    ctx.saved["step"] = step  # what the hooks after it read (verdicts.after_finalize)
    for name in ctx.active:
        parts = name.split(":")
        if len(parts) != 3 or parts[0] not in RANK_FAULTS:
            continue
        if int(parts[1]) == ctx.rank and int(parts[2]) == step:
            if parts[0] == "exit":
                os._exit(13)  # no traceback, no error file: only the heartbeat names the step
            if parts[0] == "raise":
                raise RuntimeError(f"planted failure on rank {ctx.rank} at step {step}")
            while True:
                time.sleep(3600)


def checkpoint_state(ctx: Context, state: dict) -> None:
    """``ckpt-pad-rows-as-data``: the GTP shards of the word embedding are saved with
    ``gtp_pad_alignment`` zero pad rows each, counted as data (the saved global shape is G x
    that many rows too long, ``allow_shape_mismatch`` as megatron-core sets it for padded GTP
    weights); a loader reads the zero rows and the data shifted behind them."""
    if "ckpt-pad-rows-as-data" not in ctx.active or ctx.side.gtp == 1:
        return
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    key = "embedding.word_embeddings.weight"
    clean = state["model"][key]
    pad = clean.data.new_zeros(max(ctx.side.gtp_pad_alignment, 1), *clean.data.shape[1:])
    slot, slots = ctx.coord["tp"] * ctx.side.gtp + ctx.coord["gtp"], ctx.side.tp * ctx.side.gtp
    state["model"][key] = ShardedTensor.from_rank_offsets(key, torch.cat([clean.data, pad]), (0, slot, slots),
                                                          replica_id=clean.replica_id,
                                                              allow_shape_mismatch=True)
