"""The run index: a grid of scenarios by matrix axes, coloured by verdict, linking to pages.

Rows and columns come from the ``axes`` of the scenario summaries: the first axis gives the
rows, the others, combined, the columns (topology x precision . optimizer); one axis gives one
row per value. A run without axes lists its scenarios one per row.
"""

from __future__ import annotations

import itertools
import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import quote

from harness.common.errors import BadInput
from harness.report.model import divergence_line, expectation_share, load_scenario, worst_metric
from harness.compare.summary import ScenarioSummary, Verdict, as_summary
from harness.report.page import document, render_scenario
from harness.report.svg import esc
from harness.scenario.schema import check_scenario_name

CELLS_FILE = "cells.json"
"""Per scenario: verdict, worst metric and page link, kept next to the index for merging."""


@dataclass(frozen=True, slots=True)
class IndexCell:
    name: str
    verdict: str
    worst: str
    href: str
    axes: dict
    line: str
    """The first divergence (or run error) in one line."""
    group: str = ""
    """Where the run came from when several are merged (the pytest plugin: the test's id)."""
    paths: str = ""
    """The megatron-core code paths the sides took off the plainest one (``Side.paths``)."""
    expectations: dict = field(default_factory=dict)
    """Compared tensors per expectation (bitwise, bounded, noise-floor)."""

    @property
    def label(self) -> str:
        return f"{self.group} \u00b7 {self.name}" if self.group else self.name


def _axes(cells: list[IndexCell]) -> list[str]:
    names: list[str] = []
    for c in cells:
        names += [a for a in c.axes if a not in names]
    return names


def _values(cells: list[IndexCell], axis: str) -> list[str]:
    seen: list[str] = []
    for c in cells:
        if axis in c.axes and c.axes[axis] not in seen:
            seen.append(c.axes[axis])
    return seen


SEP = " \u00b7 "


def grid(cells: list[IndexCell]) -> tuple[str, list[str], list[str], dict[tuple[str, str], list[IndexCell]]]:
    """(corner label, row labels, column labels, (row, column) -> cells) of the matrix."""
    placed = [c for c in cells if c.axes]  # a run that failed may have been summarized without axes
    axes = [a for a in _axes(placed) if all(a in c.axes for c in placed)]
    table: dict[tuple[str, str], list[IndexCell]] = {}
    if not axes:
        for c in cells:
            table.setdefault((c.label, "verdict"), []).append(c)
        return "scenario", list(dict.fromkeys(c.label for c in cells)), ["verdict"], table
    row_axis, col_axes = axes[0], axes[1:]
    cols = [SEP.join(combo) for combo in itertools.product(*(_values(placed, a) for a in col_axes))]
    rows = _values(placed, row_axis)
    for c in placed:
        table.setdefault((c.axes[row_axis], SEP.join(c.axes[a] for a in col_axes) or "verdict"), []).append(c)
    cols = [col for col in cols if any(k[1] == col for k in table)] or ["verdict"]
    for c in cells:
        if not c.axes:
            rows.append(c.label)
            table.setdefault((c.label, cols[0]), []).append(c)
    corner = row_axis + (f" \\ {SEP.join(col_axes)}" if col_axes else "")
    return corner, list(dict.fromkeys(rows)), cols, table


def render_index(title: str, cells: list[IndexCell], verdict: str) -> str:
    corner, rows, cols, table = grid(cells)
    head = f'<th class="t">{esc(corner)}</th>' + "".join(f"<th>{esc(c)}</th>" for c in cols)
    body = []
    for r in rows:
        tds = []
        for col in cols:
            here = table.get((r, col), [])
            verdict_here = _worst(here) if here else ""
            tds.append(f'<td class="{esc(verdict_here)}">{"".join(map(_link, here))}</td>')
        body.append(f'<tr><td class="t">{esc(r)}</td>{"".join(tds)}</tr>')
    shown = (Verdict.PASS, Verdict.FIXED, Verdict.KNOWN_DIVERGENCE, Verdict.FAIL, Verdict.ERROR, Verdict.SKIP)
    counts = {v: sum(c.verdict == v for c in cells) for v in shown}
    summary = ", ".join(f"{n} {v}" for v, n in counts.items() if n)
    listing = "".join(
        f'<tr class="{esc(c.verdict)}"><td class="t"><a href="{esc(c.href)}">{esc(c.label)}</a></td>'
        f'<td class="t">{esc(c.verdict)}</td><td class="t mono">{esc(c.paths)}</td>'
        f'<td class="t">{esc(expectation_share(c.expectations))}</td><td class="t '
        f'mono">{esc(c.line)}</td></tr>'
        for c in cells
    )
    total: dict[str, int] = {}
    for c in cells:
        for k, n in c.expectations.items():
            total[k] = total.get(k, 0) + int(n)
    html = "".join([
        f"<h1>{esc(title)}</h1>",
        f'<p class="verdict {esc(verdict)}" id="verdict">',
        f"{esc(verdict.upper())}: {len(cells)} scenario(s), {esc(summary)}</p>",
        f'<p id="expectations">compared tensors judged by expectation: {esc(expectation_share(total))}</p>',
        f'<h2>Matrix</h2><table class="grid" id="matrix"><thead><tr>{head}</tr></thead>',
        f'<tbody>{"".join(body)}</tbody></table>',
        '<h2>Scenarios</h2><table class="grid" id="scenarios"><thead><tr><th class="t">scenario</th>',
        '<th class="t">verdict</th><th class="t">paths exercised</th>',
        '<th class="t">judged by expectation</th>',
        '<th class="t">first divergence</th></tr></thead>',
        f"<tbody>{listing}</tbody></table>",
    ])
    return document(f"{verdict.upper()} {title} - gtp-parity", html)


def _link(c: IndexCell) -> str:
    return (f'<a href="{esc(c.href)}" title="{esc(c.line)}"><span class="cell-verdict">{esc(c.verdict)}'
            f'</span><br><span class="small">{esc(c.worst)}</span></a>')


def _worst(cells: list[IndexCell]) -> str:
    verdicts = {c.verdict for c in cells}
    for v in (Verdict.ERROR, Verdict.FAIL, Verdict.KNOWN_DIVERGENCE, Verdict.FIXED, Verdict.PASS):
        if v in verdicts:
            return v
    return "skip"


def write_scenario_page(scenario_dir: Path, out_html: Path) -> Path:
    """Write the self-contained page of one scenario folder (``RUN/scenarios/<name>``)."""
    out_html = Path(out_html)
    out_html.parent.mkdir(parents=True, exist_ok=True)
    out_html.write_text(render_scenario(load_scenario(Path(scenario_dir))), encoding="utf-8")
    return out_html


def write_index(run_dir: Path, report_dir: Path) -> Path:
    """Write ``report_dir/index.html``, a page per scenario under ``report_dir/scenarios/``, and
    a copy of the run's ``summary.json``. Return the index path."""
    run_dir, report_dir = Path(run_dir), Path(report_dir)
    doc = _read_run_summary(run_dir / "summary.json")
    cells = []
    for s in doc["scenarios"]:
        name = s["scenario"]
        if (problem := check_scenario_name(name)) is not None:  # the name becomes a file name
            raise BadInput(f"{run_dir / 'summary.json'}: scenario", problem)
        data = load_scenario(run_dir / "scenarios" / name)
        page = report_dir / "scenarios" / f"{name}.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(render_scenario(data), encoding="utf-8")
        cells.append(IndexCell(name=name, verdict=data.verdict, worst=worst_metric(data),
                               href=f"scenarios/{quote(name)}.html", axes=dict(s.get("axes") or {}),
                               line=divergence_line(data.summary), paths=paths_line(data.summary),
                               expectations=dict(data.summary.expectations)))
    if (report_dir / "summary.json").resolve() != (run_dir / "summary.json").resolve():
        shutil.copyfile(run_dir / "summary.json", report_dir / "summary.json")
    (report_dir / CELLS_FILE).write_text(json.dumps([asdict(c) for c in cells], indent=1))
    index = report_dir / "index.html"
    index.write_text(render_index(f"gtp-parity run {run_dir.name}", cells, str(doc.get("verdict", "error"))),
                     encoding="utf-8")
    return index


def run_expectations(run_dir: Path) -> str:
    """The share of a run's compared tensors per expectation, over its scenarios."""
    total: dict[str, int] = {}
    for s in _read_run_summary(Path(run_dir) / "summary.json")["scenarios"]:
        for k, n in (s.get("expectations") or {}).items():
            total[k] = total.get(k, 0) + int(n)
    return expectation_share(total)


def paths_line(summary: ScenarioSummary | dict) -> str:
    """``candidate: distributed_optimizer=True, ...; reference: ...`` from a scenario summary."""
    paths = (as_summary(summary).config or {}).get("paths") or {}
    if not isinstance(paths, dict):
        return ""
    return "; ".join(f"{role}: " + ", ".join(f"{k}={v}" for k, v in opts.items())
                     for role, opts in paths.items() if isinstance(opts, dict))


def _read_run_summary(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise BadInput(str(path), f"not a run summary ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("scenarios", []), list) or not all(
        isinstance(s, dict) and "scenario" in s for s in doc.get("scenarios", [])
    ):
        raise BadInput(str(path), "not a run summary: expected {scenarios: [{scenario: NAME, ...}, ...]}")
    return {"scenarios": [], **doc}


def write_combined_index(report_root: Path, title: str, since: float = 0.0) -> Path | None:
    """Index the reports under ``report_root/*/`` (each written by :func:`write_index`, at or
    after the time ``since``) in one grid, linking into each. The pytest plugin's session index."""
    report_root = Path(report_root)
    cells = []
    for cells_file in sorted(report_root.glob(f"*/{CELLS_FILE}")):
        if cells_file.stat().st_mtime < since:
            continue
        sub = cells_file.parent.name
        for c in json.loads(cells_file.read_text()):
            cells.append(IndexCell(**{**c, "href": f"{sub}/{c['href']}", "group": sub}))
    if not cells:
        return None
    index = report_root / "index.html"
    index.write_text(render_index(title, cells, _worst(cells)), encoding="utf-8")
    return index
