"""A known-good DistributedWeight on plain torch.distributed, and planted-faulty variants.

:class:`ReferenceWeight` holds its rank's rows of the zero-padded logical weight (the layout in
:mod:`harness.conformance.layout`). Materialization all-gathers dim 0 over the GTP group in one
round for the whole group and strips the padding; finalization zero-pads each wgrad, SUM
reduce-scatters the group's wgrads in one round in ``main_grad``'s dtype, divides by G (unless
per-token loss asks for the sum), and adds into ``main_grad``. Everything is synchronous. A
grouped leader also carries ``is_routed_expert`` and ``weight_list``, as TE's fused grouped MLP
asks (and megatron-core sets).

Each faulty variant changes one step and exists to prove the kit rejects it, naming the clause:

=====================  ==========================================  ============================
factory                fault                                        clause that must fail
=====================  ==========================================  ============================
wrong_shard_order      gathers shards in reverse rank order         forward.values
missing_mean           sums where the mean is due                   finalize.values
stale_cache            returns the first forward result forever     forward.fresh_after_update
leaked_padding         writes ones into main_grad's pad rows        finalize.padding
overwrites_grad        copies into main_grad instead of adding      finalize.accumulates
leader_only            the leader serves only itself                leader.serves_group
clobbering_prefetch    prefetches the next weight into the buffer   forward.no_inflight_alias
                       it just returned
rebinds_main_grad      binds main_grad to a new tensor (right       finalize.in_place
                       values) instead of adding in place
unmarked_experts       grouped weights without is_routed_expert     fused_mlp.routed_expert
                       and weight_list
=====================  ==========================================  ============================
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness.conformance import layout
from harness.conformance.drive import smoke_cases


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


class ReferenceWeight(torch.nn.Parameter):
    """A GTP-style dim-0 sharded weight; the factory sets the attributes below."""

    is_distributed_weight = True
    group: dist.ProcessGroup
    """GTP group the weight is sharded over."""
    rows: int
    """Logical (unpadded) dim 0."""
    reduction: str
    """Reduction over the group: "mean" or "sum"."""
    members: list["ReferenceWeight"]
    """The group this weight leads (itself alone for a Linear)."""
    next_leader: "ReferenceWeight | None" = None
    """Leader of the next group in forward order."""

    def __new__(cls, shard: torch.Tensor):
        return super().__new__(cls, shard, requires_grad=True)

    # --- the protocol -------------------------------------------------------------------------

    def materialize_group_for_forward(self):
        """All-gather every member of the group (one round) and strip the padding."""
        return self._unwrap(self._gather(self.members))

    def materialize_group_for_backward(self):
        """Same tensors as forward: the rowwise logical weights."""
        return self._unwrap(self._gather(self.members))

    def finalize_group_grads(self, wgrads):
        """Reduce-scatter the group's wgrads into each member's ``main_grad``; return dummies."""
        wgrads = _as_list(wgrads)
        size = self.group.size()
        # One flat buffer: rank r's chunk holds its rows of every member, members back to back.
        chunks = [
            self._pad(g.to(w.main_grad.dtype)).reshape(size, -1)
            for w, g in zip(self.members, wgrads)
        ]
        send = torch.cat(chunks, dim=1).reshape(-1)
        received = send.new_empty(send.numel() // size)
        dist.reduce_scatter_tensor(received, send, op=dist.ReduceOp.SUM, group=self.group)
        if self.reduction == "mean":
            received /= size
        offset = 0
        for w in self.members:
            part = received[offset : offset + w.main_grad.numel()].view_as(w.main_grad)
            self._accumulate(w, part)
            w.grad_added_to_main_grad = True
            offset += w.main_grad.numel()
        return self._unwrap([torch.zeros_like(w.detach()) for w in self.members])

    def grad_buffer(self) -> torch.Tensor:
        """A fresh logical-shape buffer in ``main_grad``'s dtype, so reducing does not round."""
        shape = (self.rows, *self.shape[1:])
        return torch.empty(shape, dtype=self.main_grad.dtype, device=self.device)

    # --- steps the faulty variants replace ----------------------------------------------------

    def _gather(self, weights: list["ReferenceWeight"]) -> list[torch.Tensor]:
        size = self.group.size()
        shards = [w.detach().as_subclass(torch.Tensor) for w in weights]
        flat = torch.cat([s.reshape(-1) for s in shards])
        out = flat.new_empty(size * flat.numel())
        dist.all_gather_into_tensor(out, flat, group=self.group)
        return self._split(out.view(size, -1), weights, shards)

    def _split(self, per_rank: torch.Tensor, weights, shards) -> list[torch.Tensor]:
        result, offset = [], 0
        for w, s in zip(weights, shards):
            full = per_rank[:, offset : offset + s.numel()].reshape(-1, *s.shape[1:])
            result.append(full[: w.rows].clone())
            offset += s.numel()
        return result

    def _pad(self, wgrad: torch.Tensor) -> torch.Tensor:
        return layout.pad_dim0(wgrad, self.shape[0] * self.group.size())

    def _accumulate(self, weight: "ReferenceWeight", part: torch.Tensor) -> None:
        weight.main_grad.add_(part)

    def _unwrap(self, items: list):
        return items if len(self.members) > 1 else items[0]


class _WrongShardOrder(ReferenceWeight):
    def _split(self, per_rank, weights, shards):
        return super()._split(per_rank.flip(0), weights, shards)


class _MissingMean(ReferenceWeight):
    def finalize_group_grads(self, wgrads):
        self.reduction = "sum"
        return super().finalize_group_grads(wgrads)


class _StaleCache(ReferenceWeight):
    _cached = None

    def materialize_group_for_forward(self):
        if self._cached is None:
            self._cached = super().materialize_group_for_forward()
        return self._cached


class _LeakedPadding(ReferenceWeight):
    def _pad(self, wgrad):
        padded = super()._pad(wgrad)
        padded[wgrad.shape[0] :] = 1.0
        return padded


class _OverwritesGrad(ReferenceWeight):
    def _accumulate(self, weight, part):
        weight.main_grad.copy_(part)


class _RebindsMainGrad(ReferenceWeight):
    def _accumulate(self, weight, part):
        weight.main_grad = weight.main_grad + part  # right values, but DDP's view never sees them


class _LeaderOnly(ReferenceWeight):
    def materialize_group_for_forward(self):
        return self._gather([self])

    def materialize_group_for_backward(self):
        return self._gather([self])

    def finalize_group_grads(self, wgrads):
        members, self.members = self.members, [self]
        try:
            return [super().finalize_group_grads(_as_list(wgrads)[0])]
        finally:
            self.members = members


class _ClobberingPrefetch(ReferenceWeight):
    """Gathers into one scratch buffer shared by all weights and prefetches the next weight
    into it asynchronously before the caller has used the tensor just returned."""

    scratch: dict = {}
    _pending = None

    def _buffer(self) -> torch.Tensor:
        numel = self.numel() * self.group.size()
        key = self.dtype
        if key not in self.scratch or self.scratch[key].numel() < numel:
            self.scratch[key] = torch.empty(4 * numel, dtype=self.dtype, device=self.device)
        return self.scratch[key][:numel].view(-1, *self.shape[1:])

    def materialize_group_for_forward(self):
        if len(self.members) > 1:
            return super().materialize_group_for_forward()
        out = self._buffer()
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        else:
            dist.all_gather_into_tensor(
                out, self.detach().as_subclass(torch.Tensor), group=self.group
            )
        nxt = self.next_leader
        if nxt is not None:
            shard = nxt.detach().as_subclass(torch.Tensor)
            nxt._pending = dist.all_gather_into_tensor(
                nxt._buffer(), shard, group=nxt.group, async_op=True
            )
        return out[: self.rows]


def _build(
    cls,
    *,
    logical_weights,
    gtp_group,
    main_grad_dtype,
    pad_for_alignment,
    per_token_loss,
    group_size,
    **_,
):
    """Shard the logical weights into ``cls`` instances, chained and grouped as asked."""
    size, rank = gtp_group.size(), gtp_group.rank()
    device = (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    )
    weights = []
    for logical in logical_weights:
        rows = layout.padded_rows(logical.shape[0], size, pad_for_alignment)
        cut = layout.shard_slice(logical.shape[0], size, pad_for_alignment, rank)
        w = cls(layout.pad_dim0(logical, rows)[cut].clone().to(device))
        w.group, w.rows = gtp_group, logical.shape[0]
        w.reduction = "sum" if per_token_loss else "mean"
        w.main_grad = torch.zeros(w.shape, dtype=main_grad_dtype, device=w.device)
        w.is_routed_expert, w.weight_list = group_size > 1, None
        weights.append(w)
    leaders = weights[::group_size]
    for i, lead in enumerate(leaders):
        lead.members = weights[i * group_size : (i + 1) * group_size]
        lead.next_leader = leaders[i + 1] if i + 1 < len(leaders) else None
        if group_size > 1:
            lead.weight_list = lead.members
    return weights


def reference(**kwargs) -> list[ReferenceWeight]:
    """Factory for the known-good reference implementer."""
    return _build(ReferenceWeight, **kwargs)


def wrong_shard_order(**kwargs):
    """Faulty: reverse rank order in the gather."""
    return _build(_WrongShardOrder, **kwargs)


def missing_mean(**kwargs):
    """Faulty: SUM where the mean is due."""
    return _build(_MissingMean, **kwargs)


def stale_cache(**kwargs):
    """Faulty: forward materialization cached forever."""
    return _build(_StaleCache, **kwargs)


def leaked_padding(**kwargs):
    """Faulty: non-zero pad rows in main_grad (only on ranks that hold pad rows)."""
    return _build(_LeakedPadding, **kwargs)


def overwrites_grad(**kwargs):
    """Faulty: main_grad overwritten instead of accumulated."""
    return _build(_OverwritesGrad, **kwargs)


def leader_only(**kwargs):
    """Faulty: a group leader materializes and finalizes only itself."""
    return _build(_LeaderOnly, **kwargs)


def rebinds_main_grad(**kwargs):
    """Faulty: main_grad rebound to a new tensor holding the right values."""
    return _build(_RebindsMainGrad, **kwargs)


def unmarked_experts(**kwargs):
    """Faulty: grouped weights without the attributes TE's fused grouped MLP asserts on."""
    weights = _build(ReferenceWeight, **kwargs)
    for w in weights:
        del w.is_routed_expert, w.weight_list
    return weights


def clobbering_prefetch(**kwargs):
    """Faulty: async prefetch into the buffer backing the tensor just returned."""
    _ClobberingPrefetch.scratch.clear()
    return _build(_ClobberingPrefetch, **kwargs)


for _factory in (
    wrong_shard_order,
    missing_mean,
    stale_cache,
    leaked_padding,
    overwrites_grad,
    leader_only,
    clobbering_prefetch,
    rebinds_main_grad,
    unmarked_experts,
):
    _factory.cases = smoke_cases  # each fault shows in the two smoke cases; no need for more

FAULTY = {
    "wrong_shard_order": "forward.values",
    "missing_mean": "finalize.values",
    "stale_cache": "forward.fresh_after_update",
    "leaked_padding": "finalize.padding",
    "overwrites_grad": "finalize.accumulates",
    "leader_only": "leader.serves_group",
    "clobbering_prefetch": "forward.no_inflight_alias",
    "rebinds_main_grad": "finalize.in_place",
    "unmarked_experts": "fused_mlp.routed_expert",
}
"""Faulty factory name -> the clause that must reject it."""
