"""The rules a scenario must satisfy beyond its keys' types, checked before anything is
launched: model, training, topology, recipe, faults, capture and compare rules, and the size
limits. Each violation raises :class:`~harness.common.errors.BadInput` naming the file, the key and
the rule.
"""

from __future__ import annotations

import re

import harness.scenario.checkpoint as checkpointing
from harness.scenario.bridge_rules import validate_bridge
from harness.common.errors import BadInput
from harness.scenario.faults import check_name, check_reach
from harness.scenario.eval_rules import validate_eval
from harness.scenario.mlm_args import flag_problem
from harness.scenario.moe_rules import moe_parameter_count, validate_moe_model, validate_moe_side
from harness.scenario.arch_rules import (
    arch_parameter_count, qkv_rows, validate_arch_model, validate_arch_side,
)
from harness.scenario.vocab_rules import padded_vocab_size, validate_vocab_model, validate_vocab_side
from harness.scenario.mtp_rules import mtp_parameter_count, validate_mtp_model, validate_mtp_side
from harness.scenario.muon_rules import validate_muon_side
from harness.scenario.path_rules import validate_paths
from harness.scenario.options import backend_problem, declared, need_problem, value_problem
from harness.scenario.schema import (
    CAPTURE_KINDS, CAPTURE_MODES, GATED, LIMITS, POLICIES, PRECISIONS, DataConfig, ModelConfig, Scenario,
    Side,
)
from harness.scenario.tree_specs import spec_problem


def validate(s: Scenario, limits: bool = True) -> None:
    """Check every rule a scenario must satisfy before anything is launched. ``limits``: also
    the size limits of :data:`LIMITS` (what one machine can run), first: an absurd size is
    named as such, not as whichever rule it happens to break."""
    if limits:
        _validate_limits(s)
    _validate_declared(s.model, f"{s.source}: [model]")
    _validate_declared(s.data, f"{s.source}: [data]")
    _validate_model(s)
    validate_moe_model(s)
    validate_mtp_model(s)
    validate_arch_model(s)
    validate_vocab_model(s)
    steps = {}
    for name, side in s.sides.items():
        where = f"{s.source}: [{name}]"
        _validate_declared(side, where)
        _validate_choices(side, where)
        _validate_training(side, where)
        _validate_topology(s, name, side, where)
        validate_vocab_side(s, side, where)
        _validate_recipe(s, side, where)
        _validate_faults(name, side, where, s.data)
        validate_paths(s, side, where)
        _validate_mlm(s, side, where)
        validate_bridge(s, side, where)
        validate_moe_side(s, name, side, where)
        validate_muon_side(s, side, where)
        validate_mtp_side(s, name, side, where)
        validate_arch_side(s, side, where)
        _validate_pipeline(s, side, where)
        _validate_code(side, where)
        _validate_reach(s, side, where)
        steps[name] = side.steps
    if len(set(steps.values())) != 1:
        raise BadInput(f"{s.source}: steps", f"every side must run the same number of steps, got {steps}")
    validate_eval(s)
    _validate_capture_compare(s)
    _validate_expect(s)
    checkpointing.check(s)


def _validate_model(s: Scenario) -> None:
    src, m = s.source, s.model
    if s.timeout_s <= 0:
        raise BadInput(f"{src}: timeout_s", f"must be > 0 seconds, got {s.timeout_s}")
    if not m.init_std > 0:
        raise BadInput(f"{src}: [model].init_std", f"must be > 0, got {m.init_std}")
    if m.hidden_size % m.num_attention_heads:
        raise BadInput(f"{src}: [model].hidden_size", "must be a multiple of num_attention_heads")


def _validate_declared(obj: ModelConfig | DataConfig | Side, where: str) -> None:
    """Each key alone, as declared: its choices and its range."""
    for o in declared(type(obj)).values():
        if (problem := value_problem(o, getattr(obj, o.name))) is not None:
            raise BadInput(f"{where}.{o.name}", problem)


def _validate_choices(side: Side, where: str) -> None:
    if side.precision not in PRECISIONS[side.backend]:
        raise BadInput(
            f"{where}.precision",
            f"{side.precision!r} is not supported by the {side.backend} backend; "
            f"one of {sorted(PRECISIONS[side.backend])}",
        )


def _validate_reach(s: Scenario, side: Side, where: str) -> None:
    """What the declarations say of the keys a side sets: the backends that honour each (the
    model's keys too) and the rules tying each to another key. Checked after the rules above,
    whose messages say more where they apply."""
    for obj, at in ((s.model, f"{s.source}: [model]"), (s.data, f"{s.source}: [data]"), (side, where)):
        for o in declared(type(obj)).values():
            value = getattr(obj, o.name)
            if (problem := backend_problem(o, value, side.backend)) is not None:
                key = "this option" if obj is side else f"[{o.section}].{o.name}"
                raise BadInput(f"{at}.{o.name}" if obj is side else f"{where}.backend",
                               problem.replace("this option", key))
            if (problem := need_problem(o, value, obj)) is not None:
                raise BadInput(f"{at}.{o.name}", problem)


def _validate_training(side: Side, where: str) -> None:
    if side.optimizer == "adam" and side.adam_eps <= 0:
        raise BadInput(f"{where}.adam_eps", f"must be > 0, got {side.adam_eps}")
    if side.min_lr > side.lr:
        raise BadInput(f"{where}.min_lr", f"must be <= lr ({side.lr}), got {side.min_lr}")
    decay = side.lr_decay_steps or side.steps
    if not 0 <= side.lr_warmup_steps < decay:  # megatron-core's OptimizerParamScheduler asserts it
        raise BadInput(f"{where}.lr_warmup_steps",
                       f"must be >= 0 and < lr_decay_steps (or steps) = {decay}, got {side.lr_warmup_steps}")


def _validate_topology(s: Scenario, name: str, side: Side, where: str) -> None:
    m, d = s.model, s.data
    if side.world_size % (side.tp * side.gtp):
        raise BadInput(
            f"{where}.world_size",
            f"world_size {side.world_size} must be a multiple of TP x G = {side.tp} x {side.gtp}",
        )
    if side.world_size % (side.tp * side.gtp * side.pipeline_parallel):
        raise BadInput(f"{where}.world_size", f"world_size {side.world_size} must be a multiple of TP x G x "
                       f"PP = {side.tp} x {side.gtp} x {side.pipeline_parallel}")
    if side.dp is not None and side.dp != side.replicate_dp:
        raise BadInput(f"{where}.dp", f"dp {side.dp} != world_size / (TP x G) = {side.replicate_dp}")
    for key in ("num_attention_heads", "hidden_size", "ffn_hidden_size"):  # the vocabulary: padded
        if getattr(m, key) % side.tp:
            raise BadInput(f"{where}.tp", f"TP {side.tp} must divide [model].{key} = {getattr(m, key)}")
    if side.gtp > 1:
        if not m.untie_embeddings and side.backend == "torch":
            # megatron-core's sides run it (and raise: scenarios/architectures.toml records it per tree).
            raise BadInput(
                f"{s.source}: [model].untie_embeddings",
                f"tied embedding/output weights under GTP are not covered by the torch backend "
                f"([{name}].gtp = {side.gtp})",
            )
        if side.backend == "megatron" and side.gtp_pad_alignment == 0:
            # Without padding MCore requires G to divide dim 0 of every GTP-sharded weight.
            for key, dim0 in _gtp_dim0s(m, side.tp).items():
                if dim0 % side.gtp:
                    raise BadInput(
                        f"{where}.gtp",
                            f"G {side.gtp} must divide dim 0 of {key} ({dim0}) when gtp_pad_alignment = 0"
                    )
    if name == "golden" and (side.world_size != 1 or side.tp != 1 or side.gtp != 1):
        raise BadInput(f"{where}.world_size",
                       "the golden side runs in a single process: world_size = tp = gtp = 1")
    unit = d.micro_batch_size * side.data_ranks
    if d.global_batch_size % unit:
        raise BadInput(
            f"{s.source}: [data].global_batch_size",
            f"{d.global_batch_size} must be a multiple of micro_batch_size x data ranks "
            f"= {d.micro_batch_size} x {side.data_ranks} for [{name}]",
        )


def _validate_recipe(s: Scenario, side: Side, where: str) -> None:
    if side.recipe not in _RECIPE_BLOCK:
        return
    m, block = s.model, _RECIPE_BLOCK[side.recipe]
    dims = {**_gtp_dim0s(m, side.tp), "hidden_size": m.hidden_size,
            "tokens per micro-batch": m.seq_length * s.data.micro_batch_size}
    for key, dim in dims.items():
        if dim % block:
            raise BadInput(f"{where}.recipe",
                           f"{side.recipe} needs {key} ({dim}) to be a multiple of {block}")
    if side.gtp > 1 and side.gtp_pad_alignment % block:
        raise BadInput(f"{where}.gtp_pad_alignment",
                       f"{side.recipe} needs GTP shards aligned to its {block}-row blocks")


def _validate_faults(name: str, side: Side, where: str, data=None) -> None:
    if side.mutant and (side.backend != "megatron" or name == "golden"):
        raise BadInput(f"{where}.mutant",
                       "a mutant of megatron-core runs on a megatron reference or candidate")
    if name == "golden" and side.inject:
        raise BadInput(f"{where}.inject", "faults are planted in the reference or candidate, not the golden")
    for fault in side.inject:
        if (problem := check_name(fault) or check_reach(fault, side, data)) is not None:
            raise BadInput(f"{where}.inject", problem)
    if "fp8-unreduced-amax" in side.inject and (side.backend != "torch" or side.recipe == "none"):
        raise BadInput(f"{where}.inject", "fp8-unreduced-amax needs the torch backend with a recipe")


def _validate_code(side: Side, where: str) -> None:
    """The spec's form only; what it names is resolved before launch (:mod:`harness.run.trees`)."""
    if side.backend == "torch" and side.megatron_core != "installed":
        raise BadInput(f"{where}.megatron_core", "the torch backend imports no megatron-core")
    if (problem := spec_problem(side.megatron_core)) is not None:
        raise BadInput(f"{where}.megatron_core", problem)


def _validate_expect(s: Scenario) -> None:
    e = s.expect
    if e is None:
        return
    if e.verdict != "known-divergence":
        raise BadInput(f"{s.source}: [expect].verdict", f"{e.verdict!r}: one of ['known-divergence']")
    if not e.reason.strip():
        raise BadInput(f"{s.source}: [expect].reason",
                       "a known divergence states its root cause (file:function:line)")
    if e.step is not None and not 1 <= e.step <= s.reference.steps:
        raise BadInput(f"{s.source}: [expect].step", f"step {e.step} is not in 1..{s.reference.steps}")
    if e.fixed_in is not None and not re.fullmatch(r"[0-9a-f]{7,40}", e.fixed_in):
        raise BadInput(f"{s.source}: [expect].fixed_in", f"{e.fixed_in!r}: a commit id (7 to 40 hex digits)")
    if e.fixed_in_version is not None and version_key(e.fixed_in_version) is None:
        raise BadInput(f"{s.source}: [expect].fixed_in_version",
                       f"{e.fixed_in_version!r}: a version such as 0.20.0")
    if e.introduced_in is not None and not re.fullmatch(r"[0-9a-f]{7,40}", e.introduced_in):
        raise BadInput(f"{s.source}: [expect].introduced_in",
                       f"{e.introduced_in!r}: a commit id (7 to 40 hex digits)")
    if e.raises is not None and (not e.raises.strip() or e.signature is not None or e.step is not None):
        raise BadInput(f"{s.source}: [expect].raises",
                       "the text of the error, with no signature or step (a run "
                                                       "that raises has no first divergence)")
    if e.diverges_after_fix is not None and e.fixed_in is None and e.fixed_in_version is None:
        raise BadInput(f"{s.source}: [expect].diverges_after_fix",
                       "needs the fix it follows (fixed_in or fixed_in_version)")


def version_key(version: str) -> tuple[int, int, int] | None:
    """``MAJOR.MINOR.PATCH`` of a version string as a sortable tuple (a pre-release suffix is
    ignored), or None if it is no such version."""
    m = re.match(r"^(\d+)\.(\d+)\.(\d+)", version)
    return tuple(int(g) for g in m.groups()) if m else None


def _validate_capture_compare(s: Scenario) -> None:
    src = s.source
    for kind in s.capture.kinds:
        if kind not in CAPTURE_KINDS:
            raise BadInput(f"{src}: [capture].kinds",
                           f"unknown kind {kind!r}; one of {sorted(CAPTURE_KINDS)}")
    if s.capture.mode not in CAPTURE_MODES:
        raise BadInput(f"{src}: [capture].mode", "full or fingerprint")
    steps = s.reference.steps
    for step in s.capture.steps or ():
        if not 1 <= step <= steps:
            raise BadInput(f"{src}: [capture].steps",
                           f"step {step} is not in 1..{steps} (the steps every side runs)")
    if s.compare.policy not in POLICIES:
        raise BadInput(f"{src}: [compare].policy", f"one of {sorted(POLICIES)}")
    for key in ("k", "k_first_step", "floor"):
        value = getattr(s.compare, key)
        if value is not None and not value >= 0:
            raise BadInput(f"{src}: [compare].{key}", f"must be >= 0, got {value}")
    if bad := [k for k in s.compare.exact_steps if not 1 <= k <= steps]:
        raise BadInput(f"{src}: [compare].exact_steps", f"step {bad[0]} is not in 1..{steps}")


def _validate_limits(s: Scenario) -> None:
    """Sizes one machine can run, checked before anything is allocated or launched."""
    m, d, src = s.model, s.data, s.source
    lift = "; --no-limits lifts this limit"
    values = {f"[model].{k}": (k, getattr(m, k)) for k in
              ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "seq_length",
               "vocab_size")}
    values.update({f"[data].{k}": (k, getattr(d, k)) for k in ("micro_batch_size", "global_batch_size")})
    values["timeout_s"] = ("timeout_s", s.timeout_s)
    for name, side in s.sides.items():
        values[f"[{name}].steps"] = ("steps", side.steps)
        values[f"[{name}].world_size"] = ("world_size", side.world_size)
    values["[model]"] = ("parameters", parameter_count(m))
    values["[data]"] = ("tokens_per_step", d.global_batch_size * m.seq_length)
    for where, (limit, value) in values.items():
        if value > LIMITS[limit]:
            raise BadInput(f"{src}: {where}",
                           f"{limit} {value:,} exceeds the limit of {LIMITS[limit]:,}{lift}")


def parameter_count(m: ModelConfig) -> int:
    """Parameters of the GPT (LayerNorms, embeddings, the switches' own), for the size limit."""
    h, f, v = m.hidden_size, m.ffn_hidden_size, padded_vocab_size(m)
    layer = 4 * h * h + 2 * h * f + 4 * h  # qkv + proj, fc1 + fc2, two LayerNorms (weight, bias)
    return (m.num_layers * layer + v * h * (2 if m.untie_embeddings else 1) + m.seq_length * h + 2 * h
            + moe_parameter_count(m) + mtp_parameter_count(m) + arch_parameter_count(m))


# Block formats need whole blocks along both GEMM dims (TE pads nothing here).
_RECIPE_BLOCK = {"mxfp8": 32, "nvfp4": 16}


def _gtp_dim0s(m: ModelConfig, tp: int) -> dict[str, int]:
    """Dim 0 of each GTP-sharded weight's TP-local block."""
    return {
        "linear_qkv": qkv_rows(m) // tp,
        "linear_proj": m.hidden_size,
        "linear_fc1": (2 if m.activation in GATED else 1) * m.ffn_hidden_size // tp,
        "linear_fc2": m.hidden_size,
        "word_embeddings": padded_vocab_size(m, tp) // tp,
        "output_layer": padded_vocab_size(m, tp) // tp,
    }



def _validate_mlm(s: Scenario, side: Side, where: str) -> None:
    """The mlm backend's keys: ``args`` and ``data`` belong to it alone; its rules."""
    if side.backend != "mlm":
        if side.args or (side.data != "synthetic" and side.backend != "bridge"):
            raise BadInput(f"{where}.args", f"args and data are keys of the mlm backend, not {side.backend}")
        return
    other = s.candidate if side is s.reference else s.reference
    if side.data == "mock" and (other.backend not in ("mlm", "bridge") or other.data != "mock"):
        # Megatron-LM's mock samples are not the synthetic ones: the sides would read different data.
        raise BadInput(f"{where}.data",
                       "a mock-data side is compared with another mlm side on mock data only")
    if side.recipe != "none":
        raise BadInput(f"{where}.recipe", "recipes need Transformer Engine on the mlm backend")
    if side.gtp_pad_alignment != 16:  # configure_gtp_remat_from_recipe sets it, without FP8: 16
        raise BadInput(f"{where}.gtp_pad_alignment", "Megatron-LM's loop pads GTP shards to 16 rows")
    bad = [a for a in side.args if not isinstance(a, str) or not a]
    if bad:
        raise BadInput(f"{where}.args", f"every flag must be a non-empty string, got {bad[0]!r}")
    for arg in side.args:
        if (problem := flag_problem(arg)) is not None:
            raise BadInput(f"{where}.args", problem)


def _validate_pipeline(s: Scenario, side: Side, where: str) -> None:
    """Pipeline stages: the world splits into whole stages, the layers evenly over them."""
    pp, vpp = side.pipeline_parallel, side.virtual_pipeline  # pp >= 1: _validate_topology
    if side.world_size % (side.tp * side.gtp * pp):
        raise BadInput(f"{where}.world_size", f"world_size {side.world_size} must be a multiple of "
                                              f"TP x G x PP = {side.tp} x {side.gtp} x {pp}")
    if vpp is not None and (vpp < 2 or pp < 2):
        raise BadInput(f"{where}.virtual_pipeline",
                       f"needs pipeline_parallel >= 2 and >= 2 chunks per stage, got {vpp}")
    chunks = pp * (vpp or 1)
    if s.model.num_layers % chunks:
        raise BadInput(f"{where}.pipeline_parallel",
                       f"{chunks} model chunks must divide [model].num_layers = "
                                                     f"{s.model.num_layers}")
    if pp > 1 and not s.model.untie_embeddings:
        # The last stage would hold a second copy of the embedding as its output layer
        # (finalize_model_grads._allreduce_word_embedding_grads): not recorded by this harness.
        raise BadInput(f"{s.source}: [model].untie_embeddings",
                       "pipeline_parallel > 1 needs untied embeddings")
