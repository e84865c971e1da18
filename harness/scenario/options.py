"""One declaration per scenario key: the option a field of ``[model]``, ``[data]`` or a side is.

Every field of :class:`~harness.scenario.schema.ModelConfig`, :class:`~harness.scenario.schema.DataConfig`
and :class:`~harness.scenario.side.Side` is declared with :func:`option`: its type is the field's
annotation (a ``Literal`` lists the choices), its default the field's, and the declaration says
the rest once: the range of a number, the backends that honour a value off its default, the
megatron-core argument and the Megatron-LM flag it reaches, what the golden side does with it,
whether it changes only where a value lives (placement), and the rules tying it to other keys
(:class:`Need`). The parser, the rules, golden inheritance, the per-tensor expectations, the
backends' argument mapping, docs/scenarios.md's key tables and the configuration search read the
declarations through :func:`declared`; nothing else lists keys.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Callable, Literal, get_args, get_origin

BACKENDS = ("megatron", "mlm", "bridge", "torch")
EVERY_BACKEND = frozenset(BACKENDS)

# What the golden side (the torch backend, one process) does with a key of ``[train]``:
INHERIT = "inherit"  # takes [train]'s value, as the compared sides do
OWN = "own"  # has a value of its own (``golden_value``): the golden's topology and precision
NEVER = "never"  # keeps the default: the key selects code the golden does not run

TREE_DEFAULT = "the tree's own default"
"""The meaning of an option's default ``None`` where ``tree_default`` is set: the backend passes
nothing, megatron-core (or Megatron-LM) applies the default of the tree under test, and the
trace's provenance records the value the tree used (``tree_defaults``)."""


@dataclass(frozen=True)
class Need:
    """A rule tying an option's value to another key: where the option is off its default and
    ``applies`` holds for its value, ``holds`` must hold for the side (or model); ``says`` is the
    rule as the message states it. Rules that need arithmetic over several keys are code, in the
    rule modules; these are the ones a search can read."""

    applies: Callable[[Any], bool]
    holds: Callable[[Any], bool]
    says: str


@dataclass(frozen=True)
class Option:
    """A scenario key as declared: what it accepts, who honours it, and where it goes."""

    name: str
    section: str
    """``model``, ``data`` or ``side`` (a side's keys: [train], [reference], [candidate], [golden])."""
    hint: Any
    """The field's type; a ``Literal`` lists the choices."""
    default: Any
    group: str
    """A heading of the key tables (topology, precision, optimizer, code paths, ...)."""
    doc: str
    low: float | None = None
    """The least value (inclusive)."""
    high: float | None = None
    """The bound above (exclusive, or inclusive with ``high_inclusive``)."""
    high_inclusive: bool = False
    backends: frozenset[str] = EVERY_BACKEND
    """The backends that honour a value off the default; another refuses it."""
    golden: str = INHERIT
    golden_value: Any = None
    placement_only: bool = False
    """Changes where a value lives or when it moves, never an operation on a value: sides that
    differ only in such keys run the same kernels (:mod:`harness.compare.expectations`)."""
    tree_default: bool = False
    """``None`` (the default) means the tree's own default: :data:`TREE_DEFAULT`."""
    added_later: bool = False
    """Added after traces were first keyed: at its default the key leaves a side's key as it was."""
    path: bool = False
    """A code path a report lists where a side takes it (off its default)."""
    carried: bool = False
    """A resumed side shares it with the run it continues (a checkpoint keeps it)."""
    mcore: tuple[str, ...] = ()
    """The megatron-core arguments it reaches (``TransformerConfig.num_layers``, ...): one to one,
    or with a note in parentheses where the backend derives the argument from it (``(TP x G)``)."""
    mlm: str = ""
    """The Megatron-LM flag it reaches (``--num-layers``), with a note in parentheses where the value
    is derived (``--bf16 (bf16)``); a side's ``args`` may not set it."""
    needs: tuple[Need, ...] = ()

    @property
    def choices(self) -> tuple[str, ...] | None:
        """The values a ``Literal`` key accepts (None for other types)."""
        hint = self.hint
        if get_origin(hint) in (typing.Union, types.UnionType):
            hint = next(a for a in get_args(hint) if a is not type(None))
        return get_args(hint) if get_origin(hint) is Literal else None

    def off_default(self, value: Any) -> bool:
        return value != self.default


def option(default: Any, group: str, doc: str, **declared: Any) -> Any:
    """A dataclass field declaring its option (see :class:`Option` for the keywords)."""
    extra = {"group": group, "doc": " ".join(doc.split()), **declared}
    if isinstance(default, (list, dict, set)):
        raise TypeError("an option's default is immutable (a tuple, not a list)")
    return field(default=default, metadata={"option": extra})


@cache
def declared(cls: type) -> dict[str, Option]:
    """The options of a schema dataclass, by key, in field order."""
    section = getattr(cls, "SECTION")
    hints = typing.get_type_hints(cls, vars(__import__(cls.__module__, fromlist=["_"])))
    out = {}
    for f in dataclasses.fields(cls):
        meta = f.metadata.get("option")
        if meta is None:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with option()")
        out[f.name] = Option(name=f.name, section=section, hint=hints[f.name], default=f.default, **meta)
    return out


def keyed_later(cls: type) -> dict[str, Any]:
    """Keys added after traces were first keyed, with their defaults (``Side.key``)."""
    return {o.name: o.default for o in declared(cls).values() if o.added_later}


def golden_side(train: dict, side_cls: type) -> dict:
    """The golden's side table from ``[train]``: inherited keys, the golden's own values, and
    none of the keys it never takes."""
    opts = declared(side_cls)
    own = {o.name: o.golden_value for o in opts.values() if o.golden == OWN}
    return {**{k: v for k, v in train.items() if k in opts and opts[k].golden == INHERIT}, **own}


def placement_only(side_cls: type) -> frozenset[str]:
    """Keys that change only placement (sides that differ in these alone run the same kernels)."""
    return frozenset(o.name for o in declared(side_cls).values() if o.placement_only)


def mlm_flags(*classes: type) -> dict[str, Option]:
    """Megatron-LM flag -> the option it belongs to (``args`` may not set a declared key)."""
    return {o.mlm.split(" (")[0]: o for cls in classes for o in declared(cls).values() if o.mlm}


def mcore_kwargs(target: str, *objects: Any) -> dict[str, Any]:
    """``{argument: value}`` for megatron-core's ``target`` (``TransformerConfig``, ...) from the
    options of ``objects`` declared to reach it one to one (an option whose default means the
    tree's own default is passed only when set)."""
    out = {}
    for obj in objects:
        for o in declared(type(obj)).values():
            for dest in o.mcore:
                cls, _, arg = dest.partition(".")
                if " (" in arg:  # derived by the backend, not passed as it is
                    continue
                value = getattr(obj, o.name)
                if cls == target and not (o.tree_default and value is None):
                    out[arg] = value
    return out


def value_problem(o: Option, value: Any) -> str | None:
    """What is wrong with ``value`` for option ``o`` alone (its choices and range), or None."""
    if value is None:
        return None  # only an optional key parses to None
    if (choices := o.choices) is not None and value not in choices:
        return f"unknown {o.name} {value!r}; one of {sorted(choices)}"
    if o.low is not None and value < o.low:
        return f"must be >= {o.low}, got {value}"
    if o.high is not None and (value > o.high if o.high_inclusive else value >= o.high):
        bracket = "]" if o.high_inclusive else ")"
        return f"must be in [{o.low}, {o.high}{bracket}, got {value}"
    return None


def backend_problem(o: Option, value: Any, backend: str) -> str | None:
    """Why a side of ``backend`` cannot take ``value`` (off the option's default), or None."""
    if backend in o.backends or not o.off_default(value):
        return None
    takes = ", ".join(b for b in BACKENDS if b in o.backends)
    verb = "backends take" if len(o.backends) > 1 else "backend takes"
    return f"only the {takes} {verb} this option (backend {backend!r})"


def need_problem(o: Option, value: Any, obj: Any) -> str | None:
    """The first rule of ``o`` tying its value to another key that ``obj`` breaks, or None."""
    for need in o.needs:
        if o.off_default(value) and need.applies(value) and not need.holds(obj):
            return need.says
    return None


def _shown_default(o: Option) -> str:
    if o.default is None:
        return TREE_DEFAULT if o.tree_default else "none"
    if isinstance(o.default, bool):
        return str(o.default).lower()
    if isinstance(o.default, tuple):
        return f"`{list(o.default)!r}`".replace("'", '"')
    return f"`{o.default!r}`".replace("'", '"') if isinstance(o.default, str) else f"{o.default!r}"


def _shown_golden(o: Option) -> str:
    return {INHERIT: "inherits", NEVER: "never"}.get(o.golden) or f"`{o.golden_value!r}`".replace("'", '"')


def key_tables(*classes: type) -> str:
    """docs/scenarios.md's key tables, one per section and group, from the declarations (``gtp-parity
    options`` prints them)."""
    out = []
    for cls in classes:
        opts, side = declared(cls), cls.SECTION == "side"
        for group in dict.fromkeys(o.group for o in opts.values()):
            head = ["key", "default", "backends", *(["golden"] if side else []), "reaches", "meaning"]
            out += [f"**[{cls.SECTION}] {group}**", "", "| " + " | ".join(head) + " |",
                    "|---" * len(head) + "|"]
            for o in (o for o in opts.values() if o.group == group):
                backends = ", ".join(b for b in BACKENDS if b in o.backends)
                backends = "all" if o.backends == EVERY_BACKEND else backends or "none"
                reaches = "<br>".join(f"`{r}`" for r in (*o.mcore, o.mlm) if r) or "the harness"
                choices = f"one of {', '.join(f'`{c}`' for c in o.choices)}" if o.choices else ""
                notes = [choices, value_range(o), "placement only" if o.placement_only else ""]
                meaning = "; ".join([o.doc.replace("``", "`"), *filter(None, notes)])
                cells = [f"`{o.name}`", _shown_default(o), backends, *([_shown_golden(o)] if side else []),
                         reaches, meaning]
                out.append("| " + " | ".join(cells) + " |")
            out.append("")
    return "\n".join(out).rstrip() + "\n"


def value_range(o: Option) -> str:
    """The option's range as text (``>= 1``, ``[0.0, 1.0)``), or ``""``."""
    if o.high is not None:
        return f"[{o.low}, {o.high}{']' if o.high_inclusive else ')'}"
    return f">= {o.low}" if o.low is not None else ""


DOCS_BEGIN, DOCS_END = "<!-- keys: generated by `gtp-parity options` -->", "<!-- keys: end -->"
