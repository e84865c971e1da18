"""Scenario files and matrices: read a TOML file, expand a ``[matrix]`` into scenario documents.

A matrix file is a scenario file with a ``[matrix]`` table; the product of its axes gives one
scenario document per combination, each parsed and validated like a single scenario.
"""

from __future__ import annotations

import copy
import itertools
import math
import re
import tomllib
from pathlib import Path
from typing import Any

from harness.common.errors import BadInput, shown
from harness.scenario.schema import TOP_KEYS

MAX_MATRIX = 10_000
MAX_FILE_BYTES = 1 << 20  # a scenario is a page of TOML, not a data file


def read_toml(path: Path) -> dict:
    """A scenario or matrix file as a TOML document; BadInput naming the file otherwise."""
    if path.is_dir():
        raise BadInput(str(path), "is a folder, not a scenario file")
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise BadInput(str(path), f"{size:,} bytes: not a scenario file (limit {MAX_FILE_BYTES:,})")
        text = path.read_bytes().decode("utf-8")
        return tomllib.loads(text)
    except FileNotFoundError:
        raise BadInput(str(path), "no such file") from None
    except UnicodeDecodeError as e:
        raise BadInput(str(path), f"not UTF-8 text (byte {e.start}): not a TOML scenario file") from None
    except OSError as e:
        raise BadInput(str(path), f"cannot be read: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise BadInput(str(path), f"invalid TOML: {e}") from None
    except RecursionError:
        raise BadInput(str(path), "invalid TOML: nested too deeply") from None


def _deep_merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _set_path(doc: dict, dotted: str, value: Any, where: str) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        doc = doc.setdefault(p, {})
        if not isinstance(doc, dict):
            raise BadInput(where, f"{dotted!r} goes through {p!r}, which is not a table")
    doc[leaf] = value


def expand_matrix(raw: dict, path: Path) -> list[tuple[dict, str]]:
    """Expand ``[matrix]`` into the product of its axes.

    ``[matrix]`` keys: ``base`` (a scenario file, relative to this one; optional, the other
    top-level tables of this file are merged over it; a base's own ``[matrix]`` is not used,
    so a longer matrix can reuse a shorter one's model and policy), ``name`` (a template;
    ``{axis}`` is replaced by the axis value or label), and ``[matrix.axes]``: each key is a
    dotted path into the scenario (``train.precision``), or several joined by commas that take
    the same value (``reference.tp,candidate.tp``), or a label whose values are tables merged
    at the scenario root (each with a ``label`` key used in names).

    Returns each scenario's document with its source (``FILE (NAME)``), to be parsed.
    """
    src = str(path)
    spec = raw["matrix"]
    if not isinstance(spec, dict):
        raise BadInput(f"{src}: [matrix]", f"must be a table, got {shown(spec)}")
    unknown = set(spec) - {"base", "name", "axes", "when"}
    if unknown:
        raise BadInput(f"{src}: [matrix].{sorted(unknown)[0]}", "unknown key; known: base, name, axes, when")
    doc = {k: v for k, v in raw.items() if k != "matrix"}
    if "base" in spec:
        if not isinstance(spec["base"], str) or not spec["base"]:
            raise BadInput(f"{src}: [matrix].base",
                           f"must be a file name relative to this file, got {shown(spec['base'])}")
        base_path = path.parent / spec["base"]
        if base_path.resolve() == path.resolve():
            raise BadInput(f"{src}: [matrix].base", "names this file itself")
        try:
            base = {k: v for k, v in read_toml(base_path).items() if k != "matrix"}
        except BadInput as e:
            raise BadInput(f"{src}: [matrix].base", str(e)) from None
        doc = _deep_merge(base, doc)
    axes = spec.get("axes", {})
    if not isinstance(axes, dict):
        raise BadInput(f"{src}: [matrix.axes]", f"must be a table of axis = [values], got {shown(axes)}")
    if not axes:
        raise BadInput(f"{src}: [matrix.axes]", "a matrix needs at least one axis")
    for axis, values in axes.items():
        if not isinstance(values, list) or not values:
            raise BadInput(f"{src}: [matrix.axes].{axis}", "must be a non-empty list")
        for dotted in axis.split(","):
            parts = [p.strip() for p in dotted.split(".")]
            if not all(parts) or (len(parts) > 1 and parts[0] not in TOP_KEYS):
                raise BadInput(f"{src}: [matrix.axes].{axis}",
                               f"{dotted.strip()!r} is not a path into the scenario (e.g. train.precision)")
    template = spec.get("name", "-".join("{" + a + "}" for a in axes))
    if not isinstance(template, str):
        raise BadInput(f"{src}: [matrix].name", f"must be a string template, got {shown(template)}")
    if template.count("{") > 64 or len(template) > 1024:
        raise BadInput(f"{src}: [matrix].name", "template too long")
    if math.prod(len(v) for v in axes.values()) > MAX_MATRIX:
        raise BadInput(f"{src}: [matrix.axes]", f"expands to more than {MAX_MATRIX} scenarios")
    whens = _whens(spec.get("when", []), axes, src)
    scenarios, names = [], set()
    for combo in itertools.product(*axes.values()):
        scen = copy.deepcopy(doc)
        labels = {}
        for axis, value in zip(axes, combo):
            if isinstance(value, dict):
                value = dict(value)
                labels[axis] = str(value.pop("label", axis))
                scen = _deep_merge(scen, value)
            else:
                labels[axis] = "+".join(map(str, value)) if isinstance(value, list) else str(value)
                for dotted in axis.split(","):
                    _set_path(scen, dotted.strip(), value, f"{src}: [matrix.axes].{axis}")
        unknown = set(re.findall(r"\{([^}]*)\}", template)) - set(labels)
        if unknown:
            raise BadInput(f"{src}: [matrix].name", f"template names unknown axis {sorted(unknown)[0]!r}")
        for match, extra in whens:
            if all(labels[a] in wanted for a, wanted in match.items()):
                scen = _deep_merge(scen, extra)
        scen["axes"] = labels
        scen["name"] = re.sub(r"\{([^}]*)\}", lambda mt: labels[mt.group(1)], template)
        if scen["name"] in names:
            raise BadInput(f"{src}: [matrix].name", f"template gives duplicate name {scen['name']!r}")
        names.add(scen["name"])
        scenarios.append((scen, f"{src} ({scen['name']})"))
    return scenarios


def _whens(whens: Any, axes: dict, src: str) -> list[tuple[dict[str, set[str]], dict]]:
    """``[[matrix.when]]``: tables merged into the scenarios whose axis labels match
    (``axes = { topology = ["tp1-gtp2", ...], "train.precision" = "bf16" }``): what holds for a
    combination of axis values only, such as a known divergence of bf16 GTP runs."""
    where = f"{src}: [[matrix.when]]"
    if not isinstance(whens, list) or not all(isinstance(w, dict) for w in whens):
        raise BadInput(where, f"must be a list of tables, got {shown(whens)}")
    out = []
    for i, when in enumerate(whens):
        match = when.get("axes")
        if not isinstance(match, dict) or not match:
            raise BadInput(f"{where}[{i}].axes", "must be a table of axis = label or [labels]")
        wanted = {}
        for axis, labels in match.items():
            if axis not in axes:
                raise BadInput(f"{where}[{i}].axes.{axis}",
                               f"not an axis of this matrix; axes: {', '.join(axes)}")
            labels = labels if isinstance(labels, list) else [labels]
            known = {str(v.get("label", axis)) if isinstance(v, dict) else
                     "+".join(map(str, v)) if isinstance(v, list) else str(v) for v in axes[axis]}
            if not labels or not all(isinstance(lb, str) and lb in known for lb in labels):
                raise BadInput(f"{where}[{i}].axes.{axis}",
                               f"labels must be among {sorted(known)}, got {shown(labels)}")
            wanted[axis] = set(labels)
        extra = {k: v for k, v in when.items() if k != "axes"}
        if not extra or not set(extra) <= TOP_KEYS:
            raise BadInput(f"{where}[{i}]",
                           f"must set scenario tables besides axes (e.g. expect); got {sorted(extra)}")
        out.append((wanted, extra))
    return out
