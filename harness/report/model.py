"""What a report shows, as data: read one scenario folder and derive every view's numbers.

A scenario folder (``RUN/scenarios/<name>/``) holds ``summary.json``, ``steps.csv`` and
``results.csv`` (see harness.session). The trace manifests it names give versions, mesh and
coordinates. Nothing here formats HTML: :mod:`harness.report.page` renders these values, and
the one-line texts below are shared by the pages, JUnit and the pytest plugin.
"""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from harness.scenario import COMPARED_ROLES
from harness.compare.summary import FirstDivergence, Region, ResultRow, ScenarioSummary, Verdict, as_summary

KIND_GROUPS = {
    "activation": ("activation", "logits", "loss", "mtp_loss"),
    "grad": ("main_grad",),
    "param": ("param_before", "materialized", "param"),
    "optimizer state": ("exp_avg", "exp_avg_sq", "master"),
}
"""Heatmap column groups: the result kinds each one gathers."""


@dataclass(slots=True)
class ScenarioData:
    """Everything read from one scenario folder."""

    name: str
    folder: Path
    summary: ScenarioSummary
    doc: dict
    """summary.json as written."""
    steps: list[dict] = field(default_factory=list)
    """Rows of steps.csv: side, step, reduced_loss, grad_norm, lr, ..."""
    results: list[dict] = field(default_factory=list)
    """Rows of results.csv in causal order, numbers parsed."""
    manifests: dict[str, dict] = field(default_factory=dict)
    """Role -> trace manifest (missing traces are left out)."""
    trace_dirs: dict[str, Path] = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        return self.summary.verdict


def _number(text: str):
    """A CSV cell as bool, int, float or str ('' -> None)."""
    if text == "":
        return None
    if text in ("True", "False"):
        return text == "True"
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def read_csv(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(f)]


def resolve_trace(path: str | None, run_dir: Path) -> Path | None:
    """A trace folder named in a summary: the run's own ``traces/<name>`` if there, else the
    path as written (summaries store paths relative to where the run was started)."""
    if not path:
        return None
    p = Path(path)
    for candidate in (run_dir / "traces" / p.name, p, run_dir / p):
        if (candidate / "manifest.json").exists():
            return candidate
    return None


def load_scenario(folder: Path) -> ScenarioData:
    """Read a scenario folder written by ``gtp-parity run`` (or ``compare``)."""
    folder = Path(folder)
    doc = json.loads((folder / "summary.json").read_text())
    summary = ScenarioSummary.from_json({"scenario": folder.name, **doc})
    run_dir = folder.parent.parent
    data = ScenarioData(name=str(summary.scenario), folder=folder, summary=summary, doc=doc,
                        steps=read_csv(folder / "steps.csv"),
                        results=read_csv(folder / "results.csv"))
    for role, path in summary.traces.items():
        trace = resolve_trace(path, run_dir)
        if trace is not None:
            data.trace_dirs[role] = trace
            data.manifests[role] = json.loads((trace / "manifest.json").read_text())
    return data


# --- one-line texts -----------------------------------------------------------------------


def fmt(value, digits: int = 4) -> str:
    """A number for people: None/NaN as an en dash, floats to ``digits`` significant digits."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "\u2013"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def region_text(fd: FirstDivergence) -> str:
    """Where in the logical tensor the first divergence sits, in words."""
    r: Region = fd.region
    parts = []
    if r.duplicated or r.missing:
        parts.append(f"samples read twice {r.duplicated}, never read {r.missing}")
    if r.rows is not None:
        lo, hi = r.rows
        parts.append(f"pad rows {lo}-{hi} of the padded block held by rank {r.rank}")
    if r.gtp_block_rows:
        lo, hi = r.gtp_block_rows
        parts.append(f"rows {lo}-{hi} (GTP block {r.shard.get('gtp')})")
    if r.tp_block:
        lo, hi, dim = r.tp_block
        parts.append(f"{dim} {lo}-{hi} (TP block {r.shard.get('tp')})")
    if r.worst_index and fd.kind != "scalar":
        parts.append(f"worst element at {list(r.worst_index)}")
    return "; ".join(parts)


def divergence_line(summary: ScenarioSummary | dict) -> str:
    """The first divergence (or the run error) of one scenario summary, in one line."""
    s = as_summary(summary)
    if s.verdict == Verdict.ERROR:
        text = "; ".join(f"{role}: {' '.join(str(msg).split())}" for role, msg in s.error.items())
        return f"{s.scenario}: run failed: {text or 'no error message recorded'}"
    fd = s.first_divergence
    if s.verdict == Verdict.SKIP:
        return f"{s.scenario}: skipped: {s.reason or 'no reason recorded'}"
    if fd is None and s.verdict == Verdict.KNOWN_DIVERGENCE and s.error:  # [expect] raises
        return f"{s.scenario}: {s.expectation}: " + "; ".join(" ".join(str(m).split())
                                                              for m in s.error.values())
    if fd is None:
        return f"{s.scenario}: parity holds" + (f" ({s.expectation})" if s.expectation else "")
    if s.expectation:
        return f"{s.scenario}: {s.expectation}; " + _first_divergence_text(s, fd)
    if s.verdict == Verdict.KNOWN_DIVERGENCE:
        return f"{s.scenario}: known divergence: " + _first_divergence_text(s, fd)
    return _first_divergence_text(s, fd, prefix=f"{s.scenario}: ")


def _first_divergence_text(s: ScenarioSummary, fd: FirstDivergence, prefix: str = "") -> str:
    where = region_text(fd)
    detail = ", ".join(f"{k} {fmt(fd.metrics[k])}" for k in ("max_abs", "max_rel", "bound")
                       if k in fd.metrics)
    if detail and fd.extra.get("bound_on") and "bound" in fd.metrics:
        detail += f" (the bound is on: {fd.extra['bound_on']})"
    return (
        f"{prefix}first divergence at step {fd.step} {fd.phase} {fd.kind} {fd.tensor}"
        + (f" on ranks {fd.ranks}" if fd.ranks else "") + (f" [{where}]" if where else "")
        + f": {fd.signature} ({fd.explanation or 'no explanation'})"
        + (f"; {detail}" if detail else "")
    )


def expectation_failures(summary: dict, expect: str = "pass", signature: str | None = None) -> list[str]:
    """Why a run summary does not meet the expected verdict (and signature), one line per
    scenario ([] if it does)."""
    out = []
    for s in map(ScenarioSummary.from_json, summary.get("scenarios", [])):
        if s.verdict != expect and not (expect == Verdict.PASS and s.verdict == Verdict.FIXED):
            what = divergence_line(s) if s.verdict != Verdict.PASS else f"{s.scenario}: parity holds"
            out.append(what + ("" if expect == "pass" else f" (expected verdict {expect})"))
        elif signature is not None and (s.first_divergence or FirstDivergence()).signature != signature:
            out.append(f"expected signature {signature}, got {divergence_line(s)}")
    return out


EXPECTATIONS = ("bitwise", "bounded", "noise-floor")


def expectation_share(counts: dict) -> str:
    """``bitwise 52% (120), bounded 9% (21), noise-floor 39% (90)`` of the compared tensors."""
    total = sum(int(n) for n in counts.values())
    if not total:
        return "none recorded"
    names = [k for k in EXPECTATIONS if k in counts] + sorted(set(counts) - set(EXPECTATIONS))
    return ", ".join(f"{k} {100 * int(counts[k]) / total:.0f}% ({int(counts[k])})" for k in names)


def verdict_line(data: ScenarioData) -> str:
    """The verdict in one sentence."""
    s = data.summary
    total = s.total_checked
    if data.verdict == Verdict.PASS:
        return f"PASS: all {total} comparisons hold under the {s.policy.get('name', '?')} policy"
    if data.verdict == Verdict.FAIL:
        fd = s.first_divergence or FirstDivergence()
        failing = "?" if s.failing is None else s.failing
        return (f"FAIL: {failing} of {total} comparisons fail; the first is step "
                f"{fd.step} {fd.phase} {fd.tensor} ({fd.signature})")
    if data.verdict == Verdict.KNOWN_DIVERGENCE and s.first_divergence is None and s.error:
        return f"KNOWN FAILURE TO RUN: {s.expectation}, as recorded: {(s.expect or {}).get('reason', '')}"
    if data.verdict == Verdict.KNOWN_DIVERGENCE:
        fd = s.first_divergence or FirstDivergence()
        return (f"KNOWN DIVERGENCE: step {fd.step} {fd.phase} {fd.tensor} ({fd.signature}), as recorded: "
                f"{(s.expect or {}).get('reason', '')}")
    if data.verdict == Verdict.SKIP:
        return f"SKIP: {s.reason or 'not run'}"
    if data.verdict == Verdict.FIXED:
        return f"FIXED: all {total} comparisons hold; {s.expectation}"
    return f"ERROR: a run failed ({', '.join(s.error) or 'unknown side'}); nothing was compared"


# --- series, drift, heatmap ------------------------------------------------------------------


def step_series(steps: list[dict], column: str) -> dict[str, list[tuple[float, float]]]:
    """Role -> [(step, value)] of one steps.csv column."""
    out: dict[str, list[tuple[float, float]]] = {}
    for row in steps:
        v = row.get(column)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out.setdefault(str(row["side"]), []).append((float(row["step"]), float(v)))
    return {role: sorted(out[role]) for role in COMPARED_ROLES if role in out}


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def drift(results: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """Per step, the largest error of any tensor against the golden, for each side."""
    out = {}
    for label, column in (
        ("candidate vs golden", "cand_err_golden"),
        ("reference vs golden", "ref_err_golden"),
    ):
        per_step: dict[int, float] = {}
        for row in map(ResultRow.from_json, results):
            v = getattr(row, column)
            if _finite(v):
                per_step[row.step] = max(per_step.get(row.step, 0.0), float(v))
        if per_step:
            out[label] = [(float(s), v) for s, v in sorted(per_step.items())]
    return out


def layer_of(name: str) -> str:
    """The heatmap row of a tensor or module name."""
    if name.startswith("embedding"):
        return "embedding"
    m = re.match(r"decoder\.layers\.(\d+)", name)
    if m:
        return f"layer {m.group(1)}"
    if name.startswith("decoder.final_layernorm"):
        return "final norm"
    if name.startswith(("output_layer", "loss")):
        return "output"
    return "other"


def _layer_rank(label: str) -> tuple:
    if label == "embedding":
        return (0, 0)
    if label.startswith("layer "):
        return (1, int(label.split()[1]))
    return (2, ["final norm", "output", "other"].index(label))


EPS = {"float64": 2.220446049250313e-16, "float32": 1.1920928955078125e-07, "bfloat16": 0.0078125,
       "float16": 0.0009765625}
"""Machine epsilon per dtype name (heatmap errors without a golden are counted in these units)."""


@dataclass(frozen=True, slots=True)
class Cell:
    value: float
    """The largest error among the cell's comparisons, in the heatmap's unit (see Heatmap.unit);
    0 when every one is bitwise equal to the reference."""
    failed: int
    """Comparisons in the cell that fail their policy."""
    count: int
    worst: str
    """The tensor with the largest error."""


@dataclass(slots=True)
class Heatmap:
    layers: list[str]
    groups: list[str]
    steps: list[int]
    cells: dict[tuple[str, str, int], Cell]
    unit: str = "golden"
    """``golden``: candidate error vs golden over the reference's (1: as close to the truth as
    the reference); ``eps``: relative L2 of candidate vs reference in units of the dtype's
    epsilon (runs without a golden)."""


def _error(row: ResultRow, unit: str) -> float:
    if row.bitwise_equal is True:
        return 0.0
    failed = row.passed is False
    if unit == "golden":
        ref, cand = row.ref_err_golden, row.cand_err_golden
        if _finite(ref) and _finite(cand):
            if ref > 0:
                return float(cand) / float(ref)
            if cand == 0:
                return 0.0
        return math.inf if failed else 1.0
    v = row.rel_l2
    eps = EPS.get(str(row.dtype or "").replace("torch.", ""), EPS["float32"])
    return float(v) / eps if _finite(v) else (math.inf if failed else 0.0)


def heatmap(results: list[dict]) -> Heatmap:
    """Error by layer x kind group x step (the unit: see :class:`Heatmap`)."""
    group_of = {k: g for g, kinds in KIND_GROUPS.items() for k in kinds}
    rows = [r for r in map(ResultRow.from_json, results) if r.kind in group_of]
    unit = "golden" if any(_finite(r.ref_err_golden) for r in rows) else "eps"
    acc: dict[tuple[str, str, int], list] = {}
    for row in rows:
        key = (layer_of(str(row.tensor)), group_of[row.kind], int(row.step))
        v = _error(row, unit)
        a = acc.setdefault(key, [0.0, 0, 0, ""])
        if v >= a[0] or not a[3]:
            a[0], a[3] = max(v, a[0]), str(row.tensor)
        a[1] += row.passed is False
        a[2] += 1
    cells = {k: Cell(value=a[0], failed=a[1], count=a[2], worst=a[3]) for k, a in acc.items()}
    return Heatmap(
        layers=sorted({k[0] for k in cells}, key=_layer_rank),
        groups=[g for g in KIND_GROUPS if any(k[1] == g for k in cells)],
        steps=sorted({k[2] for k in cells}),
        cells=cells,
        unit=unit,
    )


def worst_row(results: list[dict]) -> ResultRow | None:
    """The comparison with the largest relative L2 difference (failing rows first)."""
    rows = [r for r in map(ResultRow.from_json, results) if _finite(r.rel_l2)]
    if not rows:
        return None
    return max(rows, key=lambda r: (r.passed is False, float(r.rel_l2)))


def worst_metric(data: ScenarioData) -> str:
    """One short text for a matrix cell: the signature, or how far the worst tensor moved."""
    fd = data.summary.first_divergence
    if data.verdict == Verdict.ERROR:
        return "run failed"
    if fd is not None:
        if fd.region.duplicated:
            return f"{fd.signature}, samples {fd.region.duplicated} read twice"
        for key, label in (("max_rel", "max rel"), ("max_abs", "max abs")):
            if key in fd.metrics:
                return f"{fd.signature}, {label} {fmt(fd.metrics[key], 3)}"
        return str(fd.signature)
    row = worst_row(data.results)
    if row is None:
        return "no tensors"
    text = f"worst rel L2 {fmt(row.rel_l2, 2)}"
    # What the per-tensor noise floor judged: how much further from the golden the candidate got.
    ratios = [_error(r, "golden") for r in map(ResultRow.from_json, data.results)
              if r.policy == "noise-floor" and _finite(r.ref_err_golden)]
    ratios = [v for v in ratios if math.isfinite(v)]
    return f"{text}; err vs golden <= {fmt(max(ratios), 3)}x ref" if ratios else text
