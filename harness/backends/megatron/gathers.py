"""Record the weight each GEMM reads under GTP: megatron-core's all-gathered weight.

The gather happens inside ``GTPShardedParam.all_gather_and_prefetch``; a wrapper (a run-time
patch, undone with the side's other patches) hands its forward output to the recorder, and
audits every hand-out (forward, recompute, backward, evaluation): the rows of the handed-out weight that
this rank owns must be its own shard. When they are another parameter's shard the GEMM is
about to consume a foreign weight (a gather buffer reused before it was read); the event is
recorded in the rank's trace info (``consumed_foreign``) for the localizer to name.
"""

from __future__ import annotations

from typing import Callable

import torch

from harness.capture.api import Capture
from harness.backends.patching import patch

MAX_EVENTS = 64  # the first ones name the cause; a buffer reused every step repeats itself


def record_gathers(named: list[tuple[str, torch.Tensor]], record: Callable[[str, torch.Tensor], None],
                   cap: Capture) -> None:
    """Call ``record(name, gathered)`` on every forward all-gather of a parameter in ``named``,
    and list in ``cap.info["consumed_foreign"]`` (with step and micro-batch) each hand-out
    whose own rows are not the parameter's own shard."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.generalized_tensor_parallelism import GTPShardedParam

    events = cap.info.setdefault("consumed_foreign", [])
    names = {id(p): n for n, p in named}
    shards = [(n, p) for n, p in named if isinstance(p, GTPShardedParam)]
    g = ps.get_gtp_weight_remat_rank()
    original = GTPShardedParam.all_gather_and_prefetch

    def all_gather_and_prefetch(self, fwd=True, nvtx_label=None):
        out = original(self, fwd=fwd, nvtx_label=nvtx_label)
        if id(self) in names:
            if fwd:
                record(names[id(self)], out)
            # An expert weight's shard index is its rank in the expert GTP group, not the dense one.
            rank = self.group.rank() if getattr(self, "group", None) is not None else g
            if len(events) < MAX_EVENTS and (foreign := _foreign(self, out, rank, shards)) is not None:
                phase = _phase(fwd, cap)
                events.append({"step": cap.step, "micro_batch": cap.micro_batch_index, "phase": phase,
                               "param": names[id(self)], "consumed": foreign})
        return out

    patch(GTPShardedParam, "all_gather_and_prefetch", all_gather_and_prefetch)


def _phase(fwd: bool, cap: Capture) -> str:
    """``backward`` (dgrad), ``recompute`` (a forward while autograd runs backward), ``forward``
    (in a training micro-batch), or ``eval`` (a forward outside any: an evaluation's, which
    reads its samples without :meth:`Capture.micro_batch`)."""
    if not fwd:
        return "backward"
    if torch._C._current_graph_task_id() != -1:
        return "recompute"
    return "forward" if cap.micro_batch_index is not None else "eval"


def _own_rows(p: torch.Tensor, out: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(this rank's rows of the handed-out weight, the same rows of the parameter's shard)."""
    rows = p.shape[0]
    start, end = g * rows, min((g + 1) * rows, out.shape[0])
    if end <= start or tuple(out.shape[1:]) != tuple(p.shape[1:]):
        return None
    return out[start:end], p.detach()[: end - start]


def _foreign(p, out: torch.Tensor, g: int, shards: list[tuple[str, torch.Tensor]]) -> str | None:
    """None when the hand-out's own rows are ``p``'s shard; else whose shard they are (or
    ``"unknown"``: stale or partially gathered)."""
    own = _own_rows(p, out, g)
    if own is None or torch.equal(own[0], own[1].to(own[0].dtype)):
        return None
    for name, q in shards:
        if q is not p and q.shape == p.shape and torch.equal(own[0],
                                                             q.detach()[: own[0].shape[0]].to(own[0].dtype)):
            return name
    return "unknown"
