"""Stage 5, compare: traces -> logical tensors (:mod:`.assemble`) -> tasks over (step, kind,
name) (:mod:`.tasks`, split over processes or ranks by :mod:`.split`) -> metrics
(:mod:`.metrics`) -> judgement under a policy (:mod:`.judge`, :mod:`.tolerance`,
:mod:`.bounds`, :mod:`.updates`) -> the first divergence and its signature (:mod:`.localize`,
:mod:`.signatures`) -> a :class:`ScenarioSummary` per scenario (:mod:`.outcome`).

The summary types are the contract with the report; this package's ``__init__`` exports only
them, so reading a summary costs no torch import."""

from harness.compare.summary import FirstDivergence, Region, ScenarioSummary, Verdict

__all__ = ["FirstDivergence", "Region", "ScenarioSummary", "Verdict"]
