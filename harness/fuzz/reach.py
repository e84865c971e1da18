"""Aiming a self-test campaign's draws at its planted faults.

A planted fault acts only where its reach holds (the rules refuse a candidate it cannot fire on),
and some faults need keys off their defaults: the distributed optimizer in bf16, per-token loss
told to GTP, a checkpoint loaded. A draw sets a few of some 44 keys at random, so a fault that needs
two of them is almost never drawn (0 of 2,000 random draws of the default space held both
for ``distopt-offsets-ignore-gtp-pad``). Before drawing, a campaign with planted faults that no
draw reaches on its defaults looks for the fewest shared settings (one, then two) that, with an
axis, let every fault fire on the candidate, asking the reach functions the rules ask
(:func:`harness.scenario.faults.fault_reach`) of sides built from the settings alone (no scenario
parsed: microseconds each). Each draw then starts from one of those *seeds* and adds random keys
as any draw does; the rules still judge the whole draw, and shrinking keeps what the fault needs.
A fault of a checkpoint's save also asks :func:`harness.scenario.checkpoint.save_fault_reach` of
the reference, which saves.
"""

from __future__ import annotations

import itertools
from typing import Any

from harness.fuzz.space import CHECKPOINT, CLASSES, Axis, Space, shown_value
from harness.scenario.checkpoint import SAVE_FAULTS, save_fault_reach
from harness.scenario.faults import fault_reach

Seed = tuple[tuple[tuple[str, str, Any], ...], Axis]
"""Shared settings (section, key, value), sorted, and the axis a draw starting from them takes."""


def reach_seeds(space: Space, faults: tuple[str, ...], most: int = 2) -> list[Seed]:
    """The seeds of the fewest settings (at most ``most``) under which every fault in ``faults``
    can fire on the candidate; [] where a draw on its defaults reaches them already (or nothing of
    ``most`` settings does: the rules then refuse draws as they would anyway)."""
    if not faults or any(_fires(space, faults, (), a) for a in space.axes):
        return []
    options = [(s, k, v) for (s, k), vals in sorted(space.values.items(), key=str) for v in vals[1:]]
    for size in range(1, most + 1):
        seeds = [(combo, axis) for combo in itertools.combinations(options, size)
                 if len(keys := {(s, k) for s, k, _ in combo}) == size
                 for axis in space.axes
                 if ("train", axis.key) not in keys and _fires(space, faults, combo, axis)]
        if seeds:
            return seeds
    return []


def _fires(space: Space, faults: tuple[str, ...], combo, axis: Axis) -> bool:
    """Can every fault fire on the candidate of a draw of ``combo`` and ``axis``, at some world?"""
    tables = {s: dict(space.fixed.get(s, {})) for s in CLASSES}
    for s, k, v in combo:
        if (s, k) == CHECKPOINT:  # the candidate loads what the reference saved at that step
            tables["train"]["load_step"] = v
        else:
            tables[s][k] = v
    save_faults = SAVE_FAULTS & set(faults)
    if save_faults and "load_step" not in tables["train"]:  # nothing is saved: no save fault fires
        return False
    tables["train"].update({axis.key: axis.candidate, "backend": space.backend})
    saver = {**tables["train"], axis.key: axis.reference, "load_step": 0}  # the reference saves
    try:  # the same for every world
        data, model = CLASSES["data"](**tables["data"]), CLASSES["model"](**tables["model"])
    except (TypeError, ValueError):  # a combination the classes refuse: the rules say why
        return False
    for world in space.world_sizes:
        try:
            side = CLASSES["train"](**tables["train"], world_size=world)
            src = CLASSES["train"](**saver, world_size=world) if save_faults else None
            if all(fault_reach(f, side, data, model) is None for f in faults) and all(
                    save_fault_reach(f, src) is None for f in save_faults):
                return True
        except (TypeError, ValueError, ArithmeticError):  # a world the combination does not fit:
            continue  # the rules say why where a draw holds it
    return False


def seed_label(seed: Seed) -> str:
    """``train.precision=bf16, axis:gtp=1->2``: as a draw's settings and axis are shown."""
    settings, axis = seed
    return ", ".join([*(f"{s}.{k}={shown_value(v)}" for s, k, v in settings), f"axis:{axis.label}"])
