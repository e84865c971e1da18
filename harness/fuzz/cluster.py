"""What a failing pair looks like (its fingerprint), and findings grouped by it.

Two pairs fail *the same way* where their first divergences share the signature and the kind of
tensor (for a raise: the exception's type and its innermost frame in the code under test). A
cluster is a fingerprint, the tensor's pattern (layer numbers as ``*``) and the settings shrinking
could not remove: what the bug needs. A cluster whose needs a shipped scenario with an
``[expect]`` holds, with the same signature, is that recorded known divergence.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from harness.common.errors import BadInput
from harness.compare.summary import FirstDivergence
from harness.fuzz.space import Draw
from harness.scenario import load

Fingerprint = tuple[str, ...]
EAGER = ("train", "gtp_collectives", "eager")
"""The setting a race is shrunk with (:mod:`harness.fuzz.shrink`): how it fails, never a need."""


def fingerprint(fd: FirstDivergence | None) -> Fingerprint | None:
    """(signature, kind), or ("raised", type, frame) for the code under test raising."""
    if fd is None:
        return None
    if fd.signature == "raised":
        raised = fd.extra.get("raised") or {}
        return ("raised", str(raised.get("type")), str(raised.get("where")))
    return (str(fd.signature), str(fd.kind))


def tensor_pattern(fd: FirstDivergence | None) -> str:
    """The first divergent tensor with its layer and expert numbers as ``*``."""
    if fd is None or fd.signature == "raised" or not fd.tensor:
        return ""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", fd.tensor)


@dataclass
class Cluster:
    """Findings that fail the same way and need the same settings."""

    id: str
    fingerprint: Fingerprint
    pattern: str
    needs: list[str]
    """The minimal draw's settings and axis (``section.key=value``, ``axis:key=a->b``)."""
    minimal: dict
    """The minimal draw (:meth:`Draw.to_json`) and its reductions."""
    scenario_file: str = ""
    members: list[str] = field(default_factory=list)
    example: dict = field(default_factory=dict)
    """The first member's first divergence (its summary's JSON)."""
    known: str | None = None
    """The shipped scenario recording it (``FILE (NAME)``), or None: new."""
    shrink: dict = field(default_factory=dict)

    def holds(self, draw: Draw) -> bool:
        """Whether ``draw`` sets everything this cluster needs."""
        return set(self.needs) <= set(draw.items()) - {i for i in draw.items() if i.startswith("world=")}

    def to_json(self) -> dict:
        return {"id": self.id, "fingerprint": list(self.fingerprint), "pattern": self.pattern,
                "needs": self.needs, "minimal": self.minimal, "scenario_file": self.scenario_file,
                "members": self.members, "count": len(self.members), "example": self.example,
                "known": self.known, "shrink": self.shrink}

    @classmethod
    def from_json(cls, doc: dict) -> Cluster:
        return cls(id=doc["id"], fingerprint=tuple(doc["fingerprint"]), pattern=doc["pattern"],
                   needs=list(doc["needs"]), minimal=doc["minimal"], scenario_file=doc["scenario_file"],
                   members=list(doc["members"]), example=doc["example"], known=doc["known"],
                   shrink=doc.get("shrink", {}))


def needs_of(draw: Draw, eager: bool = False) -> list[str]:
    """A minimal draw's needs: its settings and axis (the world is a size, not a need; an axis
    shrunk to one value is none; ``eager``: the collectives a race was shrunk with are none)."""
    no_axis = draw.axis.reference == draw.axis.candidate
    return sorted(i for i in draw.items() if not i.startswith("world=")
                  and not (no_axis and i.startswith("axis:"))
                  and not (eager and i == "{}.{}={}".format(*EAGER)))


def recorded_divergences(folder: Path) -> list[tuple[str, object]]:
    """Every shipped scenario with an ``[expect]`` in ``folder``'s TOML files: (source, scenario).
    Files that need a checkout this machine lacks are passed over (they record nothing here)."""
    out = []
    for path in sorted(folder.glob("*.toml")):
        try:
            out += [(s.source, s) for s in load(path) if s.expect is not None]
        except BadInput:
            continue
    return out


def _value_of(scenario, item: str):
    """Whether a recorded scenario holds a need (``section.key=value`` or an axis). The bug lives in
    the candidate's configuration: an axis holds where the recorded candidate takes its value, a
    side key where the recorded candidate has it, whatever the recorded reference differs in."""
    if item.startswith("axis:"):
        key, _, values = item[5:].partition("=")
        return _text(getattr(scenario.candidate, key)) == values.partition("->")[2]
    dotted, _, value = item.partition("=")
    section, _, key = dotted.partition(".")
    if section == "checkpoint":  # the saving run holds the checkpoint's keys (save_step)
        return scenario.saver is not None and _text(getattr(scenario.saver, key)) == value
    obj = {"model": scenario.model, "data": scenario.data}.get(section, scenario.candidate)
    return _text(getattr(obj, key)) == value


def _text(value) -> str:
    return value if isinstance(value, str) else json.dumps(list(value) if isinstance(value, tuple) else value)


def known_as(cluster: Cluster, recorded: list[tuple[str, object]]) -> str | None:
    """The recorded scenario this cluster is (same signature, every need held), or None."""
    signature = cluster.fingerprint[0]
    for source, s in recorded:
        want = s.expect.signature or ("raised" if s.expect.raises else None)
        if want not in (None, signature):
            continue
        if all(_value_of(s, need) for need in cluster.needs):
            return source
    return None
