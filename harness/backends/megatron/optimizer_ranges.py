"""megatron-core's optimizer wrapper as the trace records it: the optimizers it chains and,
under the DistributedOptimizer, each parameter's gradient, new value and state put together
from the data-parallel ranks' ranges (every rank calls these collectives, for every parameter).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _parts(opt) -> list:
    """The optimizers behind MCore's wrapper (one per param group family when chained)."""
    return list(getattr(opt, "chained_optimizers", None) or [opt])


def _distributed_group(opt):
    """The data-parallel group of MCore's DistributedOptimizer, or None (local optimizer)."""
    for part in _parts(opt):
        if hasattr(part, "gbuf_ranges"):
            return part.data_parallel_group
    return None


def _owned(opt, p):
    """(the DistributedOptimizer part, the range of ``p``'s elements) this data-parallel rank
    owns, or (None, None): a rank's range maps list only the params it owns a part of."""
    for part in _parts(opt):
        for gbuf in getattr(part, "gbuf_ranges", []):
            for buckets in gbuf.values():
                for bucket in buckets:
                    if p in bucket["param_map"]:
                        return part, bucket["param_map"][p]["param"]
    return None, None


def _whole(group, p, r, shard: torch.Tensor | None, dtype=torch.float32) -> torch.Tensor:
    """A tensor of ``p``'s shape from the range ``r`` of it that each data-parallel rank holds
    (``shard``; None where this rank holds none): the ranges are disjoint, so a SUM of
    zero-filled copies is exact. Every rank of the group calls it, for every parameter."""
    full = torch.zeros(p.numel(), dtype=dtype)
    if shard is not None:
        full[r.start:r.end] = shard.detach().reshape(-1)
    dist.all_reduce(full, group=group)
    return full.view(p.shape)


def updated_param(opt):
    """A parameter as the distributed optimizer's ranges hold it (each rank's own range is
    written by its step; the others arrive with the param all-gather)."""
    group = _distributed_group(opt)

    def value(p):
        _, r = _owned(opt, p)
        return _whole(group, p, r, None if r is None else p.detach().reshape(-1)[r.start:r.end], p.dtype)

    return value


def reduced_grad(opt):
    """main_grad after finalize: under the distributed optimizer only this rank's range of
    each grad buffer is reduced, so the whole gradient is put together from every range."""
    group = _distributed_group(opt)

    def value(p):
        grad = getattr(p, "main_grad", None)
        if group is None or grad is None:
            return grad
        _, r = _owned(opt, p)
        return _whole(group, p, r, None if r is None else grad.reshape(-1)[r.start:r.end], grad.dtype)

    return value


# The per-element states of a DistributedOptimizer's range, the same on every rank (whether it
# owns a range or not: each is put together by a collective).
_ADAM_OR_SGD = {"adam": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


def optimizer_state(opt, named) -> tuple[dict, dict]:
    """(states by id of the stepped tensor, fp32 masters by parameter name) across MCore's
    wrapper, which chains one optimizer per param-group family. Under the distributed
    optimizer each state is put together from the data-parallel ranks' ranges."""
    masters, states = {}, {}
    if (group := _distributed_group(opt)) is not None:
        config = _parts(opt)[0].config
        kinds = _ADAM_OR_SGD[config.optimizer] if config.optimizer == "adam" or config.sgd_momentum else ()
        for name, p in named:
            part, r = _owned(opt, p)
            owned = part._get_main_param_and_optimizer_states(p) if part is not None else {}
            master = _whole(group, p, r, owned.get("param"))
            states[id(master) if p.dtype != torch.float32 else id(p)] = {
                k: _whole(group, p, r, owned.get(k)) for k in kinds}
            if p.dtype != torch.float32:  # as the local optimizer: a separate master only in mixed precision
                masters[id(p)] = master
        return states, {name: masters[id(p)] for name, p in named if id(p) in masters}
    for part in _parts(opt):
        for g16, g32 in zip(getattr(part, "float16_groups", []),
                            getattr(part, "fp32_from_float16_groups", [])):
            for p16, p32 in zip(g16, g32):  # mixed precision: the fp32 master copies
                masters[id(p16)] = p32
        states.update({id(p): st for p, st in part.optimizer.state.items()})
    return states, {name: masters[id(p)] for name, p in named if id(p) in masters}
