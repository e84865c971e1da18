"""The conformance clauses by id (:mod:`.clauses`, and :mod:`.te_clauses` for the parts of TE's
contract its review flagged): :data:`TRACE_CLAUSES` judge one observation,
:data:`PAIR_CLAUSES` the same case with and without overlap, :data:`CLAUSES` (id -> one-line
description, from each clause's docstring) for tables and reports."""

from __future__ import annotations

from typing import Callable

from harness.conformance.clauses import (
    check_async_equivalence,
    check_backward_alias,
    check_backward_values,
    check_capability_marker,
    check_finalize_accumulates,
    check_finalize_flag,
    check_finalize_padding,
    check_finalize_return,
    check_finalize_values,
    check_forward_alias,
    check_forward_fresh,
    check_forward_repeat,
    check_forward_values,
    check_grad_buffer,
    check_layout,
    check_leader_communication,
    check_leader_serves_group,
    check_plain_passthrough,
)
from harness.conformance.drive import Observation
from harness.conformance.failures import Failure
from harness.conformance.te_clauses import (
    check_dispatch_contract,
    check_finalize_in_place,
    check_fused_mlp_routed_expert,
)

TRACE_CLAUSES: dict[str, Callable[[Observation], list[Failure]]] = {
    "capability.marker": check_capability_marker,
    "capability.plain_passthrough": check_plain_passthrough,
    "dispatch.contract": check_dispatch_contract,
    "layout.shard": check_layout,
    "forward.values": check_forward_values,
    "forward.repeat": check_forward_repeat,
    "forward.fresh_after_update": check_forward_fresh,
    "forward.no_inflight_alias": check_forward_alias,
    "backward.values": check_backward_values,
    "backward.no_inflight_alias": check_backward_alias,
    "grad_buffer.spec": check_grad_buffer,
    "finalize.return": check_finalize_return,
    "finalize.values": check_finalize_values,
    "finalize.accumulates": check_finalize_accumulates,
    "finalize.padding": check_finalize_padding,
    "finalize.flag": check_finalize_flag,
    "finalize.in_place": check_finalize_in_place,
    "leader.serves_group": check_leader_serves_group,
    "leader.communication": check_leader_communication,
    "fused_mlp.routed_expert": check_fused_mlp_routed_expert,
}

PAIR_CLAUSES: dict[str, Callable[[Observation, Observation], list[Failure]]] = {
    "async.equivalence": check_async_equivalence,
}

CLAUSES: dict[str, str] = {
    name: " ".join(fn.__doc__.replace("``", "").split())
    for name, fn in (*TRACE_CLAUSES.items(), *PAIR_CLAUSES.items())
}
"""Clause id -> what it checks, for tables and reports."""
