"""A planted fault's catalogue entry (:mod:`harness.scenario.faults` holds the catalogue)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fault:
    name: str
    bug_class: str
    description: str
    expect: dict
    """Expected first divergence: step, phase, kind, tensor (fnmatch), signature."""
    target: str = ""
    """The parameter the fault acts on, where it acts on one."""
