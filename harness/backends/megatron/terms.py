"""The terms of each main_grad's data-parallel sum, recorded for the comparison's derived bound.

A parameter's main_grad is a sum of ``micro-batches x data ranks`` terms (one wgrad per
micro-batch per rank), and two runs that sum the same terms in another order (GTP reduces
over its peers per micro-batch, DDP once per step) differ by at most
``2 gamma sum_i |x_i|`` (:func:`harness.compare.bounds.sum_reorder_bound`). ``sum_i |x_i|``
needs the terms, which no later tensor holds: this records it, as kind ``grad_terms``, on a
side whose main_grad sums them locally before DDP reduces (GTP off).

Each micro-batch's term is read as the change of main_grad over that micro-batch (in fp64,
where the difference of two fp32 values is exact, so the read term is the rounded
accumulation's own: within one fp32 rounding of the wgrad), summed in absolute value, summed
over the data-parallel group and scaled as DDP scales the gradients (1 / data ranks). Only
reads: main_grad is never written.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def recorded_on(side, model, cap) -> bool:
    """Whether ``side`` records its terms: GTP off (every main_grad sums locally), one model
    chunk, dense (expert grads reduce over other groups), no sequence parallelism (finalize sums
    LayerNorm grads over TP too: terms on other ranks), DDP reducing after the backward (an
    overlapped reduce starts inside it), a mean loss (DDP's 1/data-ranks scaling), full tensors."""
    return (side.gtp == 1 and side.pipeline_parallel == 1 and model.num_experts == 0
            and not side.sequence_parallel and not side.overlap_grad_reduce and side.per_token_loss == "none"
            and cap.policy.mode == "full" and cap.wants("main_grad"))


def _summed_over_tp(side, model, name: str) -> bool:
    """finalize_model_grads sums the q/k LayerNorms' grads over TP where ``qk_layernorm`` is on
    (``_allreduce_non_tensor_model_parallel_grads``, finalize_model_grads.py l.451-453): each TP
    rank holds the terms of its own heads, so no rank's are all of them."""
    return side.tp > 1 and model.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)


class GradTerms:
    """Per step: ``micro_batch_done`` after each micro-batch's backward, ``record`` before DDP
    reduces. Inactive (every call a no-op) where :func:`recorded_on` says no."""

    def __init__(self, side, model, cap, named: list[tuple[str, torch.Tensor]]):
        self.cap = cap
        self.named = [(n, p) for n, p in named if getattr(p, "main_grad", None) is not None
                      and not _summed_over_tp(side, model, n)] if recorded_on(side, model, cap) else []
        self.prev: dict[str, torch.Tensor] = {}
        self.abs_sum: dict[str, torch.Tensor] = {}

    def begin_step(self) -> None:
        self.prev = {n: torch.zeros(p.main_grad.shape, dtype=torch.float64) for n, p in self.named}
        self.abs_sum = {n: torch.zeros_like(t) for n, t in self.prev.items()}

    def micro_batch_done(self) -> None:
        for n, p in self.named:
            now = p.main_grad.detach().double()
            self.abs_sum[n] += (now - self.prev[n]).abs()
            self.prev[n] = now

    def record(self, layout_of, group) -> None:
        if not self.named:
            return
        self.micro_batch_done()  # the last micro-batch's term
        scale = 1.0 / dist.get_world_size(group)  # DDP's gradient_scaling_factor for a mean loss
        # One collective for all of them, as DDP reduces a bucket: a rank that is lost fails
        # every peer in the same call.
        flat = torch.cat([self.abs_sum[n].reshape(-1) for n, _ in self.named])
        dist.all_reduce(flat, group=group)
        flat.mul_(scale)
        by_param, at = {}, 0
        for n, p in self.named:
            size = self.abs_sum[n].numel()
            by_param[id(p)] = flat[at:at + size].view(self.abs_sum[n].shape)
            at += size
        self.cap.params("grad_terms", self.named, layout_of, value=lambda p: by_param.get(id(p)))
