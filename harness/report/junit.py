"""JUnit XML of a run, for CI: one testcase per scenario.

A failing scenario carries a ``<failure>`` whose message is the first divergence in one line
(type: its signature) and whose text adds the metrics; a scenario whose run failed carries an
``<error>`` naming the side and the launcher's message; a known divergence is ``<skipped>``,
with its cause. Matrix axes become properties.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

from harness.compare.summary import Verdict
from harness.report.model import divergence_line, fmt

# XML 1.0 forbids most control characters, even escaped; launcher logs can contain them.
_INVALID_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def _clean(text) -> str:
    return _INVALID_XML.sub("?", str(text))


def _classname(scenarios: list[dict], fallback: str) -> str:
    """``gtp_parity.<scenario file stem>``, the same for every case of a run (a failed run's
    summary has no config: it takes its siblings')."""
    sources = [str((s.get("config") or {}).get("source", "")).split(" (")[0] for s in scenarios]
    stem = next((Path(src).stem for src in sources if src), fallback)
    return "gtp_parity." + re.sub(r"[^A-Za-z0-9_]+", "_", stem)


def _details(summary: dict) -> str:
    fd = summary.get("first_divergence") or {}
    lines = [divergence_line(summary), ""]
    lines += [f"{k}: {fmt(v, 8)}" for k, v in (fd.get("metrics") or {}).items() if v is not None]
    lines += ["", f"failing comparisons: {summary.get('failing')}", f"region: {json.dumps(fd.get('region'))}"]
    lines += [f"{role} trace: {path}" for role, path in (summary.get("traces") or {}).items()]
    return "\n".join(lines)


def junit_tree(doc: dict, suite: str = "gtp-parity", run_name: str = "run") -> ET.ElementTree:
    """The JUnit document of a run summary (``RUN/summary.json``)."""
    scenarios = doc.get("scenarios", [])
    classname = _classname(scenarios, run_name)
    failures = sum(s.get("verdict") == Verdict.FAIL for s in scenarios)
    errors = sum(s.get("verdict") == Verdict.ERROR for s in scenarios)
    skipped = sum(s.get("verdict") in (Verdict.SKIP, Verdict.KNOWN_DIVERGENCE) for s in scenarios)
    root = ET.Element(
        "testsuites", name=suite, tests=str(len(scenarios)), failures=str(failures), errors=str(errors)
    )
    ts = ET.SubElement(root, "testsuite", name=suite, tests=str(len(scenarios)), failures=str(failures),
                       errors=str(errors), skipped=str(skipped))
    for s in scenarios:
        case = ET.SubElement(ts, "testcase", classname=classname, name=_clean(s.get("scenario", "?")))
        axes = s.get("axes") or {}
        if axes:
            props = ET.SubElement(case, "properties")
            for k, v in axes.items():
                ET.SubElement(props, "property", name=_clean(k), value=_clean(v))
        if s.get("verdict") == Verdict.FAIL:
            fd = s.get("first_divergence") or {}
            el = ET.SubElement(
                case, "failure", message=_clean(divergence_line(s)), type=_clean(fd.get("signature", ""))
            )
            el.text = _clean(_details(s))
        elif s.get("verdict") in (Verdict.SKIP, Verdict.KNOWN_DIVERGENCE):
            # A known divergence is not a pass: reported like an expected failure, with its cause.
            el = ET.SubElement(case, "skipped", type=str(s["verdict"]), message=_clean(divergence_line(s)))
            el.text = _clean((s.get("expect") or {}).get("reason", "") or s.get("reason", "") or "")
        elif s.get("verdict") not in (Verdict.PASS, Verdict.FIXED):  # fixed: parity, as its tree's fix says
            el = ET.SubElement(case, "error", message=_clean(divergence_line(s)), type="run-failed")
            el.text = _clean("\n\n".join(f"{role}:\n{msg}" for role, msg in (s.get("error") or {}).items()))
    ET.indent(root)
    return ET.ElementTree(root)


def write_junit(run_dir: Path, path: Path) -> Path:
    """Write the JUnit XML of ``run_dir/summary.json`` to ``path``."""
    doc = json.loads((Path(run_dir) / "summary.json").read_text())
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    junit_tree(doc, f"gtp-parity {Path(run_dir).name}", Path(run_dir).name).write(
        path, encoding="utf-8", xml_declaration=True
    )
    return path
