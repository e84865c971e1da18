"""Failure records of the conformance clauses: what was expected, what was found, and where."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from harness.conformance.drive import Observation


@dataclass(frozen=True, slots=True)
class Failure:
    """One violated clause on one rank, as data (JSON via :meth:`to_json`)."""

    clause: str
    case: str
    mode: str
    rank: int
    weight: int | None
    """Flat weight index in forward order (module * group_size + member); None if not per weight."""
    expected: str
    found: str
    worst_abs_diff: float | None = None
    worst_index: tuple[int, ...] | None = None
    mismatched: int | None = None
    total: int | None = None
    bound: float | None = None
    """Allowed |diff| at the worst element; None for bitwise comparisons."""

    def to_json(self) -> dict:
        """A JSON-ready dict."""
        record = asdict(self)
        record["worst_index"] = list(self.worst_index) if self.worst_index is not None else None
        return record

    def describe(self) -> str:
        """One line: where, what was expected, what was found."""
        where = f"rank {self.rank}" + (f", weight {self.weight}" if self.weight is not None else "")
        head = f"[{self.clause}] {self.case} ({self.mode}) {where}"
        return f"{head}: expected {self.expected}; found {self.found}"


def failure_lines(failures: list[Failure], limit: int = 20) -> list[str]:
    """One line per (clause, case, mode, rank, weight), the first occurrence with a repeat count."""
    groups: dict[tuple, list[Failure]] = {}
    for f in failures:
        groups.setdefault((f.clause, f.case, f.mode, f.rank, f.weight), []).append(f)
    lines = []
    for items in list(groups.values())[:limit]:
        more = f" (+{len(items) - 1} more like it)" if len(items) > 1 else ""
        lines.append(items[0].describe() + more)
    if len(groups) > limit:
        lines.append(f"... and {len(groups) - limit} more groups of failure records")
    return lines


def compare_tensors(got, want: torch.Tensor, bound: torch.Tensor | None = None) -> dict | None:
    """None when ``got`` matches ``want``; else the fields of a Failure describing the mismatch.

    Attributes first (type, shape, dtype), then values: bitwise when ``bound`` is None, else
    element-wise ``|got - want| <= bound`` in float64.
    """
    if not isinstance(got, torch.Tensor):
        return {"found": f"a {got} instead of a tensor"}
    if tuple(got.shape) != tuple(want.shape):
        return {"found": f"shape {tuple(got.shape)}, not {tuple(want.shape)}"}
    if bound is None and got.dtype != want.dtype:
        return {"found": f"dtype {got.dtype}, not {want.dtype}"}
    if bound is None and torch.equal(got, want):
        return None
    diff = (got.double() - want.double()).abs().nan_to_num(nan=float("inf"))
    bad = diff > bound if bound is not None else got != want
    if not bool(bad.any()):
        return None
    excess = torch.where(bad, diff, torch.full_like(diff, -1.0))
    flat = int(excess.flatten().argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
    count, total = int(bad.sum()), diff.numel()
    worst = float(diff.flatten()[flat])
    return {
        "found": f"{count} of {total} elements differ ({100.0 * count / total:.1f}%), "
        f"worst |diff| {worst:.3g} at {index}",
        "worst_abs_diff": worst,
        "worst_index": index,
        "mismatched": count,
        "total": total,
        "bound": float(bound.flatten()[flat]) if bound is not None else None,
    }


def failure(clause: str, trace: Observation, weight: int | None, expected: str, **found) -> Failure:
    return Failure(
        clause=clause,
        case=trace.case.name,
        mode=trace.mode,
        rank=trace.coords.rank,
        weight=weight,
        expected=expected,
        **found,
    )


class NotApplicable(Exception):
    """Raised by a clause that does not apply to a case; the record is a skip with this reason."""
