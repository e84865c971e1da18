"""Process groups and the collectives of TP x GTP x DP, written on plain torch.distributed.

Ranks are ordered as megatron-core orders them (:mod:`harness.common.mesh`). Every collective is an autograd
function or a plain call with the reduction megatron-core performs at the same point:

- TP: column-parallel inputs are copied (backward: SUM all-reduce of the input grad),
  row-parallel outputs and the vocab-parallel embedding are SUM all-reduced (backward: copy).
- GTP: a weight shard is all-gathered before its GEMM and the pad rows stripped; its
  gradient is zero-padded, pre-scaled by 1/G and SUM reduce-scattered into the shard's
  ``main_grad`` (megatron-core's ``_prescale_wgrads_for_mean_rs`` + reduce-scatter).
- ``ReduceOp.AVG`` does not exist on gloo: averages are a SUM followed by a divide, as the
  megatron backend's CPU layer does it.

A group of one rank is ``None`` and every collective on it is skipped, so the same code runs
in one process without torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from harness.common.mesh import Mesh
from harness.scenario.schema import Side


@dataclass(frozen=True)
class Groups:
    """The calling rank's process groups (None where the group has one rank)."""

    tp: object
    """Tensor parallel: same (g, dp)."""
    gtp: object
    """GTP remat: same (tp, dp); the group a GTP weight is gathered and reduce-scattered over."""
    dp: object
    """Replicate data parallel: same (tp, g); DDP's group."""
    data: object
    """Data distribution (GTP x DP): same tp; losses are reported over it."""
    model: object
    """Model parallel (TP x GTP): same dp; grad norm and zero counts are summed over it."""
    amax: object
    """FP8 amax reduction (TP x GTP x DP, megatron-core's ``get_amax_reduction_group``)."""


# The mesh axes each group spans.
SPANS = {"tp": ("tp",), "gtp": ("gtp",), "dp": ("dp",), "data": ("gtp", "dp"), "model": ("tp", "gtp"),
         "amax": ("tp", "gtp", "dp")}
_CACHE: dict[tuple[int, int, int], Groups] = {}


def groups_for(side: Side) -> Groups:
    """This rank's groups for ``side``'s mesh; created once per mesh and process.

    ``dist.new_group`` must be called by every rank for every group in the same order, so
    all groups of an axis are created even where this rank is not a member.
    """
    if side.world_size == 1 or not dist.is_initialized():
        return Groups(None, None, None, None, None, None)
    key = (side.world_size, side.tp, side.gtp)
    if key in _CACHE:
        return _CACHE[key]
    rank, mesh = dist.get_rank(), Mesh.of_side(side)
    made = {}
    for name, axes in SPANS.items():
        mine = None
        for ranks in mesh.groups(*axes):
            if len(ranks) == 1:
                continue
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = group
        made[name] = mine
    groups = Groups(**made)
    _CACHE[key] = groups
    return groups


def kept_groups() -> set:
    """The groups :func:`groups_for` keeps for later sides of this process."""
    return {g for groups in _CACHE.values() for f in fields(groups)
            if (g := getattr(groups, f.name)) is not None}


def size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In place; a no-op on a one-rank group."""
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t


def all_reduce_avg(t: torch.Tensor, group) -> torch.Tensor:
    """Mean over the group as gloo gets it: SUM, then divide by the group size."""
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        t.div_(size(group))
    return t


def all_gather_dim(t: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Concatenation of every rank's ``t`` along ``dim``, in group-rank order."""
    if group is None:
        return t
    parts = [torch.empty_like(t) for _ in range(size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def reduce_scatter_rows(t: torch.Tensor, group) -> torch.Tensor:
    """SUM over the group of ``t``, this rank's block of dim-0 rows."""
    n = size(group)
    if group is None:
        return t
    out = torch.empty((t.shape[0] // n, *t.shape[1:]), dtype=t.dtype)
    dist.reduce_scatter_single(out, t.contiguous(), group=group)
    return out


class _CopyToTP(torch.autograd.Function):
    """Column-parallel input: identity forward, SUM all-reduce of the input grad over TP."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.contiguous().clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """Row-parallel output, vocab-parallel embedding: SUM all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _ReduceFromTP.apply(x, group)


class _GatherGTP(torch.autograd.Function):
    """All-gather a GTP shard (pad rows stripped); backward reduce-scatters the weight grad
    into ``shard.main_grad`` and gives the shard no ``.grad`` (megatron-core's is a dummy)."""

    @staticmethod
    def forward(ctx, shard, group, pad):
        ctx.shard, ctx.group, ctx.pad = shard, group, pad
        full = all_gather_dim(shard.detach(), group)
        return full[: full.shape[0] - pad] if pad else full

    @staticmethod
    def backward(ctx, grad):
        wgrad = grad.contiguous().clone()
        wgrad.mul_(1.0 / size(ctx.group))  # so that the SUM reduce-scatter gives the GTP mean
        if ctx.pad:
            wgrad = torch.nn.functional.pad(wgrad, (0, 0, 0, ctx.pad))
        shard_grad = reduce_scatter_rows(wgrad, ctx.group)
        ctx.shard.main_grad.add_(shard_grad.to(ctx.shard.main_grad.dtype))
        return None, None, None


def gather_gtp(shard: torch.Tensor, group, pad: int) -> torch.Tensor:
    """The full TP-local weight of a GTP shard, differentiable back into ``shard.main_grad``."""
    return _GatherGTP.apply(shard, group, pad)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross entropy over vocab-sharded logits, step for step as megatron-core's
    ``tensor_parallel.cross_entropy`` (max, shifted exp-sum and target logit all-reduced over TP;
    backward = softmax - one-hot, times the incoming grad)."""

    @staticmethod
    def forward(ctx, logits, target, group):
        logits = logits.clone()
        logits_max = torch.max(logits, dim=-1)[0]
        all_reduce(logits_max, group, op=dist.ReduceOp.MAX)
        part = logits.shape[-1]
        start = group_rank(group) * part
        logits -= logits_max.unsqueeze(dim=-1)
        target_mask = (target < start) | (target >= start + part)
        masked_target = target.clone() - start
        masked_target[target_mask] = 0
        logits_2d = logits.view(-1, part)
        masked_target_1d = masked_target.view(-1)
        arange_1d = torch.arange(logits_2d.shape[0])
        predicted = logits_2d[arange_1d, masked_target_1d].clone().contiguous().view_as(target)
        predicted[target_mask] = 0.0
        exp_logits = logits
        torch.exp(logits, out=exp_logits)
        sum_exp = exp_logits.sum(dim=-1)
        all_reduce(predicted, group)
        all_reduce(sum_exp, group)
        loss = torch.log(sum_exp) - predicted
        exp_logits.div_(sum_exp.unsqueeze(dim=-1))
        ctx.save_for_backward(exp_logits, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_input = softmax.clone()
        grad_2d = grad_input.view(-1, softmax.shape[-1])
        arange_1d = torch.arange(grad_2d.shape[0])
        update = 1.0 - target_mask.view(-1).to(softmax.dtype)
        grad_2d[arange_1d, masked_target_1d] -= update
        grad_input.mul_(grad_output.unsqueeze(dim=-1))
        return grad_input, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group) -> torch.Tensor:
    """Per-token loss [s, b] from TP-local logits [s, b, V/TP] (fp32, fp64 kept) and targets [s, b]."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return _VocabParallelCrossEntropy.apply(logits.to(dtype), target, group)
