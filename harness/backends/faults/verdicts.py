"""The planted faults at a verdict's edges (:data:`harness.scenario.faults.VERDICT_FAULTS`): a NaN
written into one GTP shard's main_grad (through the backend's ``after_finalize`` hook), and an
exception raised inside megatron-core's GTP backward (a run-time patch, undone with the side's
other patches), and one weight's optimizer update scaled by 1.05 (the ``before_step`` and
``after_step`` hooks)."""

from __future__ import annotations

import torch

from harness.backends.patching import patch
from harness.scenario.faults import CATALOG

NAN_STEP = 2


def _backward_raises(ctx) -> None:
    # What a lookup of a missing key inside GTP's backward does (as megatron-core's own
    # ``KeyError: None`` at MTP's first backward): the reduce-scatter of a wgrad raises.
    from megatron.core.tensor_parallel.generalized_tensor_parallelism import GTPShardedParam

    def wgrad_reduce_scatter(self, wgrad, nvtx_label=None):
        raise KeyError(None)

    patch(GTPShardedParam, "wgrad_reduce_scatter", wgrad_reduce_scatter)


def after_finalize(ctx) -> None:
    """``gtp-main-grad-nan``: at step 2 the last GTP rank's shard of the target's main_grad gets a
    NaN in its first element (a data row: GTP pads the tail)."""
    if "gtp-main-grad-nan" not in ctx.active or ctx.saved.get("step") != NAN_STEP:
        return
    if ctx.coord["gtp"] != ctx.side.gtp - 1:
        return
    name = CATALOG["gtp-main-grad-nan"].target
    param = next((p for n, p in ctx.named_params if n == name), None)
    if param is None or getattr(param, "main_grad", None) is None:
        raise RuntimeError(f"planted fault: the model has no {name} with a main_grad")
    with torch.no_grad():
        param.main_grad.view(-1)[0] = float("nan")


VERDICT_INSTALLERS = {"gtp-backward-raises": _backward_raises}


UPDATE_SCALE = 1.05


def _stepped(ctx, param):
    """The tensor the optimizer steps for ``param``: its fp32 master in mixed precision, else itself."""
    for part in getattr(ctx.optimizer, "chained_optimizers", None) or [ctx.optimizer]:
        masters = getattr(part, "fp32_from_float16_groups", [])
        for g16, g32 in zip(getattr(part, "float16_groups", []), masters):
            for p16, p32 in zip(g16, g32):
                if p16 is param:
                    return p32
    return param


def before_step(ctx) -> None:
    if "adam-update-scaled" in ctx.active:
        name = CATALOG["adam-update-scaled"].target
        param = next((p for n, p in ctx.named_params if n == name), None)
        if param is None:
            raise RuntimeError(f"planted fault: the model has no {name}")
        stepped = _stepped(ctx, param)
        ctx.saved["scaled"] = (param, stepped, stepped.detach().clone())


def after_step(ctx) -> None:
    """``adam-update-scaled``: the target's update, after - before, scaled by 1.05 on the tensor the
    optimizer stepped (the fp32 master in bf16), and the weight copied from it as the optimizer does."""
    if "scaled" not in ctx.saved:
        return
    param, stepped, before = ctx.saved.pop("scaled")
    with torch.no_grad():
        stepped.copy_(before + UPDATE_SCALE * (stepped - before))
        if stepped is not param:
            param.copy_(stepped)
