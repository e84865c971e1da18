"""A scenario's ``summary.json`` as data, parsed once where it is read.

The comparison writes it (:func:`harness.localize.summarize`, :mod:`harness.session`); the
reports, JUnit and the pytest plugin read it through these classes instead of probing dicts.
A field missing from the file is its default here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields


def _known(cls, doc: dict) -> dict:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in doc.items() if k in names and v is not None}


@dataclass(frozen=True)
class Region:
    """Where in the logical tensor the first divergence sits (the keys its signature sets)."""

    worst_index: list[int] = field(default_factory=list)
    shard: dict[str, int] = field(default_factory=dict)
    """The (tp, gtp) shard holding the worst element."""
    ranks: list[int] = field(default_factory=list)
    gtp_block_rows: list[int] = field(default_factory=list)
    """[first, end) rows of the GTP block."""
    tp_block: list = field(default_factory=list)
    """[first, end, "dim D"] of the TP block."""
    duplicated: list[int] = field(default_factory=list)
    """Sample ids read twice (misrouted samples)."""
    missing: list[int] = field(default_factory=list)
    """Sample ids never read."""
    rows: list[int] | None = None
    """[first, end) pad rows holding values (pad-rows)."""
    rank: int | None = None
    sample_id: int | None = None

    @classmethod
    def from_json(cls, doc: dict | None) -> Region:
        return cls(**_known(cls, doc or {}))


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
    metrics: dict[str, float] = field(default_factory=dict)
    """max_abs, max_rel, bound, ...: the ones measured for this tensor."""
    permutation: dict | None = None
    """permuted-blocks: blocks, permutation, pad_rows."""
    norm_ratio: float | None = None
    """grad-norm-only: candidate / reference grad norm."""
    tolerance: dict | None = None
    """precision-loss: the rtol, atol and recipe the tensor is within."""

    @classmethod
    def from_json(cls, doc: dict) -> FirstDivergence:
        known = _known(cls, doc)
        known["region"] = Region.from_json(doc.get("region"))
        known["metrics"] = {k: v for k, v in (doc.get("metrics") or {}).items() if v is not None}
        return cls(**known)


@dataclass(frozen=True)
class ScenarioSummary:
    scenario: str = "?"
    verdict: str = "error"
    """pass, fail, known-divergence (failed as ``expect`` records), error (a run failed) or skip."""
    first_divergence: FirstDivergence | None = None
    checked: dict[str, int] = field(default_factory=dict)
    """Comparisons per kind."""
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
    expect: dict | None = None
    """The scenario's known divergence (reason, signature, step), if it records one."""
    expectation: str | None = None
    """Why a scenario with a known divergence failed anyway."""

    @classmethod
    def from_json(cls, doc: dict) -> ScenarioSummary:
        known = _known(cls, doc)
        if doc.get("first_divergence"):
            known["first_divergence"] = FirstDivergence.from_json(doc["first_divergence"])
        else:
            known.pop("first_divergence", None)
        return cls(**known)

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
