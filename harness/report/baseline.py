"""Baselines: a run's verdicts and step scalars kept, to list what a later run changed.

A baseline is a folder with one ``<scenario>.json`` per scenario: its verdict, its steps table
(every side's per-step loss, grad norm, LR, ...) and provenance (versions from the traces'
manifests, the date, a hash of the scenario's configuration). It is written only by an
explicit :func:`update_baseline`; :func:`compare_to_baseline` lists what changed.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
from pathlib import Path

from harness.report.model import load_scenario
from harness.scenario import COMPARED_ROLES

FP32_RTOL, FP32_ATOL = 1.3e-6, 1e-5
"""Step scalars may move this much (Transformer Engine's fp32 tolerances) without a message."""
MAX_MESSAGES_PER_SCENARIO = 10


def config_hash(summary: dict, manifests: dict[str, dict]) -> str:
    """Identity of what a scenario computes: each side's trace key (side, model, data and
    capture settings), its label and the compare policy. Paths and descriptions are left out."""
    cfg = summary.get("config") or {}
    blob = {"sides": {r: manifests.get(r, {}).get("key") for r in COMPARED_ROLES},
            "labels": {r: cfg.get(r) for r in COMPARED_ROLES}, "policy": summary.get("policy")}
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _scenario_names(run_dir: Path) -> list[str]:
    doc = json.loads((run_dir / "summary.json").read_text())
    return [str(s["scenario"]) for s in doc.get("scenarios", [])]


def baseline_doc(scenario_dir: Path) -> dict:
    data = load_scenario(scenario_dir)
    return {
        "scenario": data.name,
        "verdict": data.verdict,
        "steps": data.steps,
        "provenance": {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "config_hash": config_hash(data.doc, data.manifests),
            "config": data.doc.get("config"),
            "versions": {r: m.get("versions") for r, m in data.manifests.items()},
        },
    }


def update_baseline(run_dir: Path, baseline_dir: Path) -> Path:
    """Write (or overwrite) ``baseline_dir/<scenario>.json`` for every scenario of the run."""
    run_dir, baseline_dir = Path(run_dir), Path(baseline_dir)
    baseline_dir.mkdir(parents=True, exist_ok=True)
    for name in _scenario_names(run_dir):
        doc = baseline_doc(run_dir / "scenarios" / name)
        (baseline_dir / f"{name}.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return baseline_dir


def _close(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    a, b = float(a), float(b)
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or abs(a - b) <= FP32_ATOL + FP32_RTOL * abs(b)


def compare_steps(name: str, base: list[dict], now: list[dict]) -> list[str]:
    """Messages for step scalars that moved beyond fp32 tolerance, or rows that appeared or vanished."""
    key = lambda r: (str(r.get("side")), int(r.get("step", 0)))  # noqa: E731
    b, n = {key(r): r for r in base}, {key(r): r for r in now}
    out = []
    for k in sorted(b.keys() | n.keys()):
        if k not in n or k not in b:
            out.append(
                f"{name}: {k[0]} step {k[1]} is "
                + ("missing from the run" if k not in n else "new (not in the baseline)")
            )
            continue
        for col in sorted((b[k].keys() | n[k].keys()) - {"side", "step"}):
            if not _close(b[k].get(col), n[k].get(col)):
                out.append(f"{name}: {k[0]} step {k[1]} {col} {b[k].get(col)!r} -> {n[k].get(col)!r} "
                           f"(beyond fp32 tolerance rtol {FP32_RTOL:g} atol {FP32_ATOL:g})")
    return out


def compare_to_baseline(run_dir: Path, baseline_dir: Path) -> list[str]:
    """What differs between a run and a baseline, one message per difference ([] if none)."""
    run_dir, baseline_dir = Path(run_dir), Path(baseline_dir)
    if not baseline_dir.is_dir():
        return [f"{baseline_dir}: no baseline folder (write one with update_baseline)"]
    names = _scenario_names(run_dir)
    out = []
    for name in names:
        path = baseline_dir / f"{name}.json"
        if not path.exists():
            out.append(f"{name}: no baseline ({path} is missing)")
            continue
        base, now = json.loads(path.read_text()), baseline_doc(run_dir / "scenarios" / name)
        msgs = []
        if base.get("verdict") != now["verdict"]:
            msgs.append(f"{name}: verdict {base.get('verdict')} in the baseline, {now['verdict']} now")
        if base.get("provenance", {}).get("config_hash") != now["provenance"]["config_hash"]:
            msgs.append(f"{name}: the scenario's configuration changed since the baseline "
                        f"({base.get('provenance', {}).get('config_hash')} -> "
                        f"{now['provenance']['config_hash']})")
        msgs += compare_steps(name, base.get("steps", []), now["steps"])
        if len(msgs) > MAX_MESSAGES_PER_SCENARIO:
            msgs = msgs[:MAX_MESSAGES_PER_SCENARIO] + [
                f"{name}: ... and {len(msgs) - MAX_MESSAGES_PER_SCENARIO} more"
            ]
        out += msgs
    for path in sorted(baseline_dir.glob("*.json")):
        if path.stem not in names:
            out.append(f"{path.stem}: in the baseline but not in this run")
    return out
