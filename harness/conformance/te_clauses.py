"""Clauses on the parts of TE's contract its PR review flagged, and on the dispatchers themselves.

- ``dispatch.contract``: the dispatchers being driven keep TE 2.20.2's list contract.
- ``finalize.in_place``: TE's grouped ops discard ``finalize_weight_grads``' return, so the
  reduction must reach ``main_grad`` in place.
- ``fused_mlp.routed_expert``: TE's fused grouped MLP asserts on two attributes the protocol
  does not name.
"""

from __future__ import annotations

from harness.conformance.drive import Observation
from harness.conformance.failures import Failure, NotApplicable, failure


def check_dispatch_contract(trace: Observation) -> list[Failure]:
    """The dispatchers driven keep TE 2.20.2's list contract, checked on probe weights: a bare
    weight is a list of one, only the leader's method runs (a bare leader serves its group, as
    the fused grouped MLP calls it), finalize hands the leader a bare wgrad for a group of one
    and the list for N, results come back as lists, and a marker on a non-tensor is a
    TypeError. Fails when a new TE release or a broken mirror changes what the clauses assume."""
    expected = "TE 2.20.2's dispatcher contract"
    return [
        failure("dispatch.contract", trace, None, expected, found=problem)
        for problem in trace.dispatch_problems
    ]


def check_finalize_in_place(trace: Observation) -> list[Failure]:
    """``finalize_group_grads`` updates ``main_grad`` in place: after every walk it is the very
    tensor over the same memory the factory attached (MCore DDP's bucket view). TE's
    ops.GroupedLinear and fused GroupedMLP discard finalize's return, as the kit does, so the
    reduction reaches the optimizer only through this update."""
    failures = []
    for mb, moves in enumerate(trace.main_grad_moves):
        for i, what in enumerate(moves):
            if what:
                expected = f"main_grad updated in place in micro-batch {mb}"
                failures.append(failure("finalize.in_place", trace, i, expected, found=what))
    return failures


def check_fused_mlp_routed_expert(trace: Observation) -> list[Failure]:
    """For TE's fused grouped MLP (ops/fused/grouped_mlp.py), outside the protocol: each
    grouped leader has a truthy ``is_routed_expert`` and a ``weight_list`` that is not None.
    An implementer must add them for that path; single-weight groups never reach it."""
    n = trace.case.group_size
    if n == 1:
        raise NotApplicable("only grouped (routed-expert) weights reach TE's fused grouped MLP")
    failures = []
    for index in range(0, len(trace.capability), n):
        facts = trace.capability[index]
        problems = []
        if facts["is_routed_expert"] is not True:
            problems.append(f"is_routed_expert is {facts['is_routed_expert']}")
        if facts["weight_list"] in ("absent", "None"):
            problems.append(f"weight_list is {facts['weight_list']}")
        if problems:
            expected = "a grouped leader with is_routed_expert and a weight_list"
            failures.append(
                failure("fused_mlp.routed_expert", trace, index, expected, found="; ".join(problems))
            )
    return failures
