"""The scenario page: one self-contained HTML file (inline CSS, JS and SVG only).

Sections, top to bottom: the verdict; the first divergence with its signature explained;
where in the logical tensor it sits (shard blocks); loss, grad norm and LR per step for the
three sides; drift of the error against the golden; the error heatmap; invariant violations;
every comparison in a sortable, filterable table; the scenario, topology and versions.
"""

from __future__ import annotations

import json
import math

from harness.report import blocks, svg
from harness.report.model import (
    ROLES,
    ScenarioData,
    divergence_line,
    drift,
    fmt,
    heatmap,
    region_text,
    step_series,  # fmt: skip
    verdict_line,
)
from harness.report.static import CSS, JS
from harness.report.svg import esc

TABLE_COLUMNS = [
    ("step", "step"), ("phase", "phase"), ("kind", "kind"), ("tensor", "tensor"), ("passed", "ok"),
    ("policy", "policy"), ("dtype", "dtype"), ("shape", "shape"), ("max_abs", "max abs"),
    ("max_rel", "max rel"), ("max_ulp", "max ULP"), ("p99_ulp", "p99 ULP"), ("rel_l2", "rel L2"),
    ("cosine", "cosine"), ("mismatched", "mismatched"), ("ref_err_golden", "ref err vs golden"),
    ("cand_err_golden", "cand err vs golden"), ("bound", "bound"), ("worst_index", "worst index"),
]  # fmt: skip
TEXT_COLUMNS = {"phase", "kind", "tensor", "policy", "dtype", "shape", "worst_index"}
HEAT_NOTES = {
    "golden": "the largest ratio, among the cell's tensors, of the candidate's error against the golden to "
              "the reference's (1: the candidate is as close to the truth as the reference), log scale from "
              "1 (pale) to 1e6 (dark)",
    "eps": "the largest relative L2 difference of candidate vs reference among the cell's tensors, in units "
           "of the dtype's epsilon, log scale from 0.01 (pale) to 1e6 (dark)",
}  # fmt: skip
METRIC_KEYS = ("max_abs", "max_rel", "max_ulp", "p99_ulp", "rel_l2", "cosine", "ref_err_golden",
               "cand_err_golden", "bound", "ref_value", "cand_value")  # fmt: skip


def document(title: str, body: str) -> str:
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:\">"
        f"<title>{esc(title)}</title><style>{CSS}</style></head>\n<body>\n{body}\n<script>{JS}</script></body></html>\n"
    )


def _kv(pairs) -> str:
    return '<dl class="kv">' + "".join(f"<dt>{esc(k)}</dt><dd>{v}</dd>" for k, v in pairs) + "</dl>"


def _divergence(data: ScenarioData) -> str:
    s = data.summary
    if data.verdict == "error":
        errs = s.get("error") or {}
        return "<h2>Run failure</h2>" + "".join(
            f"<p><b>{esc(role)}</b></p><pre>{esc(msg)}</pre>" for role, msg in errs.items()
        )
    fd = s.get("first_divergence")
    if not fd:
        return "<h2>First divergence</h2><p>None: every comparison holds.</p>"
    m = fd.get("metrics") or {}
    pairs = [("step", esc(fd.get("step"))), ("phase", esc(fd.get("phase"))), ("kind", esc(fd.get("kind"))),
             ("tensor", f"<code>{esc(fd.get('tensor'))}</code>"), ("ranks", esc(fd.get("ranks"))),
             ("region", esc(region_text(fd) or "\u2013")),
             ("signature", f"<b>{esc(fd.get('signature'))}</b>: {esc(_explain(fd))}")]  # fmt: skip
    for extra in ("permutation", "norm_ratio"):
        if fd.get(extra) is not None:
            pairs.append(
                (extra, esc(json.dumps(fd[extra]) if isinstance(fd[extra], dict) else fmt(fd[extra])))
            )
    metrics = [(k, esc(fmt(m[k], 6))) for k in METRIC_KEYS if m.get(k) is not None]
    return (f'<h2>First divergence</h2><p class="mono" id="divergence">{esc(divergence_line(s))}</p>'
            + _kv(pairs) + ("<h3>Metrics</h3>" + _kv(metrics) if metrics else ""))  # fmt: skip


def _explain(fd: dict) -> str:
    if fd.get("explanation"):
        return str(fd["explanation"])
    from harness.localize import SIGNATURES

    return SIGNATURES.get(fd.get("signature"), "")


def _where(data: ScenarioData) -> str:
    fd = data.summary.get("first_divergence")
    if not fd:
        return ""
    pic = blocks.picture(data)
    if pic is None:
        why = {"input": "sample ids have no shards", "scalar": "a scalar", "loss": "a per-sample loss"}.get(
            fd.get("kind"), "no sharded layout recorded for it in the candidate trace"
        )
        return f"<h2>Where in the tensor</h2><p>No shard picture: <code>{esc(fd.get('tensor'))}</code> is {esc(why)}.</p>"
    note = f"<p>{esc(pic.note)}</p>" if pic.note else ""
    return ("<h2>Where in the tensor</h2><p class=\"small\">Logical tensor cut into its (TP, GTP) shard blocks as "
            "the candidate holds them; red: the block holding the worst element or faulty region; hatched: GTP "
            "pad rows; dot: the worst element.</p>" + svg.blocks_svg(pic) + note)  # fmt: skip


def _curves(data: ScenarioData) -> str:
    charts = [svg.line_chart("reduced loss", step_series(data.steps, "reduced_loss")),
              svg.line_chart("grad norm", step_series(data.steps, "grad_norm")),
              svg.line_chart("learning rate (applied)", step_series(data.steps, "lr"))]  # fmt: skip
    drift_chart = svg.line_chart("max error vs golden (log)", drift(data.results), log_y=True, width=420)
    return ('<h2>Per-step scalars</h2><div class="charts">' + "".join(charts) + "</div>"
            + "<h2>Drift against the golden</h2><p class=\"small\">Per step, the largest absolute error of any "
            "compared tensor against the golden run, for each side.</p>" + drift_chart)  # fmt: skip


def _invariants(data: ScenarioData) -> str:
    inv = data.summary.get("invariants") or {}
    items = [(name, v) for name, vs in inv.items() for v in vs]
    if not items:
        return ""
    lis = "".join(f"<li>{esc(name)}: step {esc(v.get('step'))} {esc(v.get('kind'))} <code>{esc(v.get('tensor'))}"
                  f"</code> {esc({k: x for k, x in v.items() if k not in ('step', 'kind', 'tensor')})}</li>"
                  for name, v in items[:50])  # fmt: skip
    more = f"<p>... and {len(items) - 50} more</p>" if len(items) > 50 else ""
    return f'<h2>Invariant violations in the candidate ({len(items)})</h2><ul class="mono">{lis}</ul>{more}'


def _cell(key: str, value) -> str:
    if key in TEXT_COLUMNS or value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        text = "ok" if value is True else "FAIL" if value is False else fmt(value)
        return f'<td class="t">{esc(text)}</td>' if key in TEXT_COLUMNS else f"<td>{esc(text)}</td>"
    v = "NaN" if isinstance(value, float) and math.isnan(value) else repr(value)
    return f'<td data-v="{esc(v)}" title="{esc(v)}">{esc(fmt(value))}</td>'


def results_table(results: list[dict]) -> str:
    kinds = sorted({str(r.get("kind")) for r in results})
    head = "".join(f'<th class="t">{esc(t)}</th>' if k in TEXT_COLUMNS else f"<th>{esc(t)}</th>"
                   for k, t in TABLE_COLUMNS)  # fmt: skip
    rows = []
    for r in results:
        ok = r.get("passed") is not False
        cells = "".join(_cell(k, r.get(k)) for k, _ in TABLE_COLUMNS)
        rows.append(f'<tr data-kind="{esc(r.get("kind"))}" data-passed="{int(ok)}"'
                    f'{"" if ok else " class=\"failed\""}>{cells}</tr>')  # fmt: skip
    options = "".join(f'<option value="{esc(k)}">{esc(k)}</option>' for k in kinds)
    return (f"<h2>Every comparison ({len(results)})</h2><div class=\"controls\">"
            '<input id="filter" type="search" placeholder="filter: words in any column" size="40">'
            f'<select id="kind"><option value="">all kinds</option>{options}</select>'
            '<label><input id="failing" type="checkbox"> failing only</label><span id="count" class="small"></span>'
            f'</div><table id="results"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>')  # fmt: skip


def _provenance(data: ScenarioData) -> str:
    s = data.summary
    cfg = s.get("config") or {}
    pairs = [("scenario", esc(data.name)), ("source", esc(cfg.get("source", "\u2013"))),
             ("description", esc(cfg.get("description") or "\u2013")),
             ("policy", esc(", ".join(f"{k} {v}" for k, v in (s.get("policy") or {}).items()) or "\u2013")),
             ("matrix axes", esc(", ".join(f"{k} = {v}" for k, v in (s.get("axes") or {}).items()) or "\u2013")),
             ("checked", esc(", ".join(f"{k} {v}" for k, v in sorted((s.get("checked") or {}).items())) or "\u2013"))]  # fmt: skip
    head = "".join(f'<th class="t">{h}</th>' for h in ("side", "label", "mesh (tp, gtp, dp)", "world", "python",
                                                       "torch", "megatron-core", "transformer-engine", "trace"))  # fmt: skip
    rows = []
    for role in ROLES:
        man = data.manifests.get(role, {})
        mesh = man.get("mesh") or {}
        ver = man.get("versions") or {}
        cells = [role, cfg.get(role, man.get("side", "\u2013")),
                 f"{mesh.get('tp', '?')}, {mesh.get('gtp', '?')}, {mesh.get('dp', '?')}" if mesh else "\u2013",
                 man.get("world_size", "\u2013"), *(ver.get(k) or "\u2013" for k in
                 ("python", "torch", "megatron-core", "transformer-engine")),
                 (s.get("traces") or {}).get(role) or "\u2013"]  # fmt: skip
        rows.append("<tr>" + "".join(f'<td class="t">{esc(c)}</td>' for c in cells) + "</tr>")
    return ("<h2>Scenario, topology and versions</h2>" + _kv(pairs)
            + f'<table class="prov"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>')  # fmt: skip


def render_scenario(data: ScenarioData) -> str:
    """The whole page of one scenario."""
    parts = [f"<h1>{esc(data.name)}</h1>",
             f'<p class="verdict {esc(data.verdict)}" id="verdict">{esc(verdict_line(data))}</p>',
             _divergence(data)]  # fmt: skip
    if data.verdict != "error":
        hm = heatmap(data.results)
        parts += [_where(data), _curves(data), "<h2>Error by layer, kind and step</h2>"
                  + f'<p class="small">One column per step within each kind; colour: {HEAT_NOTES[hm.unit]}; grey: '
                  "bitwise equal to the reference; outlined: a comparison in the cell fails. Hover a cell for "
                  "its worst tensor.</p>" + (svg.heatmap_svg(hm) if hm.cells else "<p>No tensor comparisons.</p>"),
                  _invariants(data), results_table(data.results)]  # fmt: skip
    parts.append(_provenance(data))
    return document(f"{data.verdict.upper()} {data.name} - gtp-parity", "\n".join(p for p in parts if p))
