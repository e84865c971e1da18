"""Run every clause for one implementer under an initialized process group, on all ranks.

:func:`run_conformance` is called by every rank with the same arguments. For each topology it
creates the TP and GTP groups (rank order ``tp`` fastest, then ``gtp``, then replicate), and
for each case drives the protocol twice (overlap on and off), judges every clause on this
rank's traces, and finally all-gathers every rank's records so that every rank returns the same
:class:`ConformanceResult`. A failure on any rank therefore fails on all of them.
"""

from __future__ import annotations

import importlib
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch.distributed as dist

from harness.conformance import layout, te_contract
from harness.conformance.registry import CLAUSES, PAIR_CLAUSES, TRACE_CLAUSES
from harness.conformance.failures import Failure, NotApplicable, failure_lines
from harness.conformance.drive import Case, Unsupported, default_cases, drive
from harness.conformance.protocol import Dispatch, select_dispatch
from harness.common.mesh import Mesh

STATUS_ORDER = ("pass", "skip", "fail", "error")
"""Merging ranks keeps the most severe status, in this order."""


class BadSpec(ValueError):
    """A ``module:factory`` spec that cannot be imported or is not callable."""


def load_factory(spec: str) -> Callable[..., list]:
    """Import ``module:factory`` and return the factory; raises :class:`BadSpec` with the cause."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise BadSpec(f"{spec!r} is not of the form module:factory")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise BadSpec(
            f"cannot import module {module_name!r} of {spec!r}: {type(exc).__name__}: {exc}"
        ) from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise BadSpec(f"module {module_name!r} has no callable {attr!r} (from {spec!r})")
    return factory


@dataclass(frozen=True, slots=True)
class Topology:
    """A ``TP x G`` layout; the replicate size follows from the world size."""

    tp: int
    gtp: int

    @classmethod
    def parse(cls, text: str) -> "Topology":
        """Parse ``"TxG"`` such as ``"2x2"``."""
        try:
            tp, gtp = (int(part) for part in text.lower().split("x"))
        except ValueError:
            raise ValueError(f"topology {text!r} is not of the form TxG, e.g. 1x2") from None
        return cls(tp, gtp)

    def check(self, world: int) -> None:
        """Raise ValueError unless this topology fits ``world`` ranks with G >= 2."""
        if self.tp < 1 or self.gtp < 2:
            raise ValueError(f"topology {self}: need TP >= 1 and G >= 2")
        if world % (self.tp * self.gtp):
            raise ValueError(
                f"topology {self}: TP*G={self.tp * self.gtp} does not divide {world} ranks"
            )

    def __str__(self) -> str:
        return f"{self.tp}x{self.gtp}"


def default_topologies(world: int) -> list[Topology]:
    """TP in {1, 2} and G in {2, 4}, wherever ``TP * G`` divides the world size."""
    return [Topology(t, g) for t in (1, 2) for g in (2, 4) if world % (t * g) == 0]


@dataclass(frozen=True, slots=True)
class ClauseRecord:
    """The verdict of one clause for one case and mode, merged over ranks."""

    clause: str
    case: str
    mode: str
    status: str
    """One of "pass", "fail", "skip" (not applicable) or "error" (the drive raised)."""
    reason: str = ""
    failures: tuple[Failure, ...] = ()

    def to_json(self) -> dict:
        """A JSON-ready dict."""
        return {
            "clause": self.clause,
            "case": self.case,
            "mode": self.mode,
            "status": self.status,
            "reason": self.reason,
            "failures": [f.to_json() for f in self.failures],
        }

    @classmethod
    def from_json(cls, data: dict) -> "ClauseRecord":
        """Inverse of :meth:`to_json`."""
        failures = []
        for f in data["failures"]:
            index = tuple(f["worst_index"]) if f.get("worst_index") is not None else None
            failures.append(Failure(**{**f, "worst_index": index}))
        return cls(
            data["clause"],
            data["case"],
            data["mode"],
            data["status"],
            data["reason"],
            tuple(failures),
        )


@dataclass
class ConformanceResult:
    """All clause records for one implementer."""

    impl: str
    dispatch: str
    world_size: int
    topologies: list[str]
    records: list[ClauseRecord] = field(default_factory=list)
    dispatch_source: str = ""
    """What was driven: ``TE 2.20.2 distributed_weight.py <sha256>``, or the kit's mirror."""
    dispatch_note: str = ""
    """Why the mirror stood in for TE's file; empty when TE's file was driven."""

    @property
    def passed(self) -> bool:
        """No record failed or errored (skips are allowed)."""
        return all(r.status in ("pass", "skip") for r in self.records)

    def clause_status(self, clause: str) -> str:
        """The most severe status of ``clause`` over all cases and modes ("skip" if absent)."""
        statuses = [r.status for r in self.records if r.clause == clause] or ["skip"]
        if all(s == "skip" for s in statuses):
            return "skip"
        return max((s for s in statuses if s != "skip"), key=STATUS_ORDER.index)

    def failures(self, clause: str | None = None) -> list[Failure]:
        """Every failure record, optionally of one clause."""
        return [f for r in self.records if clause in (None, r.clause) for f in r.failures]

    def to_json(self) -> dict:
        """A JSON-ready dict; ``records`` is the list of clause records."""
        return {
            "impl": self.impl,
            "dispatch": self.dispatch,
            "dispatch_source": self.dispatch_source,
            "dispatch_note": self.dispatch_note,
            "world_size": self.world_size,
            "topologies": self.topologies,
            "passed": self.passed,
            "records": [r.to_json() for r in self.records],
        }

    @classmethod
    def from_json(cls, data: dict) -> "ConformanceResult":
        """Inverse of :meth:`to_json`."""
        records = [ClauseRecord.from_json(r) for r in data["records"]]
        return cls(
            data["impl"],
            data["dispatch"],
            data["world_size"],
            data["topologies"],
            records,
            data.get("dispatch_source", ""),
            data.get("dispatch_note", ""),
        )


def build_groups(topology: Topology, world: int, rank: int):
    """Create every TP and GTP group of ``topology`` (all ranks, same order); return this rank's."""
    mesh = Mesh.of_world(world, topology.tp, topology.gtp)
    mine = {}
    for axis in ("tp", "gtp"):
        for ranks in mesh.groups(axis):
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[axis] = group
    return mine["tp"], mine["gtp"]


def _local_records(case: Case, traces: dict, problems: dict) -> list[ClauseRecord]:
    """This rank's verdicts for one case: judged traces, or the problem that stopped a mode."""
    records = []
    for mode in ("overlap", "serial"):
        for clause, check in TRACE_CLAUSES.items():
            if mode in problems:
                status, reason = problems[mode]
                records.append(ClauseRecord(clause, case.name, mode, status, reason))
            else:
                try:
                    failures = tuple(check(traces[mode]))
                except NotApplicable as exc:
                    records.append(ClauseRecord(clause, case.name, mode, "skip", str(exc)))
                    continue
                records.append(
                    ClauseRecord(
                        clause, case.name, mode, "fail" if failures else "pass", failures=failures
                    )
                )
    for clause, check in PAIR_CLAUSES.items():
        if problems:
            status, reason = max(problems.values(), key=lambda p: STATUS_ORDER.index(p[0]))
            records.append(ClauseRecord(clause, case.name, "overlap-vs-serial", status, reason))
        else:
            failures = tuple(check(traces["overlap"], traces["serial"]))
            status = "fail" if failures else "pass"
            records.append(
                ClauseRecord(clause, case.name, "overlap-vs-serial", status, failures=failures)
            )
    return records


def _merge(per_rank: list[list[ClauseRecord]]) -> list[ClauseRecord]:
    merged: dict[tuple, ClauseRecord] = {}
    for records in per_rank:
        for r in records:
            key = (r.clause, r.case, r.mode)
            old = merged.get(key)
            if old is None:
                merged[key] = r
                continue
            status = max(old.status, r.status, key=STATUS_ORDER.index)
            reasons = [x for x in (old.reason, r.reason) if x]
            reason = "; ".join(dict.fromkeys(reasons))
            merged[key] = ClauseRecord(
                r.clause, r.case, r.mode, status, reason, old.failures + r.failures
            )
    return list(merged.values())


def run_conformance(
    factory: Callable[..., list],
    *,
    impl: str,
    topologies: list[Topology],
    dispatch: Dispatch | None = None,
    cases: Callable[[int, int], list[Case]] | None = None,
    seed: int = 1234,
) -> ConformanceResult:
    """Drive and judge every case of every topology; every rank must call this and gets the result.

    ``cases(tp, gtp)`` picks the case matrix: by default the factory's own ``cases`` attribute
    if it has one, else :func:`~harness.conformance.drive.default_cases`. ``dispatch`` defaults
    to :func:`~harness.conformance.protocol.select_dispatch` ("auto": TE's file when cached).
    """
    dispatch = dispatch or select_dispatch("auto")
    cases = cases or getattr(factory, "cases", default_cases)
    world, rank = dist.get_world_size(), dist.get_rank()
    records: list[ClauseRecord] = []
    for topology in topologies:
        topology.check(world)
        tp_group, gtp_group = build_groups(topology, world, rank)
        mesh = Mesh.of_world(world, topology.tp, topology.gtp)
        coords = layout.Coords(mesh.tp, mesh.gtp, mesh.dp, rank)
        for case in cases(topology.tp, topology.gtp):
            traces, problems = {}, {}
            for overlap in (True, False):
                mode = "overlap" if overlap else "serial"
                try:
                    traces[mode] = drive(
                        factory,
                        case,
                        overlap=overlap,
                        coords=coords,
                        tp_group=tp_group,
                        gtp_group=gtp_group,
                        dispatch=dispatch,
                        seed=seed,
                    )
                except Unsupported as exc:
                    problems[mode] = ("skip", str(exc))
                except Exception as exc:
                    where = traceback.extract_tb(exc.__traceback__)[-1]
                    problems[mode] = (
                        "error",
                        f"rank {rank}: {type(exc).__name__}: {exc} "
                        f"({where.filename}:{where.lineno})",
                    )
            records += _local_records(case, traces, problems)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, records)
    return ConformanceResult(
        impl,
        dispatch.name,
        world,
        [str(t) for t in topologies],
        _merge(gathered),
        dispatch.source,
        dispatch.note,
    )


def format_table(result: ConformanceResult, max_failures: int = 20) -> str:
    """A per-clause table, then the first failures, then a one-line verdict."""
    lines = [
        f"DistributedWeight conformance: {result.impl} (dispatch={result.dispatch}, "
        f"world={result.world_size}, topologies={', '.join(result.topologies)})",
        f"Dispatchers: {result.dispatch_source or result.dispatch}",
    ]
    if result.dispatch_note:
        lines.append(f"  {result.dispatch_note}")
    lines += [
        "",
        f"{'clause':<30} {'status':<6} {'via':<6} {'pass':>5} {'fail':>5} {'skip':>5} {'error':>5}",
    ]
    for clause in CLAUSES:
        statuses = [r.status for r in result.records if r.clause == clause]
        counts = [statuses.count(s) for s in ("pass", "fail", "skip", "error")]
        lines.append(
            f"{clause:<30} {result.clause_status(clause).upper():<6} "
            f"{te_contract.via(clause, result.dispatch):<6} "
            + " ".join(f"{c:>5}" for c in counts)
        )
    notes: dict[tuple[str, str], set[str]] = {}
    for r in result.records:
        if r.reason:
            notes.setdefault((r.status, r.reason), set()).add(r.case)
    if notes:
        lines += ["", "Skipped or errored:"]
        for (status, reason), names in sorted(notes.items()):
            lines.append(f"  {status}: {reason} [{len(names)} case(s), e.g. {min(names)}]")
    failures = result.failures()
    if failures:
        lines += ["", f"Failures ({len(failures)} records):"]
        lines += [f"  {line}" for line in failure_lines(failures, max_failures)]
    lines += ["", *te_contract.report_lines(result.dispatch)]
    verdict = "PASS" if result.passed else "FAIL"
    lines += [
        "",
        f"{verdict}: {len(result.records)} clause checks over "
        f"{len({r.case for r in result.records})} cases",
    ]
    return "\n".join(lines)
