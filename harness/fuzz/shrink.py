"""Shrinking: a failing draw reduced to a minimal one that fails the same way.

First delta debugging (Zeller's ddmin) over the draw's settings, each set back to its default:
the subsets and complements of one round run as one batch (sides of one world size share
launches), and the smallest that still fails with the same fingerprint is kept. Then the axis:
a pair whose candidate takes the reference's value runs one side, whose own invariants (its
replicas) still judge it, so a bug of one side's configuration is found without the axis. Then the sizes:
fewer steps (down to the first divergence's step), the space's smallest value of each size it
lists (layers, widths, batch), the smallest world, each tried alone and then together; where they
shrank, each setting left is tried without once more. Draws the rules refuse are never launched. A
deadline bounds the whole; a shrink cut short says so.

A gather buffer's race (a GEMM that read a foreign weight, bits with no pattern) shows only on
some runs under megatron-core's async collectives, and ddmin would keep whatever settings happened
to let it show. So such a finding is first run with eager collectives (each all-gather complete
when issued, as on a GPU whose communication stream runs ahead): where it fails the same way
there, that deterministic draw is shrunk, the eager setting kept throughout (:attr:`Shrunk.eager`;
a race drawn with eager collectives keeps them too).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

from harness.compare.summary import FirstDivergence
from harness.fuzz.cluster import EAGER, fingerprint
from harness.fuzz.space import Axis, Draw, Space

# judge(draws) -> each draw's first divergence (None: it passed, or the rules refused it)
Judge = Callable[[list[Draw]], list[FirstDivergence | None]]
RACES = ("gemm-consumed-foreign-weight", "not-bitwise")
SIZE_KEYS = (("model", "num_layers"), ("model", "hidden_size"), ("model", "ffn_hidden_size"),
             ("model", "num_attention_heads"), ("model", "seq_length"), ("data", "global_batch_size"),
             ("data", "micro_batch_size"))


@dataclass
class Shrunk:
    draw: Draw
    first: FirstDivergence | None
    runs: int
    seconds: float
    complete: bool
    """False where the deadline cut it short (the draw still fails the same way, but may not be minimal)."""
    eager: bool = False
    """Shrunk with eager collectives (a race made deterministic): ``draw`` sets them, and they are
    how it fails, not what the bug needs."""

    def to_json(self) -> dict:
        return {"runs": self.runs, "seconds": round(self.seconds, 1), "complete": self.complete,
                **({"eager": True} if self.eager else {})}


def _split(items: list, n: int) -> list[list]:
    n = min(n, len(items))
    size, extra = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out


def shrink(draw: Draw, first: FirstDivergence, space: Space, judge: Judge, deadline: float) -> Shrunk:
    """The smallest draw found, before ``deadline`` (``time.monotonic()``), that fails as ``draw``
    does (the same :func:`fingerprint`)."""
    start, target = time.monotonic(), fingerprint(first)
    runs, pinned = 0, ()

    def fails(draws: list[Draw]) -> list[FirstDivergence | None]:
        nonlocal runs
        runs += len(draws)
        return [fd if fd is not None and fingerprint(fd) == target else None for fd in judge(draws)]

    def with_(settings) -> Draw:
        return dataclasses.replace(draw, settings=tuple(sorted((*settings, *pinned))))

    collectives = {s for s in draw.settings if s[:2] == EAGER[:2]}
    if first.signature in RACES and collectives == {EAGER}:
        pinned = (EAGER,)  # drawn eager: deterministic already, and no subset goes back to async
    elif first.signature in RACES and not collectives:
        eager = with_((*draw.settings, EAGER))
        runs += 1
        # the same signature: eager collectives may show the race at another tensor kind or step
        if (fd := judge([eager])[0]) is not None and fd.signature == first.signature:
            draw, first, target, pinned = eager, fd, fingerprint(fd), (EAGER,)
    deltas, n, best = [s for s in draw.settings if s not in pinned], 2, first
    tried_empty = False
    while deltas and time.monotonic() < deadline:
        chunks = _split(deltas, n)
        complements = [[d for d in deltas if d not in c] for c in chunks] if len(chunks) > 2 else []
        subsets = [c for c in ([] if tried_empty else [[]]) + chunks + complements if len(c) < len(deltas)]
        tried_empty = True
        results = fails([with_(s) for s in subsets])
        hit = next(((s, fd) for s, fd in zip(subsets, results) if fd is not None), None)
        if hit is not None:
            n = max(n - 1, 2) if hit[0] in complements else 2
            deltas, best = hit
            continue
        if n >= len(deltas) or not subsets:
            break
        n = min(2 * n, len(deltas))
    current = with_(deltas)
    complete = not deltas or time.monotonic() < deadline
    if time.monotonic() < deadline:  # a bug of one side's own (its replicas drift) needs no axis
        same = dataclasses.replace(current,
                                   axis=Axis(draw.axis.key, draw.axis.reference, draw.axis.reference))
        if (fd := fails([same])[0]) is not None:
            current, best = same, fd
    if time.monotonic() < deadline:
        smaller, best, done = _sizes(current, best, space, fails)
        complete = complete and done
        if smaller != current:  # a setting needed at the drawn sizes may not be at the smallest
            current, best = _drop_settings(smaller, best, pinned, fails, deadline)
    return Shrunk(draw=current, first=best, runs=runs, seconds=time.monotonic() - start, complete=complete,
                  eager=bool(pinned))


def _drop_settings(draw: Draw, first: FirstDivergence, pinned, fails, deadline: float):
    """Each setting left out alone (one batch), the first that still fails kept, until none does:
    e.g. a larger batch needed at world 4 (one micro-batch a rank otherwise), not at world 2."""
    while time.monotonic() < deadline:
        trials = [dataclasses.replace(draw, settings=tuple(x for x in draw.settings if x != s))
                  for s in draw.settings if s not in pinned]
        if not trials:
            break
        hit = next(((t, fd) for t, fd in zip(trials, fails(trials)) if fd is not None), None)
        if hit is None:
            break
        draw, first = hit
    return draw, first


def _size_cuts(draw: Draw, first: FirstDivergence, space: Space) -> list[Draw]:
    """The draw with one size made smaller, each way this space allows."""
    set_keys = {(s, k) for s, k, _ in draw.settings}
    base = {(s, k): v for s, k, v in draw.reductions}
    for section, table in space.fixed.items():
        for key, value in table.items():
            base.setdefault((section, key), value)
    cuts = []
    steps = base.get(("train", "steps"), 3)
    if first.step and first.step < steps and ("train", "steps") not in set_keys:
        cuts.append(("train", "steps", max(first.step, 1)))
    for sk in SIZE_KEYS:
        listed = space.values.get(sk)
        if not listed or sk in set_keys:
            continue
        smallest = min(v for v in listed if v is not None)
        if smallest < base.get(sk, listed[0]):
            cuts.append((*sk, smallest))
    out = [_reduced(draw, [c]) for c in cuts]
    if (world := min(space.world_sizes)) < draw.world_size:
        out.append(dataclasses.replace(draw, world_size=world))
    return out


def _reduced(draw: Draw, cuts, world: int | None = None) -> Draw:
    """``draw`` with the size cuts ``(section, key, value)`` added to its reductions."""
    merged = {(s, k): v for s, k, v in (*draw.reductions, *cuts)}
    return dataclasses.replace(draw, reductions=tuple((s, k, v) for (s, k), v in sorted(merged.items())),
                               world_size=world or draw.world_size)


def _sizes(draw: Draw, first: FirstDivergence, space: Space, fails) -> tuple[Draw, FirstDivergence, bool]:
    """Each size cut alone, then the ones that still fail together (one batch each)."""
    cuts = _size_cuts(draw, first, space)
    if not cuts:
        return draw, first, True
    kept = [(d, fd) for d, fd in zip(cuts, fails(cuts)) if fd is not None]
    if not kept:
        return draw, first, True
    if len(kept) == 1:
        return kept[0][0], kept[0][1], True
    together = _reduced(draw, [r for d, _ in kept for r in d.reductions], min(d.world_size for d, _ in kept))
    fd = fails([together])[0]
    return (together, fd, True) if fd is not None else (kept[0][0], kept[0][1], True)
