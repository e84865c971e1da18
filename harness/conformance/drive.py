"""Drive the DistributedWeight protocol the way a training step does, and record what happened.

One :func:`drive` builds a chain of weights through the implementer's factory, then for each
micro-batch walks the forward order (materialize for forward), and the reverse order
(materialize for backward, fill ``grad_buffer()``, finalize), calls the factory's ``drain``
hook if it has one, and snapshots every ``main_grad``. After the last micro-batch it applies an
optimizer-like in-place update to every shard and walks forward and backward once more.

The dispatchers are called the way TE's modules call them: a group of one as a bare weight
(``Linear``, ``LayerNormLinear``: ``materialize_weight_for_forward(weight)[0]``,
``finalize_weight_grads(weight, [wgrad])``), a group of N as its list (``GroupedLinear``).
finalize's return value is recorded but never used, as in TE's grouped ops.

Everything runs under ``torch.no_grad()``, as inside TE's autograd functions. Each protocol
call is wrapped in a :class:`~harness.conformance.protocol.CollectiveRecorder` call log. The
result is a :class:`Observation`: plain data that the clauses in :mod:`harness.conformance.clauses`
judge afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from harness.conformance import layout, te_contract
from harness.conformance.protocol import CollectiveRecorder, Dispatch, overlaps

# An in-place shard update that is exact in every float dtype and keeps pad rows zero, so the
# expected logical weight after the "optimizer step" is known without knowing the layout.
UPDATE_FACTOR = -2.0

DISTINCT_CHAIN = ((40, 24), (24, 40), (56, 24))
"""Three linears whose consecutive padded shapes differ (as in a dense transformer layer)."""
REPEATED_CHAIN = ((40, 24), (40, 24), (24, 40))
"""Two consecutive linears of one shape: buffers keyed by shape alone collide here."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    """One configuration the protocol is driven in."""

    tp: int
    """Tensor-parallel size (the weights handed to the factory are already TP-local)."""
    gtp: int
    """GTP group size G."""
    dtype: str = "float32"
    """Parameter dtype."""
    main_grad_dtype: str = "float32"
    """dtype of each weight's ``main_grad`` (float32 = MCore DDP's grad_reduce_in_fp32)."""
    pad_for_alignment: int = 16
    """Dim-0 alignment a: rows pad to a multiple of a * G; 0 disables padding."""
    per_token_loss: bool = False
    """Sum instead of mean over the GTP group (MCore's calculate_per_token_loss)."""
    shapes: tuple[tuple[int, int], ...] = DISTINCT_CHAIN
    """TP-local logical shape of each module, in forward order."""
    group_size: int = 1
    """Weights per protocol group: 1 for Linear, N for a GroupedLinear of N experts."""
    microbatches: int = 2
    """Forward/backward repetitions before the optimizer step."""

    def __post_init__(self):
        if self.tp < 1 or self.gtp < 1 or self.group_size < 1 or self.microbatches < 1:
            raise ValueError(f"sizes must be positive: {self}")
        layout.dtype_of(self.dtype), layout.dtype_of(self.main_grad_dtype)
        for rows, _ in self.shapes:
            layout.padded_rows(rows, self.gtp, self.pad_for_alignment)

    @property
    def reduction(self) -> str:
        """The GTP-group reduction: "sum" under per-token loss, else "mean"."""
        return "sum" if self.per_token_loss else "mean"

    @property
    def name(self) -> str:
        """Stable, readable id: ``tp1-gtp2/bfloat16/grad-float32/pad16/mean/chain-distinct``."""
        if self.group_size > 1:
            chain = f"grouped-{len(self.shapes)}x{self.group_size}"
        elif self.shapes == DISTINCT_CHAIN:
            chain = "chain-distinct"
        elif self.shapes == REPEATED_CHAIN:
            chain = "chain-repeated"
        else:
            chain = "chain-" + "-".join(f"{r}x{c}" for r, c in self.shapes)
        return (
            f"tp{self.tp}-gtp{self.gtp}/{self.dtype}/grad-{self.main_grad_dtype}"
            f"/pad{self.pad_for_alignment}/{self.reduction}/{chain}"
        )


def default_cases(tp: int, gtp: int) -> list[Case]:
    """The case matrix run for one topology: dtypes, padding on/off, per-token loss, chains."""
    cases = [
        Case(tp=tp, gtp=gtp, dtype=dtype, pad_for_alignment=pad)
        for dtype in ("float32", "bfloat16")
        for pad in (16, 0)
    ]
    cases += [
        Case(tp=tp, gtp=gtp, dtype=dtype, per_token_loss=True) for dtype in ("float32", "bfloat16")
    ]
    cases += [
        Case(tp=tp, gtp=gtp, dtype="bfloat16", main_grad_dtype="bfloat16"),
        Case(tp=tp, gtp=gtp, shapes=REPEATED_CHAIN),
        Case(tp=tp, gtp=gtp, shapes=((40, 24), (40, 24)), group_size=3),
        Case(tp=tp, gtp=gtp, dtype="bfloat16", shapes=((24, 16), (24, 16)), group_size=2),
    ]
    return cases


def smoke_cases(tp: int, gtp: int) -> list[Case]:
    """Two cases that reach every clause: a padded single-weight chain and a grouped chain."""
    return [
        Case(tp=tp, gtp=gtp),
        Case(tp=tp, gtp=gtp, shapes=((40, 24), (40, 24)), group_size=3),
    ]


class Unsupported(Exception):
    """Raised by a factory for a case it does not support; the case is reported as skipped."""


@dataclass
class Call:
    """One dispatcher call and what it returned."""

    kind: str
    """Which call: "forward", "backward", "grad_buffer" or "finalize"."""
    microbatch: int
    """Micro-batch index; -1 for the walk after the optimizer step."""
    module: int
    """Group index in forward order."""
    rounds: int
    """Collective rounds issued during the call."""
    results: list[Any]
    """forward/backward: plain-tensor copies taken right after return; grad_buffer: buffer
    specs; finalize: ``None`` or ``(shape, dtype)`` per returned item."""
    aliased: list[int] = field(default_factory=list)
    """Members whose returned tensor shares memory with an async collective still in flight."""


@dataclass
class Observation:
    """Everything one rank observed while driving one case in one mode."""

    case: Case
    overlap: bool
    coords: layout.Coords
    seed: int
    dispatch: str
    capability: list[dict] = field(default_factory=list)
    passthrough: list[str] = field(default_factory=list)
    dispatch_problems: list[str] = field(default_factory=list)
    """Where the dispatchers broke TE's list contract on probe weights (te_contract)."""
    shards: list[torch.Tensor] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    main_grads: list[list[torch.Tensor]] = field(default_factory=list)
    """Per micro-batch, per weight: ``main_grad`` after the backward walk and drain."""
    flags: list[list[Any]] = field(default_factory=list)
    """Per micro-batch, per weight: ``grad_added_to_main_grad`` after the walk."""
    main_grad_moves: list[list[str | None]] = field(default_factory=list)
    """Per micro-batch, per weight: None while ``main_grad`` is still the tensor and storage
    the factory attached, else what changed (rebound attribute, swapped ``.data``)."""
    outside_rounds: int = 0
    """Collectives issued outside any protocol call (e.g. by attribute access)."""

    @property
    def mode(self) -> str:
        """Either "overlap" (prefetch chain + async reduction) or "serial"."""
        return "overlap" if self.overlap else "serial"

    def logical(self, module: int, member: int) -> torch.Tensor:
        """The logical weight the kit handed to the factory."""
        shape = self.case.shapes[module]
        dtype = layout.dtype_of(self.case.dtype)
        return layout.logical_weight(self.seed, module, member, self.coords.tp_rank, shape, dtype)


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    # A CPU copy as a plain tensor: clones of subclasses may keep the subclass.
    return tensor.detach().clone().cpu().as_subclass(torch.Tensor)


def _capability(weight: Any, dispatch: Dispatch) -> dict:
    try:
        says = bool(dispatch.is_distributed_weight(weight))
    except Exception as exc:  # a marker on a non-tensor raises; record it as the answer
        says = f"{type(exc).__name__}: {exc}"
    return {
        "type": type(weight).__qualname__,
        "is_tensor": isinstance(weight, torch.Tensor),
        "strict_subclass": type(weight) not in (torch.Tensor, torch.nn.Parameter),
        "marker": getattr(weight, "is_distributed_weight", None),
        "dispatch": says,
        "protocol": isinstance(weight, dispatch.protocol),
        "missing": te_contract.missing_members(weight),
        **te_contract.routed_facts(weight),
    }


def _passthrough_problems(dispatch: Dispatch) -> list[str]:
    """Plain tensors must not count as distributed weights, and dispatch must return them as is."""
    problems = []
    plain = [torch.zeros(4, 3), torch.nn.Parameter(torch.zeros(4, 3))]
    for call in (dispatch.materialize_for_forward, dispatch.materialize_for_backward):
        out = call(plain[1])  # a bare plain weight, as Linear passes it
        if len(out) != 1 or out[0] is not plain[1]:
            problems.append("a bare plain weight did not come back as the list [weight]")
    for item in plain:
        if dispatch.is_distributed_weight(item):
            problems.append(f"{type(item).__name__} reported as a distributed weight")
    for name, call in (
        ("materialize_for_forward", dispatch.materialize_for_forward),
        ("materialize_for_backward", dispatch.materialize_for_backward),
    ):
        out = call(plain)
        if len(out) != 2 or any(a is not b for a, b in zip(out, plain)):
            problems.append(f"{name} did not return the plain tensors themselves")
    grads = [torch.ones(4, 3), torch.ones(4, 3)]
    out = dispatch.finalize(plain, grads)
    if len(out) != 2 or any(a is not b for a, b in zip(out, grads)):
        problems.append("finalize did not return the plain wgrads themselves")
    return problems


def _as_called(group: list) -> Any:
    """What TE's modules hand a dispatcher: the bare weight (Linear) or the group's list."""
    return group[0] if len(group) == 1 else group


def _materialize(kind, module, group, microbatch, dispatch, recorder, trace):
    call = (
        dispatch.materialize_for_forward if kind == "forward" else dispatch.materialize_for_backward
    )
    with recorder.call(kind) as log:
        out = call(_as_called(group))
    inflight = log.inflight_outputs()
    aliased = [
        i
        for i, t in enumerate(out)
        if isinstance(t, torch.Tensor) and any(overlaps(t, o) for o in inflight)
    ]
    # Copy right away: this is what the GEMM issued after the call would read.
    results = [_plain(t) if isinstance(t, torch.Tensor) else repr(t) for t in out]
    trace.calls.append(Call(kind, microbatch, module, log.rounds, results, aliased))


def _finalize(module, group, microbatch, dispatch, recorder, trace):
    case, coords = trace.case, trace.coords
    shape = case.shapes[module]
    with recorder.call("grad_buffer") as log:
        buffers = dispatch.grad_buffers(_as_called(group), shape)
    specs = []
    for j, buf in enumerate(buffers):
        specs.append(
            {
                "shape": tuple(buf.shape),
                "dtype": str(buf.dtype).removeprefix("torch."),
                "aliases_main_grad": overlaps(buf, group[j].main_grad),
                "aliases_sibling": any(overlaps(buf, o) for o in buffers[:j]),
            }
        )
    trace.calls.append(Call("grad_buffer", microbatch, module, log.rounds, specs))
    for j, buf in enumerate(buffers):
        if tuple(buf.shape) != tuple(shape):
            raise RuntimeError(
                f"grad_buffer() of weight {module}.{j} has shape {tuple(buf.shape)}, "
                f"the wgrad GEMM needs {tuple(shape)}; cannot go on"
            )
        buf.copy_(layout.wgrad(trace.seed, microbatch, module, j, coords.rank, shape, buf.dtype))
    with recorder.call("finalize") as log:
        out = dispatch.finalize(_as_called(group), buffers)  # the return is not used further
    summary = [None if r is None else (tuple(r.shape), str(r.dtype)) for r in out]
    trace.calls.append(Call("finalize", microbatch, module, log.rounds, summary))


def drive(
    factory: Callable[..., list],
    case: Case,
    *,
    overlap: bool,
    coords: layout.Coords,
    tp_group,
    gtp_group,
    dispatch: Dispatch,
    seed: int = 1234,
) -> Observation:
    """Build the case's weights with ``factory`` and drive them; every rank calls this."""
    trace = Observation(case=case, overlap=overlap, coords=coords, seed=seed, dispatch=dispatch.name)
    n = case.group_size
    logical = [trace.logical(m, j) for m in range(len(case.shapes)) for j in range(n)]
    weights = factory(
        logical_weights=[w.clone() for w in logical],
        shapes=[tuple(s) for s in case.shapes for _ in range(n)],
        dtype=layout.dtype_of(case.dtype),
        main_grad_dtype=layout.dtype_of(case.main_grad_dtype),
        tp_group=tp_group,
        gtp_group=gtp_group,
        pad_for_alignment=case.pad_for_alignment,
        per_token_loss=case.per_token_loss,
        overlap=overlap,
        group_size=n,
    )
    if len(weights) != len(logical):
        raise RuntimeError(f"factory returned {len(weights)} weights for {len(logical)} requested")
    groups = [weights[m * n : (m + 1) * n] for m in range(len(case.shapes))]
    trace.capability = [_capability(w, dispatch) for w in weights]
    trace.passthrough = _passthrough_problems(dispatch)
    trace.dispatch_problems = te_contract.dispatch_problems(dispatch)
    attached = [(w.main_grad, te_contract.storage_of(w.main_grad)) for w in weights]
    trace.shards = [_plain(w) for w in weights]
    drain = getattr(factory, "drain", None)

    with torch.no_grad(), CollectiveRecorder() as recorder:
        for mb in range(case.microbatches):
            for m, group in enumerate(groups):
                _materialize("forward", m, group, mb, dispatch, recorder, trace)
            for w in weights:
                w.grad_added_to_main_grad = False  # as DDP does before each backward
            for m in reversed(range(len(groups))):
                _materialize("backward", m, groups[m], mb, dispatch, recorder, trace)
                _finalize(m, groups[m], mb, dispatch, recorder, trace)
            if drain is not None:
                drain()
            trace.main_grads.append([_plain(w.main_grad) for w in weights])
            trace.flags.append([getattr(w, "grad_added_to_main_grad", None) for w in weights])
            trace.main_grad_moves.append(
                [te_contract.moved(w.main_grad, *a) for w, a in zip(weights, attached)]
            )
        for w in weights:
            w.data.mul_(UPDATE_FACTOR)  # the optimizer step: an in-place update of every shard
        for m, group in enumerate(groups):
            _materialize("forward", m, group, -1, dispatch, recorder, trace)
        for m in reversed(range(len(groups))):
            _materialize("backward", m, groups[m], -1, dispatch, recorder, trace)
    trace.outside_rounds = sum(log.rounds for log in recorder.logs if log.label == "outside")
    return trace
