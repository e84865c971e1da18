"""Planted faults only an evaluation exposes (:data:`harness.scenario.faults.EVAL_FAULTS`): a
run-time patch of megatron-core's GTP, undone with the side's other patches. (The other,
``eval-loss-wrong-group``, acts through the backend's hook
:func:`harness.backends.faults.eval_report_group`.)"""

from __future__ import annotations

from harness.backends.patching import patch
from harness.scenario.faults import CATALOG


def _stale_gather(ctx) -> None:
    # A gathered-weight cache for the layer's eval mode (forward-only passes) that the optimizer
    # step does not invalidate: the target's consumer in an evaluation is handed the weight
    # gathered at the last training forward, from before that step's update. (Grad mode cannot
    # tell the passes apart: the gather runs inside an autograd Function's forward either way.)
    from megatron.core.tensor_parallel.generalized_tensor_parallelism import GTPShardedParam

    name = CATALOG["gtp-eval-stale-gather"].target
    target = next((p for n, p in ctx.named_params if n == name), None)
    chunks = ctx.model if isinstance(ctx.model, (list, tuple)) else [ctx.model]
    owner = next((m for c in chunks for m in c.modules() if getattr(m, "weight", None) is target), None)
    if target is None or owner is None:
        raise RuntimeError(f"planted fault: the model has no {name}")
    original, kept = GTPShardedParam.all_gather_and_prefetch, {}

    def all_gather_and_prefetch(self, fwd=True, nvtx_label=None):
        out = original(self, fwd=fwd, nvtx_label=nvtx_label)
        if self is not target or not fwd:
            return out
        if owner.training:
            kept["weight"] = out.detach().clone()
            return out
        return kept.get("weight", out)

    patch(GTPShardedParam, "all_gather_and_prefetch", all_gather_and_prefetch)


EVAL_INSTALLERS = {"gtp-eval-stale-gather": _stale_gather}
