"""What the kit knows of Transformer Engine's side of the contract, and what a CPU run covers.

- :func:`dispatch_problems` checks, with probe weights and no communication, that the
  dispatchers being driven keep the list contract the clauses rely on (TE 2.20.2's code):
  it is how a new TE release or a broken mirror shows up as the ``dispatch.contract`` clause.
- :data:`ROUTES` says, per clause, which of TE's dispatchers its observations come through.
- :data:`DISAGREEMENTS` records where TE 2.20.2's code differs from the kit's earlier reading of
  the contract; the kit follows TE in each case.
- :data:`NEEDS_TE_MODULES` lists what only TE's modules (CUDA and the TE torch extension)
  exercise, so a CPU pass is not read as a pass of TE's Linear.
"""

from __future__ import annotations

import inspect
import textwrap
from typing import Any

import torch

PROTOCOL_MEMBERS = (
    "is_distributed_weight",
    "materialize_group_for_forward",
    "materialize_group_for_backward",
    "finalize_group_grads",
    "grad_buffer",
)
"""What TE's ``DistributedWeight`` protocol names (the runtime check looks them up statically)."""
IS_DW = "is_distributed_weight"
FORWARD = "materialize_weight_for_forward"
BACKWARD = "materialize_weight_for_backward"
FINALIZE = "finalize_weight_grads"
MATERIALIZE_AND_FINALIZE = (FORWARD, BACKWARD, FINALIZE)

ROUTES: dict[str, tuple[str, ...]] = {
    "capability.marker": (IS_DW, "DistributedWeight"),
    "capability.plain_passthrough": (IS_DW, *MATERIALIZE_AND_FINALIZE),
    "dispatch.contract": (IS_DW, *MATERIALIZE_AND_FINALIZE),
    "layout.shard": (),
    "forward.values": (FORWARD,),
    "forward.repeat": (FORWARD,),
    "forward.fresh_after_update": (FORWARD,),
    "forward.no_inflight_alias": (FORWARD,),
    "backward.values": (BACKWARD,),
    "backward.no_inflight_alias": (BACKWARD,),
    "grad_buffer.spec": (),
    "finalize.return": (FINALIZE,),
    "finalize.values": (FINALIZE,),
    "finalize.accumulates": (FINALIZE,),
    "finalize.padding": (FINALIZE,),
    "finalize.flag": (FINALIZE,),
    "finalize.in_place": (FINALIZE,),
    "leader.serves_group": MATERIALIZE_AND_FINALIZE,
    "leader.communication": MATERIALIZE_AND_FINALIZE,
    "fused_mlp.routed_expert": (),
    "async.equivalence": MATERIALIZE_AND_FINALIZE,
}
"""Clause id -> the TE dispatchers its observations pass through; () when none does (the kit
reads the shard, calls ``grad_buffer()`` as TE's modules do, or reads attributes)."""

DISAGREEMENTS: tuple[tuple[str, str, str], ...] = (
    (
        "a bare weight is a list of one",
        "the mirror normalizes, and the drive passes a group of one bare, as Linear does",
        "TE's three dispatchers wrap a bare weight in a list; Linear and LayerNormLinear pass "
        "their bare weight (materialize_weight_for_forward(weight)[0], finalize_weight_grads("
        "weight, [wgrad])) and the fused grouped MLP its bare FC1/FC2 leader. The kit's mirror "
        "indexed weights[0] (a bare weight's first row) and the kit drove Linear as a one-item "
        "list.",
    ),
    (
        "no grad-buffer dispatcher",
        "the kit calls each member's grad_buffer() itself (via: direct)",
        "2.20.2 has no weight_grad_buffers, which the kit looked for: module/linear.py, "
        "layernorm_linear.py and grouped_linear.py bind each member's grad_buffer as "
        "main_grad_func, and the grouped ops never call it.",
    ),
    (
        "finalize's return is not the gradient's carrier",
        "new clause finalize.in_place; finalize.return keeps GroupedLinear's needs",
        "The kit read finalize's return as the dummy .grad every caller uses. In TE only "
        "GroupedLinear (module) returns it as the N parameter grads; Linear and LayerNormLinear "
        "take [0] (and replace it by their own dummy under fuse_wgrad_accumulation); "
        "ops.GroupedLinear and the fused GroupedMLP discard it, so the reduction must land in "
        "main_grad in place.",
    ),
    (
        "who sets grad_added_to_main_grad",
        "finalize.flag keeps requiring the implementer to set it, for GroupedLinear",
        "TE's grouped ops (get_dummy_wgrads_for_params) and Linear under "
        "fuse_wgrad_accumulation set it after finalize; GroupedLinear (module) does not.",
    ),
    (
        "attributes outside the protocol",
        "new clause fused_mlp.routed_expert states them for grouped weights",
        "ops/fused/grouped_mlp.py asserts weight0.is_routed_expert and weight0.weight_list is "
        "not None on FC1 and FC2, which the protocol does not name.",
    ),
    (
        "where TE's dispatchers come from",
        "the pinned release's file, loaded alone and hash-checked",
        "The kit imported transformer_engine.pytorch.distributed_weight, which cannot be "
        "imported on CPU (and a partial TE breaks megatron.core).",
    ),
)
"""(topic, what the kit does now, what TE 2.20.2 does): where TE's code differs from the kit's
earlier reading of the contract. The kit follows TE in each case."""

NEEDS_TE_MODULES: tuple[str, ...] = (
    "the GEMMs and autograd of module/linear.py, layernorm_linear.py and grouped_linear.py "
    "(finalize's return as parameter grads is checked as data only)",
    "quantized weights: FP8 / MXFP8 / NVFP4 materialization and the columnwise forms backward "
    "reads (the kit materializes float32 and bfloat16)",
    "ops.GroupedLinear and the fused GroupedMLP: wgrads in fresh scratch of the parameter "
    "dtype instead of grad_buffer(), the CuTe kernels, the FC1 NVFP4 dgrad path",
    "fuse_wgrad_accumulation, delayed wgrad (wgrad_store), Userbuffers overlap, CUDA graphs",
    "NCCL streams and events (on CPU the async collectives are gloo's)",
    "layernorm_mlp.py, which 2.20.2 does not wire to the protocol",
)
"""What only TE's modules exercise (CUDA and the TE torch extension, not on these machines)."""


# --- facts the drive records ----------------------------------------------------------------


def routed_facts(weight: Any) -> dict:
    """The attributes the fused grouped MLP asserts on, as plain data."""
    absent = object()
    routed = getattr(weight, "is_routed_expert", absent)
    weights = getattr(weight, "weight_list", absent)
    if weights is absent:
        listed = "absent"
    elif weights is None:
        listed = "None"
    else:
        listed = f"{type(weights).__name__} of {len(weights)}" if hasattr(weights, "__len__") else "set"
    return {"is_routed_expert": "absent" if routed is absent else bool(routed), "weight_list": listed}


def missing_members(weight: Any) -> list[str]:
    """The protocol members ``weight`` lacks, looked up as ``isinstance`` does (statically)."""
    absent = object()
    return [n for n in PROTOCOL_MEMBERS if inspect.getattr_static(weight, n, absent) is absent]


def storage_of(tensor: torch.Tensor) -> tuple:
    """Where a tensor's elements live: storage address, offset, shape, strides."""
    return (
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
    )


def moved(current: Any, original: torch.Tensor, storage: tuple) -> str | None:
    """None while ``main_grad`` is the attached tensor over the same memory, else what changed."""
    if current is not original:
        return "main_grad was rebound to another tensor"
    if storage_of(current) != storage:
        return "main_grad's .data was swapped for other memory"
    return None


# --- probe weights: the dispatchers' list contract -------------------------------------------


class _Probe(torch.nn.Parameter):
    """A distributed weight that only records calls and returns what it is told."""

    is_distributed_weight = True

    def __new__(cls, tag: str, log: list):
        probe = super().__new__(cls, torch.zeros(3, 2), requires_grad=False)
        probe.tag, probe.log, probe.returns = tag, log, None
        return probe

    def _record(self, what: str, *args):
        self.log.append((self.tag, what, args))
        return self.returns

    def materialize_group_for_forward(self):
        return self._record("forward")

    def materialize_group_for_backward(self):
        return self._record("backward")

    def finalize_group_grads(self, wgrads):
        return self._record("finalize", wgrads)

    def grad_buffer(self):
        return self._record("grad_buffer")


def _same(out: Any, want: list) -> bool:
    return isinstance(out, list) and len(out) == len(want) and all(a is b for a, b in zip(out, want))


def _call(problems: list[str], label: str, fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # the contract says nothing raises here; report it
        problems.append(f"{label} raised {type(exc).__name__}: {exc}")
        return None


def _materialize_problems(kind: str, call, problems: list[str]) -> None:
    log: list = []
    lead, *followers = (_Probe(t, log) for t in ("leader", "member 1", "member 2"))
    results = [torch.full((1,), float(i)) for i in range(3)]
    forms = (
        ("a bare weight", lead, results[0], [results[0]]),
        ("a list of 3", [lead, *followers], tuple(results), results),
        ("a tuple of 3", (lead, *followers), list(results), results),
        ("a bare leader of 3 (as the fused grouped MLP calls it)", lead, tuple(results), results),
    )
    for what, weights, returns, want in forms:
        log.clear()
        lead.returns = returns
        out = _call(problems, f"{kind} of {what}", call, weights)
        if out is not None and not _same(out, want):
            problems.append(f"{kind} of {what}: not the leader's result(s) as a list")
        if [(t, k) for t, k, _ in log] != [("leader", kind)]:
            problems.append(f"{kind} of {what}: calls {[(t, k) for t, k, _ in log]}, not one leader call")


def _finalize_problems(finalize, problems: list[str]) -> None:
    log: list = []
    lead, *followers = (_Probe(t, log) for t in ("leader", "member 1", "member 2"))
    grads = [torch.zeros(1) for _ in range(3)]
    dummies = [torch.ones(1) for _ in range(3)]
    forms = (
        ("a bare weight, async (None)", lead, grads[:1], None, grads[0], [None]),
        ("a group of 3", [lead, *followers], grads, tuple(dummies), grads, dummies),
    )
    for what, weights, wgrads, returns, handed, want in forms:
        log.clear()
        lead.returns = returns
        out = _call(problems, f"finalize of {what}", finalize, weights, wgrads)
        if out is not None and not _same(out, want):
            problems.append(f"finalize of {what}: not the leader's return as a list")
        calls = [(t, k) for t, k, _ in log]
        if calls != [("leader", "finalize")]:
            problems.append(f"finalize of {what}: calls {calls}, not one leader call")
            continue
        got = log[0][2][0]
        ok = got is handed if isinstance(handed, torch.Tensor) else _same(list(got), handed)
        if not ok:
            problems.append(f"finalize of {what}: the leader was not handed the wgrad(s) as TE does")


def dispatch_problems(dispatch) -> list[str]:
    """Where ``dispatch`` breaks TE 2.20.2's list contract, checked on probe weights."""
    problems: list[str] = []
    _materialize_problems("forward", dispatch.materialize_for_forward, problems)
    _materialize_problems("backward", dispatch.materialize_for_backward, problems)
    _finalize_problems(dispatch.finalize, problems)

    class NotATensor:
        is_distributed_weight = True

    try:
        dispatch.is_distributed_weight(NotATensor())
        problems.append("a marker on a non-tensor was accepted, not refused with TypeError")
    except TypeError:
        pass
    return problems


# --- report ----------------------------------------------------------------------------------


def via(clause: str, dispatch_name: str) -> str:
    """The report's route column: "te", "mirror" or "direct" (no dispatcher involved)."""
    if not ROUTES.get(clause):
        return "direct"
    return "te" if dispatch_name == "te" else "mirror"


def report_lines(dispatch_name: str) -> list[str]:
    """The legend of the route column, what needs TE's modules, and the kit's corrections."""
    lines = [
        "via: te = through TE's own dispatchers (the file above); mirror = the kit's copy of them;",
        "     direct = no dispatcher involved (the kit reads the weight, or calls grad_buffer()",
        "     as TE's modules do).",
    ]
    if dispatch_name != "te":
        lines.append("     TE's file was not driven: no clause here is a check of TE's code.")
    lines += ["", "Not covered without TE's modules (CUDA and the TE torch extension):"]
    for item in NEEDS_TE_MODULES:
        lines += textwrap.wrap(item, 100, initial_indent="  - ", subsequent_indent="    ")
    lines += ["", "Where TE's code and the kit's earlier reading differ, the kit follows TE:"]
    for topic, now, _ in DISAGREEMENTS:
        lines += textwrap.wrap(f"{topic}: {now}", 100, initial_indent="  - ", subsequent_indent="    ")
    return lines
