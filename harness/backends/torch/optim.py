"""Optimizer, LR schedule, grad norm and clipping, for full tensors or shards alike.

AdamW (decoupled weight decay, as megatron-core's Adam) or SGD with megatron-core's parameter
groups (no weight decay on 1-D params and biases), on the params or, for bf16 params, on fp32
master copies (megatron-core's Float16 optimizer), or (the golden only) megatron-core's Muon
on whole matrices (:mod:`.muon`); global grad-norm clipping with the
``max_norm / (norm + 1e-6)`` coefficient; Megatron-LM's LR schedule counted in samples,
written out here independently so it checks megatron-core's too. Adam's and SGD's updates are
elementwise, so a shard steps exactly as its rows of the full tensor do (GTP pad rows have zero grads and
stay zero, weight decay included).
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from harness.backends.gpt import param_specs
from harness.common.muon import is_muon_matrix
from harness.scenario.schema import Side

from . import comm


def lr_at(side: Side, step: int, global_batch: int) -> float:
    """LR applied by the optimizer at ``step`` (1-based), as Megatron-LM schedules it.

    Megatron-LM steps the scheduler after the optimizer, in samples, so step ``s`` uses
    the LR of ``(s - 1) * global_batch`` samples (0 for the first warmup step).
    """
    n = (step - 1) * global_batch
    warmup = side.lr_warmup_steps * global_batch
    decay = (side.lr_decay_steps or side.steps) * global_batch
    if warmup > 0 and n <= warmup:
        return side.lr * n / warmup
    if side.lr_decay_style == "constant":
        return side.lr
    if n > decay:
        return side.min_lr
    ratio = (n - warmup) / (decay - warmup)
    coeff = 1.0 - ratio if side.lr_decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return side.min_lr + coeff * (side.lr - side.min_lr)


def build_optimizer(side: Side, named: Iterable[tuple[str, torch.Tensor]],
                    model=None) -> torch.optim.Optimizer:
    """The optimizer over (canonical name, tensor) pairs: the params, or their fp32 masters.
    Muon (the golden only; ``model`` names the QKV split) steps the matrices megatron-core's
    Muon steps and AdamW the rest (:mod:`.muon`)."""
    named = list(named)
    if side.optimizer == "muon":
        from . import muon

        matrices = [(n, p) for n, p in named if is_muon_matrix(n, p.dim())]
        rest = [(n, p) for n, p in named if not is_muon_matrix(n, p.dim())]
        qkv = {id(p): muon.qkv_split_shapes(model) for n, p in matrices if n.endswith("linear_qkv.weight")}
        dims = {id(p): spec.tp_dim for spec in param_specs(model) for n, p in matrices if n == spec.name}
        golden = muon.GoldenMuon(_groups(side, matrices), side.lr, side.weight_decay, qkv, side.muon_blocks,
                                 dims) if matrices else None
        adam = _adam(side, _groups(side, rest)) if rest else None
        return muon.Chained(golden, adam)
    groups = _groups(side, named)
    if side.optimizer == "adam":
        return _adam(side, groups)
    return torch.optim.SGD(groups, lr=side.lr, momentum=side.sgd_momentum)


def _groups(side: Side, named: list) -> list[dict]:
    """megatron-core's parameter groups: no weight decay on 1-D params and biases."""
    decay, no_decay = [], []
    for name, p in named:
        (no_decay if p.dim() == 1 or name.endswith(".bias") else decay).append(p)
    groups = [{"params": decay, "weight_decay": side.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return groups


def _adam(side: Side, groups: list[dict]) -> torch.optim.Optimizer:
    betas = (side.adam_beta1, side.adam_beta2)
    return torch.optim.AdamW(groups, lr=side.lr, betas=betas, eps=side.adam_eps)


def clip(grads: Iterable[torch.Tensor], max_norm: float, norm: float) -> None:
    """Scale grads in place by ``max_norm / (norm + 1e-6)`` when that is below 1."""
    if max_norm > 0:
        coeff = max_norm / (norm + 1e-6)
        if coeff < 1.0:
            for g in grads:
                g.mul_(coeff)


def counted(param: torch.Tensor, layout, coord: dict) -> bool:
    """Whether this rank's copy of a grad enters the norm and the zero count, as megatron-core
    counts them (``param_is_not_tensor_parallel_duplicate`` and ``param_is_not_gtp_duplicate``, each
    on its own axis): over TP, a TP shard on every rank and a TP replica on TP rank 0; over GTP, a
    GTP shard on every rank and a GTP replica (a norm, a bias beside a GTP-sharded weight, TP-sharded
    or not) on GTP rank 0. DP replicas each compute the same total."""
    tp_sharded = "tp" in layout.placements and layout.mesh.get("tp", 1) > 1
    return ((tp_sharded or coord["tp"] == 0)
            and (getattr(param, "is_gtp_weight_remat", False) or coord["gtp"] == 0))


def grad_stats(named, layouts: dict, coord: dict, group) -> tuple[float, float]:
    """(grad norm, zero count) of ``main_grad`` over every shard, summed over the model-parallel
    group; pad rows are counted, as megatron-core counts them."""
    sq = torch.zeros(1, dtype=torch.float64)
    zeros = torch.zeros(1, dtype=torch.float64)
    for name, p in named:
        if counted(p, layouts[name], coord):
            g = p.main_grad.double()
            sq += (g * g).sum()
            zeros += float(g.numel() - int(torch.count_nonzero(g)))
    comm.all_reduce(sq, group)
    comm.all_reduce(zeros, group)
    return float(sq.sqrt()), float(zeros)
