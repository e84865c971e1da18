"""Planted faults: the harness's self-test.

Each fault reproduces a row of the bug-class table (shared brief BUG_CLASSES.md) inside a
real megatron-core run, at run time only: by wrapping an MCore function in the worker
process, or through the backend's hook points below. Installed files are never edited, and
every patch is undone when the side finishes (:func:`uninstall`).

Each entry says where the localizer should find the first divergence (``expect``); the
fault-injection tests hold the localizer to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist


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


@dataclass(frozen=True)
class Fault:
    name: str
    bug_class: str
    description: str
    expect: dict
    """Expected first divergence: step, phase, kind, tensor (fnmatch), signature."""
    install: Callable[[Context], None] | None = None


_UNDO: list[Callable[[], None]] = []


def _patch(obj, attr: str, value) -> None:
    old = getattr(obj, attr)
    setattr(obj, attr, value)
    _UNDO.append(lambda: setattr(obj, attr, old))


def _gtp():
    from megatron.core.tensor_parallel import generalized_tensor_parallelism as gtp

    return gtp


def _no_prescale(ctx: Context) -> None:
    _patch(_gtp().GTPShardedParam, "_prescale_wgrads_for_mean_rs", lambda self, wgrads: None)


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

    _patch(gtp, "gather_along_first_dim", swapped)


def _skip_gtp_replicated_reduce(ctx: Context) -> None:
    import importlib

    # The package re-exports the function under the module's name: import the module itself.
    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")

    _patch(fmg, "_allreduce_replicated_grads_over_gtp_remat_group", lambda *a, **k: None)


def _double_count_norm(ctx: Context) -> None:
    from megatron.core import tensor_parallel
    from megatron.core.optimizer import clip_grads

    # The grad-norm path reads it through the package (optimizer.py) and by name (clip_grads).
    _patch(tensor_parallel, "param_is_not_gtp_duplicate", lambda param: True)
    _patch(clip_grads, "param_is_not_gtp_duplicate", lambda param: True)


CATALOG: dict[str, Fault] = {
    f.name: f
    for f in [
        Fault(
            "gtp-rs-no-prescale", "gradient mean vs sum",
            "GTP wgrad reduce-scatter without the 1/G pre-scale: GTP weights get the SUM over peers",
            {"step": 1, "kind": "main_grad", "tensor": "*.weight", "signature": "ratio-G"},
            _no_prescale,
        ),
        Fault(
            "gtp-ag-swap-shards", "shard ordering",
            "GTP all-gather assembles the shards in reverse rank order",
            {"step": 1, "kind": "materialized", "tensor": "embedding.word_embeddings.weight",
             "signature": "permuted-blocks"},
            _swap_gather,
        ),
        Fault(
            "gtp-ln-grad-not-reduced", "missing reduction of a partial gradient",
            "replicated (non-GTP) params' grads are not averaged over the GTP group in finalize",
            {"step": 1, "kind": "main_grad", "tensor": "*", "signature": "replica-drift"},
            _skip_gtp_replicated_reduce,
        ),
        Fault(
            "gtp-peers-same-sample", "misrouted data",
            "GTP peers read the same micro-batch (every peer reads GTP rank 0's samples)",
            {"step": 1, "kind": "input", "tensor": "sample_ids", "signature": "misrouted-samples"},
        ),
        Fault(
            "gtp-pad-leak", "padding",
            "pad rows of GTP main_grad shards receive gradient on the last GTP rank",
            {"step": 1, "kind": "main_grad", "tensor": "*", "signature": "pad-rows"},
        ),
        Fault(
            "optimizer-skips-weight", "stale or clobbered buffer",
            "the optimizer update does not reach decoder.layers.0.mlp.linear_fc1.weight",
            {"step": 1, "kind": "param", "tensor": "decoder.layers.0.mlp.linear_fc1.weight",
             "signature": "stale-update"},
        ),
        Fault(
            "loss-report-wrong-group", "loss reporting",
            "the logged loss is averaged over the replicate-DP group, leaving out GTP peers",
            {"step": 1, "kind": "scalar", "tensor": "reduced_loss", "signature": "loss-report-only"},
        ),
        Fault(
            "grad-norm-double-count", "double counting",
            "replicated params are counted on every GTP peer in the grad norm",
            {"step": 1, "kind": "scalar", "tensor": "grad_norm", "signature": "grad-norm-only"},
            _double_count_norm,
        ),
        Fault(
            "fp8-unreduced-amax", "precision loss",
            "FP8 quantized all-gather of GTP weights (torch backend): each shard is quantized with "
            "its own per-tensor amax, not the amax reduced over the GTP group, and the gathered "
            "weight is decoded with the local scale (TE assumes the scales are equal)",
            {"step": 1, "kind": "activation", "tensor": "decoder.layers.0.self_attention",
             "signature": "precision-loss"},
        ),
    ]
}


def install(names: tuple[str, ...], ctx: Context) -> None:
    """Apply the named faults for this side (patches are undone by :func:`uninstall`)."""
    problems = [p for p in map(check_name, names) if p]
    if problems:
        raise ValueError(problems[0])
    ctx.active = tuple(names)
    for name in names:
        if name in CATALOG and CATALOG[name].install is not None:
            CATALOG[name].install(ctx)


def uninstall() -> None:
    while _UNDO:
        _UNDO.pop()()


# --- hook points the backend calls (no-ops unless a fault is active) ---


def route_samples(ctx: Context, step: int, ids: list[list[int]]) -> list[list[int]]:
    if "gtp-peers-same-sample" not in ctx.active or ctx.side.gtp == 1:
        return ids
    # Every GTP peer reads what GTP rank 0 of its (tp, dp) slot reads.
    from harness.data import rank_sample_ids

    rank0 = ctx.coord["tp"] + ctx.side.tp * ctx.side.gtp * ctx.coord["dp"]
    return rank_sample_ids(step, rank0, ctx.side, _data(ctx))


def _data(ctx: Context):
    return ctx.saved["data"]


def after_finalize(ctx: Context) -> None:
    if "gtp-pad-leak" in ctx.active and ctx.coord["gtp"] == ctx.side.gtp - 1:
        for _, p in ctx.named_params:
            pad = getattr(p, "pad_length", 0)
            if getattr(p, "is_gtp_weight_remat", False) and pad:
                p.main_grad[-pad:] += 1e-3


def before_step(ctx: Context) -> None:
    if "optimizer-skips-weight" in ctx.active:
        for name, p in ctx.named_params:
            if name == CATALOG["optimizer-skips-weight"].expect["tensor"]:
                ctx.saved["stale"] = (p, p.detach().clone())


def after_step(ctx: Context) -> None:
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

_RANK_FAULTS = ("exit", "hang", "raise")


def check_name(name: str) -> str | None:
    """None if ``name`` is a known fault, else why not."""
    if name in CATALOG:
        return None
    parts = name.split(":")
    if len(parts) == 3 and parts[0] in _RANK_FAULTS and parts[1].isdigit() and parts[2].isdigit():
        return None
    return f"unknown fault {name!r}; known: {', '.join(CATALOG)}, or exit|hang|raise:RANK:STEP"


# Faults that act on GTP's collectives, buffers or groups: on a side without GTP they never fire.
_NEEDS_GTP = frozenset({"gtp-rs-no-prescale", "gtp-ag-swap-shards", "gtp-ln-grad-not-reduced",
                        "gtp-peers-same-sample", "gtp-pad-leak", "loss-report-wrong-group",
                        "grad-norm-double-count", "fp8-unreduced-amax"})  # fmt: skip
# What the torch backend can plant (the others patch megatron-core's own functions).
TORCH_FAULTS = frozenset({"fp8-unreduced-amax", "gtp-peers-same-sample", "gtp-pad-leak", "optimizer-skips-weight"})


def check_reach(name: str, side) -> str | None:
    """None if the (known) fault ``name`` can fire on ``side``, else why it never would: a
    planted fault that cannot fire would make a clean run look like a caught fault's miss."""
    parts = name.split(":")
    if len(parts) == 3 and parts[0] in _RANK_FAULTS:
        rank, step = int(parts[1]), int(parts[2])
        if rank >= side.world_size:
            return f"{name!r} never fires: rank {rank} is not in 0..{side.world_size - 1} (world_size {side.world_size})"
        if not 1 <= step <= side.steps:
            return f"{name!r} never fires: step {step} is not in 1..{side.steps} (the side's steps)"
        return None
    if name in _NEEDS_GTP and side.gtp == 1:
        return f"{name!r} never fires on a side without GTP (gtp = 1)"
    if side.backend == "torch" and name not in TORCH_FAULTS:
        return f"{name!r} is not implemented by the torch backend; it implements {sorted(TORCH_FAULTS)}"
    return None


def at_step(ctx: Context, step: int) -> None:
    import os
    import time

    for name in ctx.active:
        parts = name.split(":")
        if len(parts) != 3 or parts[0] not in _RANK_FAULTS:
            continue
        if int(parts[1]) == ctx.rank and int(parts[2]) == step:
            if parts[0] == "exit":
                os._exit(13)  # no traceback, no error file: only the heartbeat names the step
            if parts[0] == "raise":
                raise RuntimeError(f"planted failure on rank {ctx.rank} at step {step}")
            while True:
                time.sleep(3600)
