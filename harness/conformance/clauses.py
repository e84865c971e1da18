"""The conformance clauses: plain functions from a recorded trace to a list of failure records.

Each clause judges one :class:`~harness.conformance.drive.Observation` (one rank, one case, one mode)
and returns :class:`~harness.conformance.failures.Failure` records; an empty list is a pass.
``async.equivalence`` judges a pair of traces, the same case driven with the prefetch chain and async
reduction on and off. :mod:`harness.conformance.registry` names them.
"""

from __future__ import annotations

from typing import Callable

import torch

from harness.conformance import layout
from harness.conformance.drive import UPDATE_FACTOR, Observation
from harness.conformance.failures import Failure, compare_tensors, failure

MAX_ROUNDS_PER_CALL = 2
"""One round for the group's own data plus at most one prefetch of the next group."""


def _flat(trace: Observation, module: int, member: int) -> int:
    return module * trace.case.group_size + member


def _phase(microbatch: int) -> str:
    return "after the optimizer step" if microbatch < 0 else f"in micro-batch {microbatch}"


def _materialized(trace: Observation, clause: str, kind: str, wanted: Callable[[int], bool]) -> list:
    """Returned tensors equal the logical weights bitwise (scaled after the update step)."""
    failures = []
    for call in trace.calls:
        if call.kind != kind or not wanted(call.microbatch):
            continue
        scale = UPDATE_FACTOR if call.microbatch < 0 else 1.0
        for j, got in enumerate(call.results[: trace.case.group_size]):
            if j in call.aliased:
                continue  # the copy raced an in-flight write; reported by *.no_inflight_alias
            want = trace.logical(call.module, j) * scale
            mismatch = compare_tensors(got, want)
            if mismatch:
                expected = (
                    f"{kind} materialization {_phase(call.microbatch)} bitwise equal to the "
                    f"logical weight{' x ' + str(scale) if scale != 1.0 else ''} "
                    f"{tuple(want.shape)} {want.dtype}"
                )
                failures.append(
                    failure(clause, trace, _flat(trace, call.module, j), expected, **mismatch)
                )
    return failures


def check_capability_marker(trace: Observation) -> list[Failure]:
    """Every weight is a strict torch.Tensor subclass with ``is_distributed_weight = True``, the
    dispatcher recognizes it, and it is an instance of (TE's) runtime-checkable
    ``DistributedWeight`` protocol: the marker and all four methods."""
    failures = []
    for i, facts in enumerate(trace.capability):
        problems = []
        if not facts["is_tensor"]:
            problems.append(f"{facts['type']} is not a torch.Tensor")
        elif not facts["strict_subclass"]:
            problems.append(f"{facts['type']} is a plain tensor class, not a subclass")
        if facts["marker"] is not True:
            problems.append(f"is_distributed_weight is {facts['marker']!r}")
        if facts["dispatch"] is not True:
            problems.append(f"the dispatcher answered {facts['dispatch']!r}")
        if facts["protocol"] is not True:
            missing = ", ".join(facts["missing"]) or "a member"
            problems.append(f"not a DistributedWeight: it lacks {missing}")
        if problems:
            expected = "a torch.Tensor subclass with is_distributed_weight = True"
            failures.append(
                failure("capability.marker", trace, i, expected, found="; ".join(problems))
            )
    return failures


def check_plain_passthrough(trace: Observation) -> list[Failure]:
    """Plain tensors and nn.Parameters are not distributed weights; the dispatchers return them
    (and their wgrads) as the very same objects."""
    expected = "plain tensors passed through untouched"
    return [
        failure("capability.plain_passthrough", trace, None, expected, found=p)
        for p in trace.passthrough
    ]


def check_layout(trace: Observation) -> list[Failure]:
    """Each rank's local shard is bitwise its rows of the zero-padded logical weight."""
    case, failures = trace.case, []
    for i, got in enumerate(trace.shards):
        module, member = divmod(i, case.group_size)
        logical = trace.logical(module, member)
        rows = layout.padded_rows(logical.shape[0], case.gtp, case.pad_for_alignment)
        cut = layout.shard_slice(
            logical.shape[0], case.gtp, case.pad_for_alignment, trace.coords.gtp_rank
        )
        mismatch = compare_tensors(got, layout.pad_dim0(logical, rows)[cut])
        if mismatch:
            expected = f"padded rows [{cut.start}, {cut.stop}) of {rows} (pad rows zero)"
            failures.append(failure("layout.shard", trace, i, expected, **mismatch))
    return failures


def check_forward_values(trace: Observation) -> list[Failure]:
    """The first forward walk returns the logical weights bitwise, one per member, in order."""
    return _materialized(trace, "forward.values", "forward", lambda mb: mb == 0)


def check_forward_repeat(trace: Observation) -> list[Failure]:
    """Later micro-batches (prefetch chain established) still return the logical weights."""
    return _materialized(trace, "forward.repeat", "forward", lambda mb: mb > 0)


def check_forward_fresh(trace: Observation) -> list[Failure]:
    """After an in-place update of every shard the next forward reflects it (no stale cache)."""
    return _materialized(trace, "forward.fresh_after_update", "forward", lambda mb: mb < 0)


def check_backward_values(trace: Observation) -> list[Failure]:
    """Every backward materialization equals the logical weights bitwise (updated ones after
    the optimizer step). Quantized columnwise forms are out of scope on CPU."""
    return _materialized(trace, "backward.values", "backward", lambda mb: True)


def _no_inflight_alias(trace: Observation, kind: str) -> list[Failure]:
    clause, failures = f"{kind}.no_inflight_alias", []
    for call in trace.calls:
        if call.kind != kind:
            continue
        for j in call.aliased:
            failures.append(
                failure(
                    clause,
                    trace,
                    _flat(trace, call.module, j),
                    "the returned tensor stays valid while the caller's GEMM runs",
                    found=f"{_phase(call.microbatch)} an async collective issued by this call "
                    "and not yet waited on writes into the returned tensor's memory",
                )
            )
    return failures


def check_forward_alias(trace: Observation) -> list[Failure]:
    """No async collective left in flight by a forward call writes into a tensor it returned."""
    return _no_inflight_alias(trace, "forward")


def check_backward_alias(trace: Observation) -> list[Failure]:
    """No async collective left in flight by a backward call writes into a tensor it returned."""
    return _no_inflight_alias(trace, "backward")


def check_grad_buffer(trace: Observation) -> list[Failure]:
    """Each member's ``grad_buffer()`` has the logical shape and ``main_grad``'s dtype, and
    shares memory with neither ``main_grad`` nor a sibling's buffer."""
    failures, want_dtype = [], trace.case.main_grad_dtype
    for call in trace.calls:
        if call.kind != "grad_buffer":
            continue
        want_shape = tuple(trace.case.shapes[call.module])
        for j, spec in enumerate(call.results):
            problems = []
            if spec["shape"] != want_shape:
                problems.append(f"shape {spec['shape']}")
            if spec["dtype"] != want_dtype:
                problems.append(f"dtype {spec['dtype']} (the reduction would round in it)")
            if spec["aliases_main_grad"]:
                problems.append("it shares memory with main_grad")
            if spec["aliases_sibling"]:
                problems.append("it shares memory with another member's buffer")
            if problems:
                expected = f"a fresh {want_shape} {want_dtype} buffer {_phase(call.microbatch)}"
                failures.append(
                    failure(
                        "grad_buffer.spec",
                        trace,
                        _flat(trace, call.module, j),
                        expected,
                        found="; ".join(problems),
                    )
                )
    return failures


def check_finalize_return(trace: Observation) -> list[Failure]:
    """``finalize_group_grads`` returns, per member, None (async) or a dummy grad of the
    weight's own (shard) shape, usable as the parameter's ``.grad``."""
    failures = []
    for call in trace.calls:
        if call.kind != "finalize":
            continue
        for j, item in enumerate(call.results):
            index = _flat(trace, call.module, j)
            want = tuple(trace.shards[index].shape) if index < len(trace.shards) else None
            if item is not None and item[0] != want:
                failures.append(
                    failure(
                        "finalize.return",
                        trace,
                        index,
                        f"None or a dummy grad of shape {want}",
                        found=f"a tensor of shape {item[0]}",
                    )
                )
    return failures


def _real_rows(trace: Observation, index: int) -> int:
    """How many rows of weight ``index``'s shard on this rank are real (not padding)."""
    case = trace.case
    rows = case.shapes[index // case.group_size][0]
    cut = layout.shard_slice(rows, case.gtp, case.pad_for_alignment, trace.coords.gtp_rank)
    return max(0, min(rows, cut.stop) - cut.start)


def _grad_dtype(trace: Observation, module: int, member: int) -> torch.dtype:
    for call in trace.calls:
        if call.kind == "grad_buffer" and call.module == module and member < len(call.results):
            return layout.dtype_of(call.results[member]["dtype"])
    return layout.dtype_of(trace.case.main_grad_dtype)


def _main_grads(trace: Observation, clause: str, microbatches, pad_only: bool) -> list[Failure]:
    case, failures = trace.case, []
    for mb in microbatches:
        for i, got in enumerate(trace.main_grads[mb]):
            module, member = divmod(i, case.group_size)
            exp = layout.expected_main_grad(
                seed=trace.seed,
                coords=trace.coords,
                module=module,
                member=member,
                shape=case.shapes[module],
                pad_for_alignment=case.pad_for_alignment,
                microbatches=mb + 1,
                reduction=case.reduction,
                grad_dtype=_grad_dtype(trace, module, member),
                main_grad_dtype=layout.dtype_of(case.main_grad_dtype),
            )
            real = exp.real_rows
            if tuple(got.shape) != tuple(exp.value.shape):
                mismatch = {
                    "found": f"main_grad of shape {tuple(got.shape)}, not {tuple(exp.value.shape)}"
                }
            elif pad_only:
                mismatch = compare_tensors(got[real:], exp.value[real:], exp.bound[real:])
            else:
                mismatch = compare_tensors(got[:real], exp.value[:real], exp.bound[:real])
            if mismatch:
                what = (
                    "pad rows exactly zero"
                    if pad_only
                    else f"its rows of the group {case.reduction}"
                )
                expected = f"main_grad after {mb + 1} micro-batch(es) holds {what}"
                failures.append(failure(clause, trace, i, expected, **mismatch))
    return failures


def check_finalize_values(trace: Observation) -> list[Failure]:
    """After the first backward walk (and drain), ``main_grad``'s real rows equal this rank's
    rows of the GTP-group mean of the wgrads (sum under per-token loss), within the rounding
    bound of ``main_grad``'s dtype."""
    return _main_grads(trace, "finalize.values", range(min(1, len(trace.main_grads))), False)


def check_finalize_accumulates(trace: Observation) -> list[Failure]:
    """After micro-batch k, ``main_grad`` holds the sum of k + 1 micro-batches' reductions."""
    return _main_grads(trace, "finalize.accumulates", range(1, len(trace.main_grads)), False)


def check_finalize_padding(trace: Observation) -> list[Failure]:
    """``main_grad``'s pad rows stay exactly zero after every micro-batch."""
    return _main_grads(trace, "finalize.padding", range(len(trace.main_grads)), True)


def check_finalize_flag(trace: Observation) -> list[Failure]:
    """``grad_added_to_main_grad`` (reset to False before each backward, as DDP does) is True
    on every member once the walk and drain are over."""
    failures = []
    for mb, flags in enumerate(trace.flags):
        for i, flag in enumerate(flags):
            if flag is not True:
                expected = f"grad_added_to_main_grad True after micro-batch {mb}"
                failures.append(failure("finalize.flag", trace, i, expected, found=repr(flag)))
    return failures


def check_leader_serves_group(trace: Observation) -> list[Failure]:
    """The leader's single call serves all N members: N tensors from each materialization, N
    items from finalize, and every member's ``main_grad`` written."""
    failures, n = [], trace.case.group_size
    for call in trace.calls:
        if call.kind in ("forward", "backward", "finalize") and len(call.results) != n:
            expected = f"{call.kind} through the leader returns {n} item(s) for its group"
            found = f"{len(call.results)} {_phase(call.microbatch)}"
            failures.append(
                failure(
                    "leader.serves_group",
                    trace,
                    _flat(trace, call.module, 0),
                    expected,
                    found=found,
                )
            )
    for i, grad in enumerate(trace.main_grads[0] if trace.main_grads else []):
        if _real_rows(trace, i) and not bool(grad.any()):
            expected = "the leader's finalize writes every member's main_grad"
            failures.append(
                failure("leader.serves_group", trace, i, expected, found="main_grad still all zero")
            )
    return failures


def check_leader_communication(trace: Observation) -> list[Failure]:
    """Only protocol calls communicate: ``grad_buffer()`` and attribute access issue no
    collective, and each leader call issues at most two rounds (its group, one prefetch)."""
    failures = []
    for call in trace.calls:
        limit = 0 if call.kind == "grad_buffer" else MAX_ROUNDS_PER_CALL
        if call.rounds > limit:
            expected = f"at most {limit} collective round(s) per {call.kind} call"
            found = f"{call.rounds} {_phase(call.microbatch)}"
            failures.append(
                failure(
                    "leader.communication",
                    trace,
                    _flat(trace, call.module, 0),
                    expected,
                    found=found,
                )
            )
    if trace.outside_rounds:
        expected = "no collectives outside protocol calls"
        failures.append(
            failure("leader.communication", trace, None, expected, found=f"{trace.outside_rounds}")
        )
    return failures


def check_async_equivalence(overlap: Observation, serial: Observation) -> list[Failure]:
    """The same case with the prefetch chain and async reduction on and off gives bitwise the
    same materializations and the same ``main_grad`` after every micro-batch."""
    failures = []

    def fail(weight, expected, mismatch):
        failures.append(
            Failure(
                clause="async.equivalence",
                case=overlap.case.name,
                mode="overlap-vs-serial",
                rank=overlap.coords.rank,
                weight=weight,
                expected=expected,
                **mismatch,
            )
        )

    pairs = [
        (a, b) for a, b in zip(overlap.calls, serial.calls) if a.kind in ("forward", "backward")
    ]
    for a, b in pairs:
        for j, (x, y) in enumerate(zip(a.results, b.results)):
            if j in a.aliased or not isinstance(y, torch.Tensor):
                continue
            mismatch = compare_tensors(x, y)
            if mismatch:
                fail(
                    _flat(overlap, a.module, j),
                    f"{a.kind} {_phase(a.microbatch)} as without overlap",
                    mismatch,
                )
    for mb, (xs, ys) in enumerate(zip(overlap.main_grads, serial.main_grads)):
        for i, (x, y) in enumerate(zip(xs, ys)):
            mismatch = compare_tensors(x, y)
            if mismatch:
                fail(i, f"main_grad after micro-batch {mb} as without overlap", mismatch)
    return failures
