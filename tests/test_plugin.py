"""The pytest plugin end to end through pytester: marker, fixture, options, matrix items,
xdist, and pytest itself under torchrun with 2 ranks.

Most runs replace ``harness.session.run_scenarios`` with a fake that writes a synthetic run
folder (tests/assets/report/synthetic.py), so they launch nothing; one test runs a real
scenario through the marker.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ASSETS = Path(__file__).parent / "assets"
SYNTHETIC = ASSETS / "report" / "synthetic.py"
SCENARIO = "tiny-tp1-gtp2-fp32-sgd"

FAKE_CONFTEST = f"""
import importlib.util
import json
import os

import harness.session

_spec = importlib.util.spec_from_file_location("report_synthetic", {str(SYNTHETIC)!r})
synthetic = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(synthetic)
harness.session.run_scenarios = synthetic.fake_run_scenarios


def pytest_runtest_logreport(report):
    if report.failed or report.when == "call":  # written at once: a rank may be stopped later
        line = [report.nodeid, report.when, report.outcome, str(report.longrepr or "")]
        with open(f"outcomes-rank{{os.environ.get('RANK', 'none')}}.jsonl", "a") as f:
            print(json.dumps(line), file=f)
"""

MARKED_TESTS = """
import pytest


@pytest.mark.parity("tiny.toml")
def test_marked_pass(parity):
    summary = parity()
    assert summary["verdict"] == "pass" and summary is parity()  # the marker's run, once


@pytest.mark.parity("tiny.toml", inject=["gtp-pad-leak"])
def test_marked_fault_unexpected():
    pass


@pytest.mark.parity("tiny.toml", inject=["gtp-pad-leak"], expect="fail", signature="ratio-G")
def test_marked_fault_expected():
    pass


@pytest.mark.parity("tiny.toml", inject=["gtp-pad-leak"], expect="fail", signature="pad-rows")
def test_marked_wrong_signature():
    pass


def test_fixture(parity):
    clean, faulty = parity("tiny.toml"), parity("tiny.toml", inject=["gtp-rs-no-prescale"])
    assert (clean["verdict"], faulty["verdict"]) == ("pass", "fail")
    assert clean["run_dir"] != faulty["run_dir"]
    assert faulty["scenarios"][0]["first_divergence"]["signature"] == "ratio-G"


def test_fixture_unknown_fault(parity):
    with pytest.raises(Exception, match="unknown fault 'nope'"):
        parity("tiny.toml", inject=["nope"])
"""


def plugin_args() -> list[str]:
    """``-p harness.pytest_plugin.plugin`` unless the package's pytest11 entry point loads it already."""
    registered = any(
        ep.value == "harness.pytest_plugin.plugin" for ep in importlib.metadata.entry_points(group="pytest11")
    )
    autoload = not os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD")
    return [] if registered and autoload else ["-p", "harness.pytest_plugin.plugin"]


@pytest.fixture
def project(pytester):
    shutil.copy(ASSETS / "tiny.toml", pytester.path / "tiny.toml")
    pytester.makeconftest(FAKE_CONFTEST)
    return pytester


def outcomes(path: Path, rank: str = "none") -> dict[str, list[list[str]]]:
    """Test name -> [when, outcome, message] of its call and of every failed phase."""
    out: dict[str, list[list[str]]] = {}
    for line in (path / f"outcomes-rank{rank}.jsonl").read_text().splitlines():
        nodeid, *report = json.loads(line)
        out.setdefault(nodeid.split("::")[-1], []).append(report)
    return out


@pytest.mark.slow
def test_options_have_ini_twins_with_one_help(project):
    out = " ".join(project.runpytest_subprocess(*plugin_args(), "--help").stdout.str().split())
    for flag, ini, text in (
        ("--parity-report=DIR", "parity_report", "write the HTML report of every parity run"),
        ("--parity-matrix=FILE", "parity_matrix", "collect each scenario of this matrix"),
        ("--parity-dist-timeout=SECONDS", "parity_dist_timeout", "seconds the ranks wait"),
    ):
        assert flag in out and ini in out
        assert out.count(text) == 2, text


@pytest.mark.slow
def test_marker_and_fixture(project):
    project.makepyfile(test_marked=MARKED_TESTS)
    result = project.runpytest_subprocess(*plugin_args(), "--parity-report", "rep")
    result.assert_outcomes(passed=4, failed=2)
    got = outcomes(project.path)
    unexpected = got["test_marked_fault_unexpected"][-1][2]
    assert unexpected.startswith(
        f"{SCENARIO}: first divergence at step 1 backward main_grad output_layer.weight"
    )
    assert "ratio-G" in unexpected
    assert "expected signature pad-rows, got" in got["test_marked_wrong_signature"][-1][2]
    rep = project.path / "rep"
    folders = sorted(p.name for p in rep.iterdir() if p.is_dir())
    assert len(folders) == 6 and "test_marked.py_test_fixture-1" in folders
    assert (rep / "test_marked.py_test_fixture-1" / "scenarios" / f"{SCENARIO}.html").is_file()
    index = (rep / "index.html").read_text()
    assert index.count(f'href="test_marked.py_test_marked_pass/scenarios/{SCENARIO}.html"') == 2


@pytest.mark.slow
def test_each_xdist_test_gets_its_own_folder(project, monkeypatch):
    project.makepyfile(test_marked=MARKED_TESTS)
    log = project.path / "runs.jsonl"
    monkeypatch.setenv("FAKE_RUN_LOG", str(log))
    result = project.runpytest_subprocess(*plugin_args(), "-n", "2", "--parity-report", "rep")
    result.assert_outcomes(passed=4, failed=2)
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(runs) == 6 and len({r["out"] for r in runs}) == 6
    assert len({r["pid"] for r in runs}) == 2  # both workers ran scenarios
    assert (project.path / "rep" / "index.html").read_text().count("<tr class=") == 6


MATRIX = """
[matrix]
base = "tiny.toml"
name = "fail-g{candidate.gtp}"

[matrix.axes]
"candidate.gtp" = [1, 2]
"""


@pytest.mark.slow
def test_matrix_scenarios_are_test_items(project, monkeypatch):
    project.makefile(".toml", m=MATRIX)
    project.makepyfile(test_other="def test_other():\n    pass\n")
    log = project.path / "runs.jsonl"
    monkeypatch.setenv("FAKE_RUN_LOG", str(log))
    result = project.runpytest_subprocess(*plugin_args(), "--parity-matrix", "m.toml", "-v")
    result.stdout.fnmatch_lines(["m.toml::fail-g1 PASSED*", "m.toml::fail-g2 FAILED*"])
    result.assert_outcomes(passed=1, failed=1)  # test_other.py is not collected
    assert "fail-g2: first divergence at step 1" in outcomes(project.path)["fail-g2"][-1][2]
    assert [r["names"] for r in map(json.loads, log.read_text().splitlines())] == [["fail-g1", "fail-g2"]]

    project.makeini("[pytest]\nparity_matrix = m.toml\n")
    result = project.runpytest_subprocess(*plugin_args(), "test_other.py", "-k", "g2 or other")
    result.assert_outcomes(passed=1, failed=1)


@pytest.mark.slow
def test_bad_option_values_name_their_source(project):
    result = project.runpytest_subprocess(*plugin_args(), "--parity-matrix", "nope.toml")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--parity-matrix: nope.toml: no such file*"])
    project.makeini("[pytest]\nparity_dist_timeout = soon\n")
    result = project.runpytest_subprocess(*plugin_args())
    result.stderr.fnmatch_lines(
        ["*ini option parity_dist_timeout in *tox.ini: 'soon' is not a positive number*"]
    )


DIST_TESTS = """
import os
import time


def test_ok():
    pass


def test_fails_on_rank1():
    assert os.environ["RANK"] != "1", "planted failure on rank 1"


def test_scenario_from_rank0(parity):
    summary = parity("tiny.toml")
    assert summary["verdict"] == "pass" and summary["scenarios"][0]["scenario"] == "tiny-tp1-gtp2-fp32-sgd"


def test_after():
    pass


def test_zz_rank1_hangs():
    if os.environ["RANK"] == "1":
        time.sleep(300)
"""


@pytest.mark.multirank
def test_under_torchrun_a_failure_on_one_rank_fails_all(project, monkeypatch):
    project.makepyfile(test_dist=DIST_TESTS)
    log = project.path / "runs.jsonl"
    monkeypatch.setenv("FAKE_RUN_LOG", str(log))
    start = time.monotonic()
    result = project.run(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
                         "-m", "pytest", *plugin_args(), "-p", "no:cacheprovider", "--parity-report", "rep",
                         "--parity-dist-timeout", "40", "test_dist.py", timeout=280)
    assert result.ret != 0 and time.monotonic() - start < 250  # rank 1's 300 s hang did not hold rank 0
    for rank in ("0", "1"):
        got = outcomes(project.path, rank)
        got.pop("test_zz_rank1_hangs", None)  # rank 1 is stopped while it sleeps
        failed = sorted(name for name, steps in got.items() if any(s[1] == "failed" for s in steps))
        passed = sorted(name for name, steps in got.items() if ["call", "passed"] in [s[:2] for s in steps])
        assert failed == ["test_fails_on_rank1"], (rank, got)
        assert passed == ["test_after", "test_ok", "test_scenario_from_rank0"], (rank, got)
    rank0 = outcomes(project.path, "0")
    message = rank0["test_fails_on_rank1"][-1][2]
    assert "call failed on rank(s) [1] of 2 (this is rank 0, where it passed)" in message
    assert "planted failure on rank 1" in outcomes(project.path, "1")["test_fails_on_rank1"][-1][2]
    hang = rank0["test_zz_rank1_hangs"][-1]
    assert hang[:2] == ["call", "failed"] and "did not report the call outcome within 40 s" in hang[2]
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["rank"] for r in runs] == ["0"]  # only rank 0 launched the scenario
    assert (project.path / "rep" / "index.html").is_file()


@pytest.mark.multirank
def test_real_scenario_fails_with_its_first_divergence(pytester):
    shutil.copy(ASSETS / "tiny.toml", pytester.path / "tiny.toml")
    pytester.makepyfile(
        test_real="""
        import pytest

        @pytest.mark.parity("tiny.toml", inject=["gtp-rs-no-prescale"])
        def test_gtp_grads():
            pass
    """
    )
    result = pytester.runpytest_subprocess(*plugin_args(), "--parity-report", "rep", timeout=600)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            f"{SCENARIO}: first divergence at step 1 *",
            f"FAILED test_real.py::test_gtp_grads - Failed: {SCENARIO}*",
        ]
    )
    page = pytester.path / "rep" / "test_real.py_test_gtp_grads" / "scenarios" / f"{SCENARIO}.html"
    html = page.read_text()
    assert 'class="verdict fail"' in html and '<svg class="blocks"' in html
    assert (pytester.path / "rep" / "index.html").is_file()
