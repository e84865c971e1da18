"""Checkpoint scenarios: one ``[checkpoint]`` table, one scenario per topology loaded into.

A checkpoint scenario's ``[reference]`` is the uninterrupted run of the source topology. The
source side (the reference's configuration with ``save_step``) trains to step k and saves a
``torch_dist`` checkpoint; each entry of ``load_into`` is a candidate: the reference's
configuration with the entry's keys (another TP, G, world size, pipeline or expert layout,
distributed optimizer; a ``[candidate]`` table, where a matrix's base has one, gives keys every
loader starts from), which loads the checkpoint, is recorded right after loading as step k, and trains on to
the last step. Its step-k weights and optimizer state are judged bitwise (``exact_steps``), the steps
after it under the scenario's policy against the same golden::

    [checkpoint]
    save_step = 1
    load_into = [{ label = "tp1-gtpoff", gtp = 1 }, { label = "tp2-gtp2", world_size = 4, tp = 2, gtp = 2 }]
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from harness.common.errors import BadInput, shown
from harness.scenario.options import declared
from harness.scenario.schema import Scenario, Side, check_scenario_name

# Faults planted on a checkpoint scenario's candidate that act where the checkpoint is saved.
SAVE_FAULTS = frozenset({"ckpt-pad-rows-as-data", "ckpt-expert-index-shifted", "ckpt-stage-layers-mirrored"})
# Megatron-LM's commit (#6080) from which routed experts' GTP shards keep ``allreduce = False``
# and expert GTP alone puts the experts on the expert topology (see :func:`expert_optimizer`).
EXPERT_TOPOLOGY_FIX = ("abf04f46e3", "0.20.0")
# What a resumed side must share with the run it continues (the rest is its topology).
CONTINUED = tuple(o.name for o in declared(Side).values() if o.carried)
_SIDE_KEYS = frozenset(declared(Side)) - {"save_step", "load_step", "resume_from"}


def topology(side: Side) -> str:
    """A side's topology as the report names it: ``TP1xGTP2``, ``TP2xGTP-off DP2``, ``TP1xGTP2 PP2``,
    ``TP1xGTP2 EP2xEGTP2 DP2``, `` distopt``."""
    gtp = f"GTP{side.gtp}" if side.gtp > 1 else "GTP-off"
    dp = f" DP{side.replicate_dp}" if side.replicate_dp > 1 else ""
    pp = f" PP{side.pipeline_parallel}" if side.pipeline_parallel > 1 else ""
    eg = f"EGTP{side.expert_gtp}" if side.expert_gtp > 1 else "EGTP-off"
    experts = f" EP{side.ep}x{eg}" if side.ep * side.expert_gtp > 1 else ""
    return f"TP{side.tp}x{gtp}{pp}{experts}{dp}" + (" distopt" if side.distributed_optimizer else "")


def expand(raw: dict, source: str, parse: Callable[[dict, str], Scenario],
           validate: Callable[[Scenario], None]) -> list[Scenario]:
    """The scenarios of a document with a ``[checkpoint]`` table: ``parse`` builds one from a
    document, ``validate`` checks it once it resumes (the scenario rules, which call :func:`check`)."""

    spec = raw["checkpoint"]
    where = f"{source}: [checkpoint]"
    if not isinstance(spec, dict):
        raise BadInput(where, f"must be a table, got {shown(spec)}")
    if unknown := sorted(set(spec) - {"save_step", "load_into"}):
        raise BadInput(f"{where}.{unknown[0]}", "unknown key; known keys are load_into, save_step")
    k = spec.get("save_step")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise BadInput(f"{where}.save_step", f"must be an integer >= 1, got {shown(k)}")
    targets = spec.get("load_into")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, dict) for t in targets):
        raise BadInput(f"{where}.load_into",
                       "must be a non-empty list of tables of side keys (the topologies loaded into)")
    # A [candidate] table (a matrix's base may have one) gives keys every loader starts from.
    loader_base = raw.get("candidate", {}) if isinstance(raw.get("candidate", {}), dict) else {}
    base = {key: v for key, v in raw.items() if key != "checkpoint"}
    compare = {**raw.get("compare", {}), "exact_steps": [k]} if isinstance(raw.get("compare", {}),
                                                                           dict) else {}
    out, labels = [], set()
    for i, target in enumerate(targets):
        at = f"{where}.load_into[{i}]"
        label = target.get("label", f"to{i}")
        if (problem := check_scenario_name(label)) is not None or label in labels:
            raise BadInput(f"{at}.label", problem or f"{label!r} is used twice")
        labels.add(label)
        if unknown := sorted(set(target) - _SIDE_KEYS - {"label"}):
            raise BadInput(f"{at}.{unknown[0]}",
                           f"not a side key a topology may change; one of {sorted(_SIDE_KEYS)}")
        reference = raw.get("reference", {}) if isinstance(raw.get("reference", {}), dict) else {}
        candidate = {**reference, **loader_base,
                     **{key: v for key, v in target.items() if key not in ("label", "inject")}}
        # Faults are planted once the candidate resumes (a save fault fires only there), not on
        # the loader parsed before it resumes: the rules would refuse a fault that needs the load.
        planted = candidate.pop("inject", [])
        s = parse({**base, "name": f"{raw.get('name')}-{label}", "candidate": candidate, "compare": compare},
                  source)
        saver = dataclasses.replace(s.reference, save_step=k)
        inject = (_coerce_inject(target["inject"], f"{at}.inject") if "inject" in target
                  else _coerce_inject(planted, f"{source}: [candidate].inject"))
        resumed = dataclasses.replace(s.candidate, load_step=k, resume_from=saver.key(s.model, s.data),
                                      inject=inject)
        row = f"checkpoint: {topology(saver)} -> {topology(resumed)} load at step {k}"
        s = dataclasses.replace(s, candidate=resumed, saver=saver,
                                description=f"{row}. {s.description}" if s.description else row)
        validate(s)
        out.append(s)
    return out


def _coerce_inject(value, where: str) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise BadInput(where, f"must be a list of fault names, got {shown(value)}")
    return tuple(value)


def saver_side(s: Scenario) -> Side:
    """The side that saves ``s``'s checkpoint, with the save faults planted on its candidate."""
    faults = tuple(f for f in s.candidate.inject if f in SAVE_FAULTS)
    return dataclasses.replace(s.saver, inject=faults)


def check(s: Scenario) -> None:
    """The rules of a checkpoint scenario (and that only ``[checkpoint]`` sets its side keys)."""
    src = s.saver
    if src is None:
        for role, side in s.sides.items():
            for key in ("save_step", "load_step", "resume_from"):
                if getattr(side, key):
                    raise BadInput(f"{s.source}: [{role}].{key}", "set by a [checkpoint] table, not by hand")
        for fault in SAVE_FAULTS & set(s.candidate.inject):
            raise BadInput(f"{s.source}: [candidate].inject",
                           f"{fault} acts where a [checkpoint] scenario saves")
        return
    where = f"{s.source}: [checkpoint]"
    cand, k = s.candidate, src.save_step
    for role, side in (("reference", s.reference), ("candidate", cand)):
        if side.backend != "megatron":
            raise BadInput(f"{s.source}: [{role}].backend",
                           "checkpoints are megatron-core's (backend = \"megatron\")")
    for role, side in (("saved run", src), ("reference", s.reference), ("candidate", cand)):
        if side.virtual_pipeline:
            raise BadInput(where, f"the {role} is interleaved (virtual_pipeline): checkpoints of one model "
                                  "chunk per rank only (not covered yet)")
    if src.optimizer == "sgd":
        # get_megatron_optimizer gives SGD no init_state_fn (optimizer/__init__.py l.624 on 0.19.2,
        # l.628 on main), which a load calls (FP32Optimizer.sharded_state_dict, optimizer.py l.1362;
        # l.1394 on main): "TypeError: 'NoneType' object is not callable".
        raise BadInput(f"{s.source}: [reference].optimizer", "megatron-core cannot load an SGD optimizer's "
                       "checkpoint (it calls the init_state_fn get_megatron_optimizer leaves None for SGD): "
                       "use adam")
    if cand.distributed_optimizer and not src.distributed_optimizer:
        # The fully_reshardable load asks for optimizer.state.param.<name>, the fp32 main parameter,
        # which the local optimizer does not save (strategies/torch.py _validate_global_shapes).
        raise BadInput(f"{where}.load_into", "megatron-core's distributed optimizer cannot load a "
                       "checkpoint of the local optimizer (it asks for the fp32 main parameters, "
                       "optimizer.state.param.<name>, which that optimizer does not save)")
    if not 1 <= k < src.steps:
        raise BadInput(f"{where}.save_step",
                       f"must be in 1..{src.steps - 1} (steps continue after loading), got {k}")
    for key in CONTINUED:
        if getattr(cand, key) != getattr(src, key):
            raise BadInput(f"{where}.load_into", f"{key} {getattr(cand, key)!r} differs from the saved run's "
                                                 f"{getattr(src, key)!r}: a topology change continues the "
                                                 f"same training")
    if s.capture.steps is not None and k not in s.capture.steps:
        raise BadInput(f"{s.source}: [capture].steps",
                       f"must include the load step {k}: it is judged bitwise")
    if "param" not in s.capture.kinds:
        raise BadInput(f"{s.source}: [capture].kinds",
                       "must include param: the loaded weights are judged bitwise")
    for fault in sorted(SAVE_FAULTS & set(cand.inject)):
        if problem := save_fault_reach(fault, src):
            raise BadInput(f"{s.source}: [candidate].inject", f"{fault} never fires: {problem}")


def save_fault_reach(fault: str, src: Side) -> str | None:
    """Why a save fault never fires on a run of ``src`` that saves (None: it can)."""
    if fault == "ckpt-pad-rows-as-data" and src.gtp == 1:
        return "the saved run has no GTP"
    if fault == "ckpt-expert-index-shifted" and src.ep == 1:
        return "the saved run has no expert parallelism (ep = 1)"
    if fault == "ckpt-stage-layers-mirrored" and src.pipeline_parallel == 1:
        return "the saved run is not pipelined (pipeline_parallel = 1)"
    return None


def expert_optimizer(side: Side, num_experts: int, fixed: bool) -> bool:
    """Whether megatron-core gives ``side``'s routed experts an optimizer of their own (a second
    one in its ChainedOptimizer): it does for parameters tagged ``allreduce = False``, the expert
    topology (optimizer/__init__.py l.348, l.1181-1224 on 0.19.2). ``fixed``: the tree holds
    :data:`EXPERT_TOPOLOGY_FIX`, where experts take that topology under expert parallelism, an
    expert TP other than TP or an expert GTP other than the dense one (tensor_parallel/layers.py
    l.1033-1037 on main). On 0.19.2 only expert parallelism or expert TP != TP puts them there
    (layers.py l.961-964), and
    ``_gtp_slice_one_param`` (generalized_tensor_parallelism.py l.502-508) drops the tag from
    expert GTP shards: with expert GTP every expert weight is a dense one."""
    if not num_experts:
        return False
    if fixed:
        return side.ep > 1 or side.etp != side.tp or side.expert_gtp != side.gtp
    return (side.ep > 1 or side.etp != side.tp) and side.expert_gtp == 1


def check_expert_optimizers(s: Scenario, fixed: Callable[[Side], bool]) -> None:
    """Refuse a load whose optimizer chain differs from the saved run's (``fixed``: whether a
    side's megatron-core tree holds :data:`EXPERT_TOPOLOGY_FIX`). megatron-core's (non-distributed)
    optimizer saves its param groups as common state shaped by its chain, and a loader of another
    chain cannot take them: ``ChainedOptimizer.load_state_dict`` raises "Expected 2 entries in
    state dict, but got 4" (optimizer/optimizer.py l.1578-1582 on 0.19.2, l.1610-1614 on main),
    the other way ``_get_param_groups``: "Could not find parameter group". Checked once the
    sides' trees are known, before anything launches."""
    if s.saver is None:
        return
    saved = expert_optimizer(s.saver, s.model.num_experts, fixed(s.saver))
    loaded = expert_optimizer(s.candidate, s.model.num_experts, fixed(s.candidate))
    if saved != loaded:
        which = {True: "an optimizer of their own", False: "the dense optimizer"}
        tree = "megatron-core " + ("with" if fixed(s.candidate) else "without") + f" {EXPERT_TOPOLOGY_FIX[0]}"
        raise BadInput(f"{s.source}: [checkpoint].load_into ({s.name})",
                       f"the saved run ({topology(s.saver)}) keeps its routed experts in {which[saved]}, the "
                       f"loader "
                       f"({topology(s.candidate)}) in {which[loaded]} ({tree}): megatron-core's "
                       f"non-distributed "
                       "optimizer cannot load param groups saved by another optimizer chain "
                       "(ChainedOptimizer.load_state_dict)")
