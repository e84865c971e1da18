"""JUnit XML of a run: parsed back with xml.etree."""

from __future__ import annotations

import importlib.util
import xml.etree.ElementTree as ET
from pathlib import Path

from harness.report import divergence_line, write_junit

_spec = importlib.util.spec_from_file_location(
    "report_synthetic", Path(__file__).parent / "assets" / "report" / "synthetic.py"
)
synthetic = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(synthetic)


def test_one_testcase_per_scenario(tmp_path):
    specs = [{"name": "ok", "verdict": "pass", "axes": {"precision": "fp32"}},
             {"name": "bad", "verdict": "fail", "axes": {"precision": "bf16"}, "tensor": "w<&>\x01"},
             {"name": "crash", "verdict": "error"}]
    run = synthetic.write_run(tmp_path / "run", specs)
    path = write_junit(run, tmp_path / "out" / "junit.xml")
    root = ET.parse(path).getroot()
    assert root.tag == "testsuites" and (root.get("tests"), root.get("failures"), root.get("errors")) == (
        "3",
        "1",
        "1",
    )
    suite = root.find("testsuite")
    cases = {c.get("name"): c for c in suite.findall("testcase")}
    assert list(cases) == ["ok", "bad", "crash"]
    assert all(c.get("classname") == "gtp_parity.synthetic" for c in cases.values())

    ok = cases["ok"]
    assert ok.find("failure") is None and ok.find("error") is None
    assert [(p.get("name"), p.get("value")) for p in ok.find("properties")] == [("precision", "fp32")]

    failure = cases["bad"].find("failure")
    message = failure.get("message")
    assert "\n" not in message and failure.get("type") == "ratio-G"
    assert message.startswith("bad: first divergence at step 1 backward main_grad w<&>? on ranks [0]")
    assert "max_rel: 1" in failure.text and "failing comparisons: 4" in failure.text

    error = cases["crash"].find("error")
    assert cases["crash"].find("failure") is None
    assert error.get("message").startswith(
        "crash: run failed: candidate: rank 1 exited with code 1 at step 2"
    )
    assert "candidate:\nrank 1 exited" in error.text


def test_message_matches_the_shared_one_line_text(tmp_path):
    run = synthetic.write_run(tmp_path / "run", [{"name": "bad", "verdict": "fail"}])
    root = ET.parse(write_junit(run, tmp_path / "j.xml")).getroot()
    summary = synthetic.scenario_summary(run, "bad", "fail", {})
    assert root.find("testsuite/testcase/failure").get("message") == divergence_line(summary)


def test_a_fixed_divergence_is_a_passing_testcase(tmp_path):
    """``fixed`` (a known divergence whose upstream fix the tree holds, holding parity) passes:
    neither a failure nor an error, nor skipped as a known divergence is."""
    from harness.report.junit import junit_tree
    from harness.report.model import expectation_failures

    doc = {"scenarios": [{"scenario": "s", "verdict": "fixed",
                          "expectation": "fixed in c2fd8275d9: parity holds"},
                         {"scenario": "k", "verdict": "known-divergence"}]}
    suite = junit_tree(doc).getroot().find("testsuite")
    fixed, known = suite.findall("testcase")
    assert not list(fixed) and known.find("skipped") is not None
    assert suite.get("skipped") == "1" and suite.get("errors") == "0" and suite.get("failures") == "0"
    assert expectation_failures({"scenarios": doc["scenarios"][:1]}) == []
