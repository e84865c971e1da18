"""Report pages of a real run of tests/assets/faults.toml, and every page checked in headless
Chromium: it loads from disk without console errors, shows the verdict, and its script runs.

Chromium is Debian's ``chromium`` (CI installs it); without it the browser checks are skipped.
"""

from __future__ import annotations

import csv
import fcntl
import importlib.util
import json
import os
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from harness.report import divergence_line, write_index, write_junit

ASSETS = Path(__file__).parent / "assets"
_spec = importlib.util.spec_from_file_location("report_synthetic", ASSETS / "report" / "synthetic.py")
synthetic = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(synthetic)

CHROMIUM = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser"), "/usr/bin/chromium")
                 if p and Path(p).exists()), None)
needs_browser = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium here (Debian package `chromium`, "
                                   "/usr/bin/chromium): the pages are not checked in a browser")


def browse(page: Path, profile: Path, fragment: str = "") -> tuple[str, list[str]]:
    """(DOM after load, console messages) of a page opened from disk in headless Chromium."""
    proc = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
         "--enable-logging=stderr", "--v=0", "--dump-dom", page.resolve().as_uri() + fragment],
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]
    return proc.stdout, console


def verdict_of(dom: str) -> str:
    return re.search(r'id="verdict">(.*?)</p>', dom).group(1)


def shown(dom: str) -> str:
    return re.search(r'<span id="count" class="small">(.*?)</span>', dom).group(1)


@pytest.fixture(scope="module")
def synthetic_report(tmp_path_factory) -> Path:
    run = synthetic.write_run(tmp_path_factory.mktemp("run"), [
        {"name": "odd", "verdict": "fail", "tensor": "<script>document.title='pwned'</script>"},
        {"name": "crash", "verdict": "error"}])
    out = tmp_path_factory.mktemp("report")
    write_index(run, out)
    return out


@needs_browser
def test_synthetic_pages_in_browser(synthetic_report, tmp_path):
    dom, console = browse(synthetic_report / "scenarios" / "odd.html", tmp_path / "p1")
    assert console == []
    assert 'data-ready="1"' in dom and verdict_of(dom).startswith("FAIL: 4 of 13 comparisons fail")
    assert "<title>FAIL odd - gtp-parity</title>" in dom  # the name in the table did not run
    assert dom.count("<script") == 1 and "&lt;script&gt;document.title" in dom
    assert shown(dom) == "13 of 13 comparisons shown"
    dom, console = browse(synthetic_report / "scenarios" / "odd.html", tmp_path / "p2", "#q=script&failing=1")
    assert console == [] and shown(dom) == "4 of 13 comparisons shown"
    dom, console = browse(synthetic_report / "scenarios" / "crash.html", tmp_path / "p3")
    assert console == [] and verdict_of(dom).startswith("ERROR: a run failed (candidate)")


def _fault_scenarios():
    from harness import scenario

    return scenario.load(ASSETS / "faults.toml")


@pytest.fixture(scope="module")
def faults_run(tmp_path_factory) -> Path:
    """One real run of the planted faults, shared by the xdist workers (the first one runs it)."""
    from harness import scenario
    from harness.session import run_scenarios

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    out = root / "faults-run"
    with open(root / "faults-run.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "summary.json").exists():
            run_scenarios(scenario.load(ASSETS / "faults.toml"), out, parallel=2)
    return out


@pytest.fixture(scope="module")
def faults_report(faults_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("faults-report")
    write_index(faults_run, out)
    return out


@pytest.mark.multirank
def test_real_index_and_pages_name_each_signature(faults_run, faults_report):
    doc = json.loads((faults_run / "summary.json").read_text())
    assert len(doc["scenarios"]) == len(_fault_scenarios())
    index = (faults_report / "index.html").read_text()
    for s in doc["scenarios"]:
        name, fd = s["scenario"], s["first_divergence"]
        assert s["verdict"] == "fail", name
        cell = re.search(rf'<a href="scenarios/{re.escape(name)}.html" title="[^"]*">(.*?)</a>', index)
        assert cell and re.search(rf"\b{fd['signature']}\b", cell.group(1)), name
        html = (faults_report / "scenarios" / f"{name}.html").read_text()
        assert f"<b>{fd['signature']}</b>" in html and fd["tensor"] in html
        assert "0.19.2" in html  # megatron-core version from the trace manifest
        if fd["kind"] in ("main_grad", "param") and fd["signature"] != "replica-drift":
            assert '<svg class="blocks"' in html and 'class="marked"' in html, name


@pytest.mark.multirank
def test_real_junit(faults_run, tmp_path):
    root = ET.parse(write_junit(faults_run, tmp_path / "junit.xml")).getroot()
    doc = json.loads((faults_run / "summary.json").read_text())
    messages = {c.get("name"): c.find("failure").get("message") for c in root.iter("testcase")}
    assert messages == {s["scenario"]: divergence_line(s) for s in doc["scenarios"]}
    assert root.get("failures") == str(len(_fault_scenarios()))


@pytest.mark.multirank
@needs_browser
def test_real_pages_in_browser(faults_run, faults_report, tmp_path):
    dom, console = browse(faults_report / "index.html", tmp_path / "index")
    n = len(_fault_scenarios())
    assert console == [] and verdict_of(dom) == f"FAIL: {n} scenario(s), {n} fail"
    name = "fault-gtp-rs-no-prescale"
    rows = list(csv.DictReader((faults_run / "scenarios" / name / "results.csv").open()))
    failing = sum(r["passed"] == "False" and r["tensor"] == "output_layer.weight" for r in rows)
    page = faults_report / "scenarios" / f"{name}.html"
    dom, console = browse(page, tmp_path / "page", "#q=output_layer.weight&failing=1")
    assert console == [] and 'data-ready="1"' in dom
    assert verdict_of(dom).startswith("FAIL: ") and "ratio-G" in verdict_of(dom)
    assert shown(dom) == f"{failing} of {len(rows)} comparisons shown" and failing > 0
