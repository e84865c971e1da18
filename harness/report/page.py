"""The scenario page: one self-contained HTML file (inline CSS, JS and SVG only).

Sections, top to bottom: the verdict; the first divergence with its signature explained;
where in the logical tensor it sits (shard blocks); loss, grad norm and LR per step for the
three sides; drift of the error against the golden; the error heatmap; invariant violations;
every comparison in a sortable, filterable table; the scenario, topology and versions.
"""

from __future__ import annotations

import json
import math

from harness.report.blocks import picture
from harness.compare.summary import Verdict
from harness.scenario import COMPARED_ROLES
from harness.report.model import (
    ScenarioData,
    divergence_line,
    drift,
    fmt,
    heatmap,
    region_text,
    step_series,
    verdict_line,
)
from harness.compare.summary import FirstDivergence
from harness.report.svg import blocks_svg, esc, heatmap_svg, line_chart

TABLE_COLUMNS = [
    ("step", "step"), ("phase", "phase"), ("kind", "kind"), ("tensor", "tensor"), ("passed", "ok"),
    ("expectation", "expectation"), ("expectation_reason", "why"), ("policy", "policy"), ("dtype", "dtype"),
        ("shape", "shape"), ("max_abs", "max abs"),
    ("max_rel", "max rel"), ("max_ulp", "max ULP"), ("p99_ulp", "p99 ULP"), ("rel_l2", "rel L2"),
    ("cosine", "cosine"), ("mismatched", "mismatched"), ("ref_err_golden", "ref err vs golden"),
    ("cand_err_golden", "cand err vs golden"), ("bound", "bound"), ("bound_on", "bound on"),
    ("worst_index", "worst index"),
]
TEXT_COLUMNS = {"phase", "kind", "tensor", "expectation", "expectation_reason", "policy", "dtype", "shape",
                "worst_index", "bound_on"}
HEAT_NOTES = {
    "golden": "the largest ratio, among the cell's tensors, of the candidate's error against the golden to "
              "the reference's (1: the candidate is as close to the truth as the reference), log scale from "
              "1 (pale) to 1e6 (dark)",
    "eps": "the largest relative L2 difference of candidate vs reference among the cell's tensors, in units "
           "of the dtype's epsilon, log scale from 0.01 (pale) to 1e6 (dark)",
}
METRIC_KEYS = ("max_abs", "max_rel", "max_ulp", "p99_ulp", "rel_l2", "cosine", "ref_err_golden",
               "cand_err_golden", "bound", "ref_value", "cand_value")


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
    if data.verdict == Verdict.ERROR:
        return "<h2>Run failure</h2>" + "".join(
            f"<p><b>{esc(role)}</b></p><pre>{esc(msg)}</pre>" for role, msg in s.error.items()
        )
    fd = s.first_divergence
    if fd is None:
        return "<h2>First divergence</h2><p>None: every comparison holds.</p>"
    pairs = [("step", esc(fd.step)), ("phase", esc(fd.phase)), ("kind", esc(fd.kind)),
             ("tensor", f"<code>{esc(fd.tensor)}</code>"), ("ranks", esc(fd.ranks)),
             ("region", esc(region_text(fd) or "\u2013")),
             ("signature", f"<b>{esc(fd.signature)}</b>: {esc(_explain(fd))}")]
    if fd.permutation is not None:
        pairs.append(("permutation", esc(json.dumps(fd.permutation))))
    if fd.norm_ratio is not None:
        pairs.append(("norm_ratio", esc(fmt(fd.norm_ratio))))
    metrics = [(k, esc(fmt(fd.metrics[k], 6))) for k in METRIC_KEYS if k in fd.metrics]
    if fd.extra.get("bound_on") and "bound" in fd.metrics:
        metrics.append(("bound on", esc(fd.extra["bound_on"])))
    return (f'<h2>First divergence</h2><p class="mono" id="divergence">{esc(divergence_line(s))}</p>'
            + _kv(pairs) + ("<h3>Metrics</h3>" + _kv(metrics) if metrics else ""))


def _explain(fd: FirstDivergence) -> str:
    if fd.explanation:
        return str(fd.explanation)
    from harness.compare.localize import SIGNATURES

    return SIGNATURES.get(fd.signature, "")


NO_PICTURE = {"input": "sample ids have no shards", "scalar": "a scalar", "loss": "a per-sample loss",
              "eval": "an evaluation's loss", "raised": "an exception of the code under test"}
PICTURE_NOTE = ('<p class="small">The logical tensor cut into its (TP, GTP) shard blocks as the candidate '
                "holds them; red: the block holding the worst element or the faulty region; hatched: GTP pad "
                "rows; dot: the worst element.</p>")
DRIFT_NOTE = ('<p class="small">Per step, the largest RMS error of any compared tensor against the '
              "golden run, for each side.</p>")
HEAT_NOTE = ('<p class="small">One column per step within each kind; colour: {unit}; grey: bitwise equal '
             "to the reference; outlined: a comparison in the cell fails. Hover a cell for its worst "
             "tensor.</p>")
NONE = "\u2013"


def _where(data: ScenarioData) -> str:
    fd = data.summary.first_divergence
    if fd is None:
        return ""
    pic = picture(data)
    head = "<h2>Where in the tensor</h2>"
    if pic is None:
        why = NO_PICTURE.get(fd.kind, "without a sharded layout in the candidate trace")
        return f"{head}<p>No shard picture: <code>{esc(fd.tensor)}</code> is {esc(why)}.</p>"
    note = f"<p>{esc(pic.note)}</p>" if pic.note else ""
    return head + PICTURE_NOTE + blocks_svg(pic) + note


def _curves(data: ScenarioData) -> str:
    charts = [
        line_chart("reduced loss", step_series(data.steps, "reduced_loss")),
        line_chart("grad norm", step_series(data.steps, "grad_norm")),
        line_chart("learning rate (applied)", step_series(data.steps, "lr")),
    ]
    drift_chart = line_chart("max RMS error vs golden (log)", drift(data.results), log_y=True, width=420)
    return (f'<h2>Per-step scalars</h2><div class="charts">{"".join(charts)}</div>'
            f"<h2>Drift against the golden</h2>{DRIFT_NOTE}{drift_chart}")


def _heatmap(data: ScenarioData) -> str:
    hm = heatmap(data.results)
    body = heatmap_svg(hm) if hm.cells else "<p>No tensor comparisons.</p>"
    return "<h2>Error by layer, kind and step</h2>" + HEAT_NOTE.format(unit=HEAT_NOTES[hm.unit]) + body


def _invariants(data: ScenarioData) -> str:
    items = [(name, v) for name, vs in data.summary.invariants.items() for v in vs]
    if not items:
        return ""
    lis = []
    for name, v in items[:50]:
        rest = {k: x for k, x in v.items() if k not in ("step", "kind", "tensor")}
        lis.append(f"<li>{esc(name)}: step {esc(v.get('step'))} {esc(v.get('kind'))} "
                   f"<code>{esc(v.get('tensor'))}</code> {esc(rest)}</li>")
    more = f"<p>... and {len(items) - 50} more</p>" if len(items) > 50 else ""
    title = f"<h2>Invariant violations in the candidate ({len(items)})</h2>"
    return f'{title}<ul class="mono">{"".join(lis)}</ul>{more}'


def _cell(key: str, value) -> str:
    if key in TEXT_COLUMNS or isinstance(value, bool) or not isinstance(value, (int, float)):
        text = "ok" if value is True else "FAIL" if value is False else fmt(value)
        return f'<td class="t">{esc(text)}</td>' if key in TEXT_COLUMNS else f"<td>{esc(text)}</td>"
    v = "NaN" if isinstance(value, float) and math.isnan(value) else repr(value)
    return f'<td data-v="{esc(v)}" title="{esc(v)}">{esc(fmt(value))}</td>'


def results_table(results: list[dict]) -> str:
    """Every comparison, one row each; the page's script sorts and filters it."""
    kinds = sorted({str(r.get("kind")) for r in results})
    head = "".join(f'<th class="t">{esc(t)}</th>' if k in TEXT_COLUMNS else f"<th>{esc(t)}</th>"
                   for k, t in TABLE_COLUMNS)
    rows = []
    for r in results:
        ok = r.get("passed") is not False
        cells = "".join(_cell(k, r.get(k)) for k, _ in TABLE_COLUMNS)
        cls = "" if ok else ' class="failed"'
        rows.append(f'<tr data-kind="{esc(r.get("kind"))}" data-passed="{int(ok)}"{cls}>{cells}</tr>')
    options = "".join(f'<option value="{esc(k)}">{esc(k)}</option>' for k in kinds)
    return "".join([
        f'<h2>Every comparison ({len(results)})</h2><div class="controls">',
        '<input id="filter" type="search" placeholder="filter: words in any column" size="40">',
        f'<select id="kind"><option value="">all kinds</option>{options}</select>',
        '<label><input id="failing" type="checkbox"> failing only</label>',
        '<span id="count" class="small"></span></div>',
        f'<table id="results"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>',
    ])


def _listing(items) -> str:
    return esc(", ".join(f"{k} {v}" for k, v in items) or NONE)


def _provenance(data: ScenarioData) -> str:
    s = data.summary
    cfg = s.config
    pairs = [
        ("scenario", esc(data.name)),
        ("source", esc(cfg.get("source", NONE))),
        ("description", esc(cfg.get("description") or NONE)),
        ("policy", _listing(s.policy.items())),
        ("matrix axes", _listing((k, f"= {v}") for k, v in s.axes.items())),
        ("checked", _listing(sorted(s.checked.items()))),
        ("judged by expectation", _listing(sorted(s.expectations.items()))),
    ]
    columns = ("side", "label", "mesh (tp, gtp, dp)", "world", "python", "torch", "megatron-core",
               "transformer-engine", "trace")
    head = "".join(f'<th class="t">{h}</th>' for h in columns)
    rows = []
    for role in COMPARED_ROLES:
        man = data.manifests.get(role, {})
        mesh = man.get("mesh") or {}
        ver = man.get("versions") or {}
        cells = [
            role,
            cfg.get(role, man.get("side", NONE)),
            ", ".join(str(mesh.get(a, "?")) for a in ("tp", "gtp", "dp")) if mesh else NONE,
            man.get("world_size", NONE),
            *(ver.get(k) or NONE for k in ("python", "torch", "megatron-core", "transformer-engine")),
            s.traces.get(role) or NONE,
        ]
        rows.append("<tr>" + "".join(f'<td class="t">{esc(c)}</td>' for c in cells) + "</tr>")
    table = f'<table class="prov"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
    return "<h2>Scenario, topology and versions</h2>" + _kv(pairs) + table


def render_scenario(data: ScenarioData) -> str:
    """The whole page of one scenario."""
    parts = [
        f"<h1>{esc(data.name)}</h1>",
        f'<p class="verdict {esc(data.verdict)}" id="verdict">{esc(verdict_line(data))}</p>',
        _divergence(data),
    ]
    if data.verdict != Verdict.ERROR:
        parts += [_where(data), _curves(data), _heatmap(data), _invariants(data), results_table(data.results)]
    parts.append(_provenance(data))
    return document(f"{data.verdict.upper()} {data.name} - gtp-parity", "\n".join(p for p in parts if p))


# --- the inline stylesheet and script (no external resource of any kind) ---------------------

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:1.2em 2em;color:#222;
max-width:1400px}
h1{font-size:1.45em;margin:.2em 0}h2{font-size:1.15em;margin:1.4em 0 .4em;border-bottom:1px solid #ddd}
code,pre,.mono{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12.5px}
pre{background:#f6f6f6;padding:.6em;overflow:auto;white-space:pre-wrap}
.verdict{font-size:1.1em;font-weight:600;padding:.5em .8em;border-radius:4px;margin:.4em 0}
.pass{background:#d3f0d8;color:#124d1f}.fail{background:#fbd5d0;color:#7a1408}.error{background:#fde9b8;color:#6b4a00}.known-divergence{background:#e6dcf7;color:#3d1f78}.skip{background:#e8e8e8;color:#444}.fixed{background:#d3ecf2;color:#0b4654}
dl.kv{display:grid;grid-template-columns:max-content 1fr;gap:.15em 1em;margin:.3em 0}dl.kv dt{color:#666}
dl.kv dd{margin:0}.charts{display:flex;flex-wrap:wrap;gap:1em}.muted{fill:#888;color:#888}
svg text.ct{font-weight:600;font-size:12px}svg text.tick{font-size:10.5px;fill:#444}
svg rect.frame{fill:none;stroke:#bbb}svg line.grid{stroke:#eee}svg rect.bad{stroke:#900;stroke-width:2}
table{border-collapse:collapse;font-size:12.5px}
th,td{padding:2px 7px;border-bottom:1px solid #eee;text-align:right;white-space:nowrap}
th{background:#f3f3f3;cursor:pointer;position:sticky;top:0;user-select:none}
td.t,th.t{text-align:left}tr.failed td{background:#fff1ef}th.sorted-asc::after{content:" \\25B2"}
th.sorted-desc::after{content:" \\25BC"}.controls{margin:.4em 0;display:flex;gap:1em;align-items:center}
.grid td,.grid th{text-align:center;border:1px solid #ddd;padding:6px 10px;white-space:normal}
.grid td.t{text-align:left}
.grid td a{color:inherit;text-decoration:none;display:block}.small{font-size:12px;color:#555}
.cell-verdict{font-weight:600;text-transform:uppercase}
"""

JS = """
(function(){
  var table=document.getElementById('results');
  if(!table){document.body.setAttribute('data-ready','1');return;}
  var body=table.tBodies[0], rows=Array.prototype.slice.call(body.rows);
  var q=document.getElementById('filter'), kind=document.getElementById('kind'),
      failing=document.getElementById('failing'), count=document.getElementById('count');
  function apply(){
    var words=q.value.toLowerCase().split(/\\s+/).filter(Boolean), shown=0;
    rows.forEach(function(r){
      var text=r.textContent.toLowerCase();
      var ok=words.every(function(w){return text.indexOf(w)>=0;})
        && (!kind.value || r.getAttribute('data-kind')===kind.value)
        && (!failing.checked || r.getAttribute('data-passed')==='0');
      r.style.display=ok?'':'none'; if(ok){shown++;}
    });
    count.textContent=shown+' of '+rows.length+' comparisons shown';
  }
  function key(td){var v=td.getAttribute('data-v');return v===null?td.textContent:parseFloat(v);}
  Array.prototype.forEach.call(table.tHead.rows[0].cells,function(th,i){
    th.addEventListener('click',function(){
      var asc=!th.classList.contains('sorted-asc');
      Array.prototype.forEach.call(table.tHead.rows[0].cells,function(c){c.classList.remove('sorted-asc','sorted-desc');});
      th.classList.add(asc?'sorted-asc':'sorted-desc');
      rows.sort(function(a,b){
        var x=key(a.cells[i]),y=key(b.cells[i]);
        if(typeof x==='number'&&typeof y==='number'){
          if(isNaN(x)){return isNaN(y)?0:1;} if(isNaN(y)){return -1;} return asc?x-y:y-x;}
        return asc?String(x).localeCompare(String(y)):String(y).localeCompare(String(x));
      });
      rows.forEach(function(r){body.appendChild(r);});
    });
  });
  var params=new URLSearchParams(location.hash.slice(1));
  if(params.get('q')){q.value=params.get('q');}
  if(params.get('kind')){kind.value=params.get('kind');}
  if(params.get('failing')==='1'){failing.checked=true;}
  [q,kind,failing].forEach(function(el){el.addEventListener('input',apply);el.addEventListener('change',apply);});
  apply();
  document.body.setAttribute('data-ready','1');
})();
"""
