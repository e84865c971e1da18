"""Expectations whose divergence a commit changed (``diverges_after_fix``) or introduced
(``introduced_in``): judged per tree, so one scenario tells the truth on the wheel and on main."""

import pytest

from harness.common.errors import BadInput
from harness.compare.outcome import judge_known_divergence
from harness.compare.summary import ScenarioSummary, Verdict
from harness.scenario import KnownDivergence
from harness.scenario.matrix import read_toml
from harness.scenario.parse import parse_scenario
from harness.scenario.rules import validate
from helpers import ASSETS


def _summary(verdict, signature=None):
    from harness.compare.summary import FirstDivergence

    fd = None if signature is None else FirstDivergence(step=1, phase="backward", kind="main_grad",
                                                        tensor="w",
                                                        ranks=[0], signature=signature)
    return ScenarioSummary.of(scenario="s", verdict=verdict, first_divergence=fd, checked={"param": 1})


def test_a_fix_that_changed_the_divergence_expects_the_new_signature():
    exp = KnownDivergence(reason="r", signature="pad-rows", step=1, fixed_in="abf04f46e3",
                          diverges_after_fix="ratio-1/2")
    assert judge_known_divergence(_summary(Verdict.FAIL, "pad-rows"), exp,
                                  fixed=False).verdict == Verdict.KNOWN_DIVERGENCE
    assert judge_known_divergence(_summary(Verdict.FAIL, "ratio-1/2"), exp,
                                  fixed=True).verdict == Verdict.KNOWN_DIVERGENCE
    assert judge_known_divergence(_summary(Verdict.FAIL, "pad-rows"), exp, fixed=True).verdict == Verdict.FAIL
    assert judge_known_divergence(_summary(Verdict.PASS), exp, fixed=True).verdict == Verdict.FAIL


def test_a_divergence_introduced_by_a_commit_expects_parity_before_it():
    exp = KnownDivergence(reason="r", signature="ratio-G", step=1, introduced_in="abf04f46e3")
    before = judge_known_divergence(_summary(Verdict.PASS), exp, introduced=False)
    assert before.verdict == Verdict.PASS and "does not hold" in before.expectation
    assert judge_known_divergence(_summary(Verdict.FAIL, "ratio-G"), exp,
                                  introduced=False).verdict == Verdict.FAIL
    assert judge_known_divergence(_summary(Verdict.FAIL, "ratio-G"), exp,
                                  introduced=True).verdict == Verdict.KNOWN_DIVERGENCE


@pytest.mark.parametrize("expect, where", [
    ({"reason": "r", "introduced_in": "main"}, "introduced_in"),
    ({"reason": "r", "diverges_after_fix": "ratio-1/2"}, "diverges_after_fix"),
])
def test_bad_keys_are_refused(expect, where):
    with pytest.raises(BadInput, match=where):
        validate(parse_scenario({**read_toml(ASSETS / "tiny.toml"), "expect": expect}, "x.toml"))
