"""Planted faults: the harness's self-test.

Each fault of :mod:`harness.fault_catalog` reproduces one bug class (its ``bug_class``) inside a
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

from harness.data import rank_sample_ids
from harness.fault_catalog import CATALOG, RANK_FAULTS, Fault, check_name
from harness.mesh import Mesh
from harness.patching import patch, undo_all

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


INSTALLERS: dict[str, Callable[[Context], None]] = {
    "gtp-prescale-under-per-token-loss": _prescale_under_per_token_loss,
    "gtp-rs-no-prescale": _no_prescale,
    "gtp-ag-swap-shards": _swap_gather,
    "gtp-ln-grad-not-reduced": _skip_gtp_replicated_reduce,
    "grad-norm-double-count": _double_count_norm,
}


def install(names: tuple[str, ...], ctx: Context) -> None:
    """Apply the named faults for this side (patches are undone by :func:`uninstall`)."""
    problems = [p for p in map(check_name, names) if p]
    if problems:
        raise ValueError(problems[0])
    ctx.active = tuple(names)
    for name in names:
        if name in INSTALLERS:
            INSTALLERS[name](ctx)


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


def after_finalize(ctx: Context) -> None:
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
        for g16, g32 in zip(getattr(part, "float16_groups", []), getattr(part, "fp32_from_float16_groups", [])):
            ids |= {id(p32) for p16, p32 in zip(g16, g32) if id(p16) in ids}
    return [g for part in parts for g in part.optimizer.param_groups if any(id(p) in ids for p in g["params"])]


# Param-group faults: the group's setting during the step (the scheduler resets it after).
_GROUP_FAULTS = {"gtp-update-no-weight-decay": ("weight_decay", 0.0), "gtp-update-lr-mult": ("lr", 0.5)}


def before_step(ctx: Context) -> None:
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
            for g16, g32 in zip(getattr(part, "float16_groups", []), getattr(part, "fp32_from_float16_groups", [])):
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


# --- launcher self-test: a rank that dies or hangs (``exit:RANK:STEP``, ``hang:RANK:STEP``) ---


def at_step(ctx: Context, step: int) -> None:
    import os
    import time

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
                                                          replica_id=clean.replica_id, allow_shape_mismatch=True)
