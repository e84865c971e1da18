"""The code under test as an axis of a scenario: which megatron-core each side imports.

``--megatron-core SPEC`` sets every megatron-core side's tree; ``--reference-code`` and
``--candidate-code`` one side's. Given both, and different, the scenario becomes a *code
comparison*: the scenario's candidate configuration run on each tree, judged ``exact``: the
same computation on the same values, so any difference is the code's. (The specs are resolved
to trees before launch, by :mod:`harness.run.code`.)
"""

from __future__ import annotations

import dataclasses

from harness.scenario.schema import Scenario, Side

USES_MEGATRON = ("megatron", "mlm", "bridge")


def is_code_comparison(reference: Side, candidate: Side) -> bool:
    """Whether the two sides differ in their megatron-core tree and in nothing else."""
    return (reference.megatron_core != candidate.megatron_core
            and dataclasses.replace(reference, megatron_core=candidate.megatron_core) == candidate)  # fmt: skip


def _on(side: Side | None, spec: str | None) -> Side | None:
    if side is None or spec is None or side.backend not in USES_MEGATRON:
        return side
    return dataclasses.replace(side, megatron_core=spec)


def _on_bridge(side: Side | None, spec: str | None) -> Side | None:
    if side is None or spec is None or side.backend != "bridge":
        return side
    return dataclasses.replace(side, bridge=spec)


def with_code(scenarios: list[Scenario], every: str | None = None, reference: str | None = None,
              candidate: str | None = None, bridge: str | None = None) -> list[Scenario]:
    """The scenarios with the trees the command line names (None: as the file says); ``bridge``:
    the Megatron-Bridge every bridge side runs."""
    out = []
    for s in scenarios:
        s = dataclasses.replace(s, reference=_on_bridge(s.reference, bridge), candidate=_on_bridge(s.candidate, bridge))
        s = dataclasses.replace(s, reference=_on(s.reference, every), candidate=_on(s.candidate, every),
                                saver=_on(s.saver, every))  # fmt: skip
        if reference is not None and candidate is not None and reference != candidate:
            ref, cand = _on(s.candidate, reference), _on(s.candidate, candidate)
            s = dataclasses.replace(
                s, reference=ref, candidate=cand, expect=None,
                compare=dataclasses.replace(s.compare, policy="exact"),
                description=f"code comparison: {s.name}'s candidate on {reference} vs {candidate}")  # fmt: skip
        else:
            s = dataclasses.replace(s, reference=_on(s.reference, reference), candidate=_on(s.candidate, candidate))
        out.append(s)
    return out


def code_axes(s: Scenario) -> dict[str, str]:
    """Role -> spec of every side that does not run the installed megatron-core."""
    return {role: side.megatron_core for role, side in s.sides.items() if side.megatron_core != "installed"}

