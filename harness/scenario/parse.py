"""Scenarios: what to run and compare, parsed from TOML into validated dataclasses.

The schema (dataclasses, choices, limits) is :mod:`harness.scenario.schema`; this module turns a TOML
document into them, rejecting unknown keys and mistyped values, then checks the rules between
keys (:mod:`harness.scenario.rules`). A ``[train]`` table holds defaults every side inherits; a side's
own keys override them. A matrix file expands into scenarios (:mod:`harness.scenario.matrix`).

Every rule is checked before any process is launched; a violation raises
:class:`~harness.common.errors.BadInput` naming the file, the key and the rule.
"""

from __future__ import annotations

import math
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import harness.scenario.checkpoint as checkpointing
from harness.scenario.options import golden_side
from harness.common.errors import BadInput, shown
from harness.scenario.matrix import expand_matrix, read_toml
from harness.scenario.presets import expand_preset
from harness.scenario.tree_specs import is_code_comparison
from harness.scenario.rules import validate
from harness.scenario.schema import (
    HARD_INT_LIMIT, TOP_KEYS, CapturePolicy, ComparePolicy, DataConfig, KnownDivergence, ModelConfig,
        Scenario,
    Side, check_scenario_name,
)


def _hints(cls) -> dict[str, Any]:
    """Field name -> resolved type (``Literal``, ``tuple[int, ...] | None``, ...)."""
    return typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))


def _build(cls, table: dict, where: str):
    """Instantiate ``cls`` from a TOML table, rejecting unknown keys and mistyped values."""
    if not isinstance(table, dict):
        raise BadInput(where, f"must be a table, got {type(table).__name__}")
    known = _hints(cls)
    kwargs = {}
    for key, value in table.items():
        if key not in known:
            raise BadInput(f"{where}.{key}", f"unknown key; known keys are {', '.join(sorted(known))}")
        kwargs[key] = _coerce(value, known[key], f"{where}.{key}")
    return cls(**kwargs)


def _type_name(hint: Any) -> str:
    origin, args = get_origin(hint), get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin in (Union, types.UnionType):
        return " | ".join("None" if a is type(None) else _type_name(a) for a in args)
    return getattr(hint, "__name__", str(hint))


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """``value`` from TOML as the field's type ``hint``; ints are widened to floats."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):  # X | None: TOML has no null, only "all" for steps
        inner = next(a for a in args if a is not type(None))
        if value is None or (get_origin(inner) is tuple and value == "all"):
            return None
        return _coerce(value, inner, where)
    if origin is tuple:
        if not isinstance(value, list):
            raise BadInput(where, f"must be a list, got {shown(value)}")
        for v in value:
            if not _is(v, args[0]):
                raise BadInput(where, f"every item must be {_type_name(args[0])}, got {shown(v)}")
        return tuple(value)
    if origin is Literal:  # membership is a rule, with its own message (harness.scenario.rules)
        if not isinstance(value, str):
            raise BadInput(where, f"must be {_type_name(hint)}, got {shown(value)}")
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value) if abs(value) < 2**63 else math.inf
    if not _is(value, hint):
        raise BadInput(where, f"must be {_type_name(hint)}, got {shown(value)}")
    if hint is float and not math.isfinite(value):
        raise BadInput(where, f"must be a finite number, got {value}")
    if hint is int and not -HARD_INT_LIMIT <= value <= HARD_INT_LIMIT:
        raise BadInput(where, f"must be within +-2**31, got {shown(value)}")
    return value


def _is(value: Any, hint: Any) -> bool:
    if get_origin(hint) is Literal:
        return isinstance(value, str)
    return isinstance(value, hint) and isinstance(value, bool) == (hint is bool)


def parse_scenario(raw: dict, source: str, limits: bool = True) -> Scenario:
    """Build and validate a scenario from a TOML document (already loaded)."""
    for key in raw:
        if key not in TOP_KEYS:
            raise BadInput(
                f"{source}: {key}", f"unknown key; known keys are {', '.join(sorted(TOP_KEYS))}"
            )
    if "name" not in raw:
        raise BadInput(f"{source}: name", "every scenario needs a name")
    if "checkpoint" in raw:
        raise BadInput(f"{source}: [checkpoint]",
                       "a checkpoint scenario is expanded by load(), one per load_into entry")
    if (problem := check_scenario_name(raw["name"])) is not None:
        raise BadInput(f"{source}: name", problem)
    for key in ("description",):
        if not isinstance(raw.get(key, ""), str):
            raise BadInput(f"{source}: {key}", f"must be a string, got {shown(raw[key])}")
    for key in ("model", "data", "train", "reference", "candidate", "golden", "capture", "compare", "axes",
                "expect"):
        if key in raw and not isinstance(raw[key], dict):
            raise BadInput(f"{source}: [{key}]", f"must be a table, got {shown(raw[key])}")
    for side in ("reference", "candidate"):
        if side not in raw:
            raise BadInput(f"{source}: [{side}]", "missing table: a scenario compares two sides")
    model = _build(ModelConfig, expand_preset(raw.get("model", {}), f"{source}: [model]"),
                   f"{source}: [model]")
    data = _build(DataConfig, raw.get("data", {}), f"{source}: [data]")
    train = raw.get("train", {})
    _build(Side, train, f"{source}: [train]")  # unknown keys in defaults are errors too
    # The golden side inherits the training settings of [train], each key as its declaration says.
    sides = {
        "reference": {**train, **raw["reference"]},
        "candidate": {**train, **raw["candidate"]},
        "golden": {**golden_side(train, Side), **raw.get("golden", {})},
    }
    ref = sides["reference"]
    blockwise = ref.get("optimizer") == "muon" and ref.get("muon_tp_mode") == "blockwise"
    if blockwise and "muon_blocks" not in sides["golden"]:
        # megatron-core's blockwise Muon orthogonalizes each TP shard alone: the golden, at the reference's
        # TP.
        sides["golden"]["muon_blocks"] = ref.get("tp", 1)
    sides = {n: _build(Side, t, f"{source}: [{n}]") for n, t in sides.items()}
    scenario = Scenario(
        name=raw["name"],
        source=source,
        description=raw.get("description", ""),
        timeout_s=_coerce(raw.get("timeout_s", 600.0), float, f"{source}: timeout_s"),
        axes=dict(raw.get("axes", {})),
        model=model,
        data=data,
        capture=_build(CapturePolicy, raw.get("capture", {}), f"{source}: [capture]"),
        compare=_build(ComparePolicy, _code_policy(raw, sides), f"{source}: [compare]"),
        expect=_build(KnownDivergence, raw["expect"], f"{source}: [expect]") if "expect" in raw else None,
        **sides,
    )
    validate(scenario, limits=limits)
    return scenario


def _code_policy(raw: dict, sides: dict[str, Side]) -> dict:
    """The ``[compare]`` table; a code comparison (reference and candidate differ in their
    megatron-core only) is judged ``exact`` unless the table says otherwise: the same
    computation on the same values, so any difference is the code's."""
    table = dict(raw.get("compare", {}))
    if "policy" not in table and is_code_comparison(sides["reference"], sides["candidate"]):
        table["policy"] = "exact"
    return table


def load(path: str | Path, limits: bool = True) -> list[Scenario]:
    """Load a scenario file or a matrix file (one with a ``[matrix]`` table). ``limits``:
    refuse sizes beyond :data:`LIMITS` (``--no-limits`` lifts them)."""
    path = Path(path)
    raw = read_toml(path)
    docs = expand_matrix(raw, path) if "matrix" in raw else [(raw, str(path))]
    out = []
    for doc, source in docs:
        if "checkpoint" in doc:  # one scenario per topology the checkpoint is loaded into
            out += checkpointing.expand(doc, source, lambda d, src: parse_scenario(d, src, limits=limits),
                                        lambda s: validate(s, limits=limits))
        else:
            out.append(parse_scenario(doc, source, limits=limits))
    return out
