"""The configuration space a campaign draws from, read from the options' declarations.

A *draw* is a scenario document: ``[model]``, ``[data]`` and ``[train]`` keys shared by both sides,
and one *axis*, a side key whose value the reference and candidate take apart (GTP 1 vs 2, a
code path off vs on): the pair must train the same model, so any difference beyond what the
axis's own rounding allows is a finding. A key is drawn over its declared choices (a ``Literal``,
a bool) or over the values a space file lists (numbers have no finite declaration); keys the
backend does not honour, and the harness's own (backend, checkpoint, self-test), are never drawn.
Draws set a few keys off their defaults (combinations, not everything at once) and, among several
candidates, the one covering most value pairs not yet covered wins (pairwise coverage).
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.common.errors import BadInput, shown
from harness.scenario.matrix import read_toml
from harness.scenario.options import Option, backend_problem, declared, value_problem
from harness.scenario.schema import DataConfig, ModelConfig, Side

CLASSES = {"model": ModelConfig, "data": DataConfig, "train": Side}
# Keys a draw never sets: the side's code and backend, its world (the space's), a checkpoint's
# topology (a [checkpoint] table, not keys), the harness's self-test, and the golden's own keys.
NEVER_DRAWN_GROUPS = frozenset({"backend", "checkpoint", "self-test"})
# preset: a name for switches the space draws one by one.
NEVER_DRAWN = frozenset({"world_size", "dp", "seed", "muon_blocks", "preset"})
# Axes: the side keys a pair's two sides take apart. Topology and the code paths only: a pair
# differing in precision (a bf16 grad reduction) or optimizer (Muon's blockwise mode) does not
# train the same model, and its verdict says so by design.
AXIS_KEYS = ("gtp", "tp", "ep", "expert_gtp")
AXIS_GROUPS = frozenset({"topology", "code paths"})
SPACE_KEYS = frozenset({"backend", "world_size", "timeout_s", "max_off_default", "candidates", "axes",
                        "exclude", "values", "fixed", "description", "checkpoint_steps"})
# A checkpoint pair: drawn as one more key (0: none), the step the reference saves at; the candidate
# loads it into its own topology (the axis's value) and both train on (harness.scenario.checkpoint).
CHECKPOINT = ("checkpoint", "save_step")
RESUMED = "resumed"


@dataclass(frozen=True)
class Axis:
    """A side key the two sides take apart: the reference's value, the candidate's."""

    key: str
    reference: Any
    candidate: Any

    @property
    def label(self) -> str:
        return f"{self.key}={shown_value(self.reference)}->{shown_value(self.candidate)}"


@dataclass
class Space:
    """What a campaign draws: per section and key the values (the default first), the axes, the
    fixed tables every draw starts from, and how many keys a draw sets off their defaults."""

    backend: str
    world_sizes: tuple[int, ...]
    values: dict[tuple[str, str], tuple]
    axes: tuple[Axis, ...]
    fixed: dict = field(default_factory=dict)
    timeout_s: float = 300.0
    max_off_default: int = 4
    candidates: int = 24
    source: str = "the declarations"

    def digest(self) -> str:
        """Identifies the space: a campaign resumes only on the space it was drawn from."""
        doc = [self.backend, self.world_sizes,
               sorted((f"{s}.{k}", list(v)) for (s, k), v in self.values.items()),
               [a.label for a in self.axes], self.fixed, self.timeout_s, self.max_off_default,
               self.candidates]
        return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:12]

    def to_json(self) -> dict:
        return {"backend": self.backend, "world_sizes": list(self.world_sizes), "source": self.source,
                "keys": {f"{s}.{k}": list(v) for (s, k), v in self.values.items()},
                "axes": [a.label for a in self.axes], "fixed": self.fixed, "digest": self.digest()}


def shown_value(value: Any) -> str:
    """A drawn value as labels and needs show it: strings bare, the rest as JSON (true, 0.5, null)."""
    return json.dumps(value) if not isinstance(value, str) else value


def _drawable(o: Option, backend: str) -> bool:
    return (o.group not in NEVER_DRAWN_GROUPS and o.name not in NEVER_DRAWN
            and backend_problem(o, object(), backend) is None)


def _declared_values(o: Option) -> tuple | None:
    """An option's values from its declaration alone (the default first), or None (a number)."""
    if o.choices is not None:
        return (o.default, *(c for c in o.choices if c != o.default))
    if o.hint is bool:
        return (o.default, not o.default)
    return None


def _axes(backend: str, values: dict) -> list[Axis]:
    """Every axis the declarations give: topology (GTP, TP, EP, expert GTP) and each topology or
    code-path key that changes only placement or a path the backend takes, default against each
    other value."""
    out = []
    for o in declared(Side).values():
        if o.name not in AXIS_KEYS and not (o.group in AXIS_GROUPS and (o.placement_only or o.path)):
            continue
        if not _drawable(o, backend) or o.name in ("recompute",) and backend != "megatron":
            continue
        vals = values.get(("train", o.name)) or _declared_values(o)
        if vals is None:
            continue
        out += [Axis(o.name, vals[0], v) for v in vals[1:]]
    return out


def _problem(section: str, key: str, value: Any, backend: str) -> str | None:
    o = declared(CLASSES[section])[key]
    return value_problem(o, value) or backend_problem(o, value, backend)


def load_space(path: str | None) -> Space:
    """The default space of the declarations, narrowed or widened by a space file (TOML):
    ``backend``, ``world_size`` (a list), ``axes`` (axis labels or keys to keep), ``exclude``
    (``section.key`` never drawn), ``[values.<section>]`` (values a key is drawn over; the first
    is the value a draw leaves it at), ``[fixed.<section>]`` (values every draw starts from),
    ``max_off_default``, ``candidates``, ``timeout_s``."""
    raw = read_toml(Path(path)) if path else {}
    where = path or "the default space"
    for key in raw:
        if key not in SPACE_KEYS:
            raise BadInput(f"{where}: {key}", f"unknown key; known keys are {', '.join(sorted(SPACE_KEYS))}")
    backend = raw.get("backend", "megatron")
    if backend not in ("megatron", "torch"):
        raise BadInput(f"{where}: backend", f"{shown(backend)}: the fuzzer drives megatron or torch sides")
    worlds = raw.get("world_size", [2])
    if not isinstance(worlds, list) or not worlds or not all(isinstance(w, int) and w >= 1 for w in worlds):
        raise BadInput(f"{where}: world_size", f"a list of positive integers, got {shown(worlds)}")
    excluded = set(raw.get("exclude", []))
    values, base = {}, {}
    for section, cls in CLASSES.items():
        listed = raw.get("values", {}).get(section, {})
        for key, o in declared(cls).items():
            if f"{section}.{key}" in excluded or not _drawable(o, backend):
                continue
            vals = listed.get(key)
            if vals is None:
                vals = _declared_values(o)
            elif not isinstance(vals, list) or not vals:
                raise BadInput(f"{where}: values.{section}.{key}", f"a non-empty list, got {shown(vals)}")
            else:
                for v in vals:
                    if (problem := _problem(section, key, v, backend)) is not None:
                        raise BadInput(f"{where}: values.{section}.{key}", problem)
                if o.default is None:  # TOML has no null: a list names the values besides the default
                    vals = [None, *vals]
                elif vals[0] != o.default:  # the first value is where a draw leaves the key
                    base.setdefault(section, {})[key] = vals[0]
            if vals is None or len(vals) < 2:
                continue
            values[(section, key)] = tuple(vals)
        for key in listed:
            if key not in declared(cls):
                raise BadInput(f"{where}: values.{section}.{key}", f"no such key in [{section}]")
    for name in excluded:
        section, _, key = name.partition(".")
        if section not in CLASSES or key not in declared(CLASSES[section]):
            raise BadInput(f"{where}: exclude", f"{name!r} is no section.key of model, data or train")
    steps = raw.get("checkpoint_steps", [])
    if not isinstance(steps, list) or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1
                                               for k in steps):
        raise BadInput(f"{where}: checkpoint_steps", f"a list of steps >= 1 to save at, got {shown(steps)}")
    if steps:
        values[CHECKPOINT] = (0, *steps)
    axes = _axes(backend, values)
    if "axes" in raw:
        wanted = set(raw["axes"])
        axes = [a for a in axes if a.key in wanted or a.label in wanted]
        known = {a.key for a in axes} | {a.label for a in axes}
        if missing := sorted(wanted - known):
            raise BadInput(f"{where}: axes",
                           f"no axis {missing}; axes are {[a.label for a in _axes(backend, values)]}")
    if not axes:
        raise BadInput(f"{where}: axes", "the space has no axis: a pair's sides would not differ")
    fixed = raw.get("fixed", {})
    if not isinstance(fixed, dict) or any(s not in CLASSES for s in fixed):
        raise BadInput(f"{where}: fixed", "tables [fixed.model], [fixed.data] and [fixed.train] only")
    fixed = {s: {**base.get(s, {}), **fixed.get(s, {})} for s in CLASSES if base.get(s) or fixed.get(s)}
    return Space(backend=backend, world_sizes=tuple(worlds), values=values, axes=tuple(axes), fixed=fixed,
                 timeout_s=float(raw.get("timeout_s", 300.0)),
                 max_off_default=int(raw.get("max_off_default", 4)),
                 candidates=int(raw.get("candidates", 24)), source=where)


@dataclass(frozen=True)
class Draw:
    """One configuration pair: shared settings off their defaults, the world, the axis."""

    settings: tuple[tuple[str, str, Any], ...]
    """(section, key, value) of each key set off the space's default, sorted."""
    world_size: int
    axis: Axis
    reductions: tuple[tuple[str, str, Any], ...] = ()
    """Sizes shrinking made smaller (fewer steps, layers): applied, but no need and no coverage."""

    def items(self) -> list[str]:
        """What coverage counts: each setting, the world and the axis, as ``key=value``."""
        return [f"{s}.{k}={shown_value(v)}" for s, k, v in self.settings] + [f"world={self.world_size}",
                                                                          f"axis:{self.axis.label}"]

    def document(self, space: Space, name: str, inject: tuple[str, ...] = ()) -> dict:
        """The scenario document of the draw (validated by parsing it)."""
        doc = copy.deepcopy(space.fixed)
        doc["name"], doc["timeout_s"] = name, space.timeout_s
        train = doc.setdefault("train", {})
        train.update(backend=space.backend, world_size=self.world_size)
        for section, key, value in (*self.settings, *self.reductions):
            doc.setdefault(section, {})[key] = value
        doc["reference"] = {self.axis.key: self.axis.reference}
        doc["candidate"] = {self.axis.key: self.axis.candidate,
                            **({"inject": list(inject)} if inject else {})}
        for table in (doc["reference"], doc["candidate"]):  # None: the tree's own default, not written
            for key in [k for k, v in table.items() if v is None]:
                del table[key]
        if "checkpoint" in doc:  # the reference saves; the candidate's table is what it loads into
            doc["checkpoint"]["load_into"] = [{"label": RESUMED}]
        return doc

    def to_json(self) -> dict:
        return {"settings": [list(s) for s in self.settings], "world_size": self.world_size,
                "axis": [self.axis.key, self.axis.reference, self.axis.candidate],
                "reductions": [list(r) for r in self.reductions]}

    @classmethod
    def from_json(cls, doc: dict) -> Draw:
        return cls(settings=tuple(tuple(s) for s in doc["settings"]), world_size=doc["world_size"],
                   axis=Axis(*doc["axis"]), reductions=tuple(tuple(r) for r in doc.get("reductions", ())))


class Coverage:
    """The values and value pairs the judged draws have reached."""

    def __init__(self) -> None:
        self.values: set[str] = set()
        self.pairs: set[tuple[str, str]] = set()

    def new_in(self, draw: Draw) -> int:
        items = draw.items()
        pairs = {tuple(sorted(p)) for p in itertools.combinations(items, 2)}
        return 4 * len(set(items) - self.values) + len(pairs - self.pairs)

    def add(self, draw: Draw) -> None:
        items = draw.items()
        self.values |= set(items)
        self.pairs |= {tuple(sorted(p)) for p in itertools.combinations(items, 2)}

    def reachable(self, space: Space) -> tuple[int, int]:
        """(values, value pairs) a space holds: every non-default value, world and axis (pairs of
        two keys' values, whether the rules allow them or not: an upper bound)."""
        per_key = [len(v) - 1 for v in space.values.values()] + [len(space.world_sizes), len(space.axes)]
        return sum(per_key), sum(a * b for a, b in itertools.combinations(per_key, 2))


def random_draw(space: Space, rng: random.Random, seeds: list = ()) -> Draw:
    """A draw: an axis, a world, and 0 to ``max_off_default`` other keys off their defaults, each at
    one of its other values; with ``seeds`` (:mod:`harness.fuzz.reach`), starting from one of them."""
    base, axis = rng.choice(seeds) if seeds else ((), rng.choice(space.axes))
    taken = {(s, k) for s, k, _ in base} | {("train", axis.key)}
    keys = sorted(k for k in space.values if k not in taken)
    n = rng.randint(0, max(0, min(space.max_off_default - len(base), len(keys))))
    chosen = sorted(rng.sample(keys, n))
    settings = tuple(sorted((*base, *((s, k, rng.choice(space.values[(s, k)][1:])) for s, k in chosen))))
    return Draw(settings=settings, world_size=rng.choice(space.world_sizes), axis=axis)


def draw_for(space: Space, seed: int, index: int, coverage: Coverage, valid,
             seeds: list = ()) -> tuple[Draw | None, list[str]]:
    """The ``index``-th draw of a campaign: of ``space.candidates`` random draws (from ``seeds``
    where given) that ``valid`` (the rules) accepts, the one covering most new values and pairs;
    the reasons of those refused. Deterministic for (seed, index, coverage)."""
    rng = random.Random(f"{seed}:{index}")
    best, best_score, refused, accepted = None, -1, [], 0
    for _ in range(space.candidates * 4):
        d = random_draw(space, rng, seeds)
        if (reason := valid(d)) is not None:
            refused.append(reason)
            continue
        accepted += 1
        if (score := coverage.new_in(d)) > best_score:
            best, best_score = d, score
        if accepted >= space.candidates:
            break
    return best, refused
