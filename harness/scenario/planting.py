"""Plant faults into scenarios: one rule for ``gtp-parity run --inject`` and the pytest plugin."""

from __future__ import annotations

import dataclasses

from harness.common.errors import BadInput
from harness.scenario.faults import check_name
from harness.scenario.rules import validate

SIDES = ("reference", "candidate")


def plant(scenarios: list, names, side: str = "candidate", *, where: str = "inject",
          side_where: str = "inject_side") -> list:
    """``scenarios`` with the faults ``names`` planted on ``side`` of each (none: unchanged).

    ``where`` and ``side_where`` name the option a bad fault or side came from.
    """
    if not names:
        return scenarios
    if side not in SIDES:
        raise BadInput(side_where, f"{side!r}: reference or candidate")
    for name in names:
        if (problem := check_name(name)) is not None:
            raise BadInput(where, problem)
    planted = [dataclasses.replace(s, **{side: dataclasses.replace(s.sides[side], inject=tuple(names))})
               for s in scenarios]
    for s in planted:  # the scenario's own rules decide whether each fault can fire on that side
        try:
            validate(s, limits=False)
        except BadInput as e:
            raise BadInput(f"{where} (on {s.source})", str(e).removeprefix(f"{s.source}: ")) from None
    return planted
