"""A scenario's ``summary.json`` as data: the contract between compare and report.

Compare writes it (:func:`harness.compare.localize.summarize` makes the verdict and the first
divergence, :mod:`harness.compare.outcome` adds the scenario's context and judges its
expectation, :mod:`harness.session` summarizes runs that failed or were skipped); the reports,
JUnit and the pytest plugin read it back through the same classes. A change of verdict (a known
divergence, a checkpoint's load phase) makes a new summary; none is edited in place.

What a summary holds depends on what happened (a skipped scenario has a reason and nothing
compared; a region holds the coordinates its signature sets), so :class:`ScenarioSummary`
and :class:`Region` remember which fields were given and write exactly those: a field that
was not given reads as its default and is not written.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from enum import StrEnum


class Verdict(StrEnum):
    """A scenario's verdict. A str: summaries on disk read ``"pass"``, ``"fail"``, ..."""

    PASS = "pass"
    FAIL = "fail"
    KNOWN_DIVERGENCE = "known-divergence"
    """Failed exactly as the scenario's ``[expect]`` records (an upstream divergence)."""
    ERROR = "error"
    """A run failed: nothing was compared."""
    SKIP = "skip"
    """This machine cannot run it (the reason says why)."""
    FIXED = "fixed"
    """A known divergence that holds parity on a tree with the upstream fix (``[expect] fixed_in``)."""

    @property
    def passes_gate(self) -> bool:
        """Whether a gate lets it through: parity, a known divergence that diverged as recorded,
        or one whose fix the tree holds and that holds parity there."""
        return self in (Verdict.PASS, Verdict.KNOWN_DIVERGENCE, Verdict.FIXED)


def overall(verdicts) -> Verdict:
    """A run's verdict over its scenarios: an error or a failure wins; all skipped is a skip."""
    seen = set(verdicts)
    if Verdict.ERROR in seen or Verdict.FAIL in seen:
        return Verdict.ERROR if Verdict.ERROR in seen else Verdict.FAIL
    return Verdict.PASS if any(v.passes_gate for v in map(Verdict, seen)) else Verdict.SKIP


def _known(cls, doc: dict) -> dict:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in doc.items() if k in names and v is not None}


class _Given:
    """Write exactly the fields given at construction (``given``), in any later copy too."""

    @classmethod
    def of(cls, **given):
        return cls(**given, given=tuple(given))

    def with_(self, **changes):
        """A copy with ``changes`` applied and given."""
        given = self.given + tuple(k for k in changes if k not in self.given)
        return dataclasses.replace(self, **changes, given=given)

    def _json_of(self, name: str):
        value = getattr(self, name)
        return value.to_json() if hasattr(value, "to_json") else value


@dataclass(frozen=True)
class Region(_Given):
    """Where in the logical tensor the first divergence sits (the keys its signature sets)."""

    worst_index: list[int] | None = field(default_factory=list)
    shard: dict[str, int] | None = field(default_factory=dict)
    """The (tp, gtp) shard holding the worst element."""
    ranks: list[int] | None = field(default_factory=list)
    gtp_block_rows: list[int] | None = field(default_factory=list)
    """[first, end) rows of the GTP block."""
    tp_block: list | None = field(default_factory=list)
    """[first, end, "dim D"] of the TP block."""
    duplicated: list[int] | None = field(default_factory=list)
    """Sample ids read twice (misrouted samples)."""
    missing: list[int] | None = field(default_factory=list)
    """Sample ids never read."""
    rows: list[int] | None = None
    """[first, end) pad rows holding values (pad-rows)."""
    rank: int | None = None
    sample_id: int | None = None
    given: tuple[str, ...] = field(default=(), repr=False, compare=False)

    @classmethod
    def from_json(cls, doc: dict | None) -> Region:
        known = _known(cls, doc or {})
        return cls(**known, given=tuple(known))

    def to_json(self) -> dict:
        return {k: self._json_of(k) for k in self.given}


# The keys every first divergence writes, in the dataclass below; signature-specific ones
# (permutation, norm_ratio, tolerance, consumed, ...) travel in ``extra``.
_FIRST_DIVERGENCE_KEYS = ("step", "phase", "kind", "tensor", "ranks", "region", "signature", "explanation",
                          "metrics")


@dataclass(frozen=True)
class FirstDivergence:
    step: int | None = None
    phase: str | None = None
    kind: str | None = None
    tensor: str | None = None
    ranks: list[int] | None = None
    region: Region = field(default_factory=Region)
    signature: str | None = None
    explanation: str = ""
    measured: dict[str, float | None] = field(default_factory=dict)
    """max_abs, max_rel, bound, ...: the ones measured for this tensor (None: not a number)."""
    extra: dict = field(default_factory=dict)
    """What the signature adds: permutation (permuted-blocks), norm_ratio (grad-norm-only),
    tolerance (precision-loss), consumed (gemm-consumed-foreign-weight), ..."""

    @property
    def metrics(self) -> dict[str, float]:
        return {k: v for k, v in self.measured.items() if v is not None}

    @property
    def permutation(self) -> dict | None:
        """permuted-blocks: blocks, permutation, pad_rows."""
        return self.extra.get("permutation")

    @property
    def norm_ratio(self) -> float | None:
        """grad-norm-only: candidate / reference grad norm."""
        return self.extra.get("norm_ratio")

    @property
    def tolerance(self) -> dict | None:
        """precision-loss: the rtol, atol and recipe the tensor is within."""
        return self.extra.get("tolerance")

    def with_(self, **changes) -> FirstDivergence:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_json(cls, doc: dict) -> FirstDivergence:
        known = {k: doc[k] for k in _FIRST_DIVERGENCE_KEYS if doc.get(k) is not None
                 and k not in ("region", "metrics")}
        return cls(**known, region=Region.from_json(doc.get("region")),
                   measured=dict(doc.get("metrics") or {}),
                   extra={k: v for k, v in doc.items() if k not in _FIRST_DIVERGENCE_KEYS})

    def to_json(self) -> dict:
        return {"step": self.step, "phase": self.phase, "kind": self.kind, "tensor": self.tensor,
                "ranks": self.ranks, "region": self.region.to_json(), "signature": self.signature,
                "explanation": self.explanation, "metrics": self.measured, **self.extra}


@dataclass(frozen=True)
class ScenarioSummary(_Given):
    scenario: str = "?"
    verdict: Verdict = Verdict.ERROR
    first_divergence: FirstDivergence | None = None
    checked: dict[str, int] = field(default_factory=dict)
    """Comparisons per kind."""
    expectations: dict[str, int] = field(default_factory=dict)
    """Comparisons per expectation: bitwise, bounded, noise-floor (harness.compare.expectations)."""
    failing: int | None = None
    policy: dict = field(default_factory=dict)
    invariants: dict[str, list] = field(default_factory=dict)
    error: dict[str, str] = field(default_factory=dict)
    """Role -> why its run failed."""
    reason: str | None = None
    """Why a skipped scenario was skipped."""
    axes: dict[str, str] = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    traces: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    """The sides made by other code than the reference (provenance)."""
    expect: dict | None = None
    """The scenario's known divergence (reason, signature, step), if it records one."""
    expectation: str | None = None
    """Why a scenario with a known divergence failed anyway."""
    checkpoint: dict | None = None
    """A checkpoint scenario's save and load: steps, topologies, whether the load was bitwise."""
    given: tuple[str, ...] = field(default=(), repr=False, compare=False)

    @classmethod
    def from_json(cls, doc: dict) -> ScenarioSummary:
        known = _known(cls, doc)
        if doc.get("first_divergence"):
            known["first_divergence"] = FirstDivergence.from_json(doc["first_divergence"])
        else:
            known.pop("first_divergence", None)
        if "verdict" in known:
            known["verdict"] = Verdict(known["verdict"])
        return cls(**known, given=tuple(k for k in doc if k in known or k == "first_divergence"))

    def to_json(self) -> dict:
        return {k: self._json_of(k) for k in self.given}

    @property
    def total_checked(self) -> int:
        return sum(self.checked.values())


@dataclass(frozen=True)
class ResultRow:
    """The columns of a ``results.csv`` row the report computes with (the table shows them all)."""

    step: int
    kind: str
    tensor: str
    passed: bool | None = None
    policy: str | None = None
    expectation: str | None = None
    bitwise_equal: bool | None = None
    dtype: str | None = None
    rel_l2: float | None = None
    ref_err_golden: float | None = None
    cand_err_golden: float | None = None

    @classmethod
    def from_json(cls, row: dict) -> ResultRow:
        return cls(**_known(cls, row))


def as_summary(summary: ScenarioSummary | dict) -> ScenarioSummary:
    return summary if isinstance(summary, ScenarioSummary) else ScenarioSummary.from_json(summary)
