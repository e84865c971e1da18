"""The campaign page, in the report's style: the clusters with their minimal scenario and the
settings they need, the pairs judged, the coverage reached and the time spent. Every string from
a trace or a scenario is escaped."""

from __future__ import annotations

from pathlib import Path

from harness.report.page import document
from harness.report.svg import esc


def _cluster_rows(doc: dict) -> str:
    rows = []
    for c in doc["clusters"]:
        ex = c.get("example") or {}
        status = f"known: {c['known']}" if c.get("known") else "new"
        shrink = c.get("shrink") or {}
        cut = "" if shrink.get("complete", True) else " (cut short by its budget)"
        rows.append(
            f"<tr class='failed'><td class='t'>{esc(c['id'])}</td><td "
            f"class='t'>{esc(' / '.join(c['fingerprint']))}"
            f"</td><td class='t'>{esc(c['pattern'])}</td><td class='t'>{esc(', '.join(c['needs']))}</td>"
            f"<td>{c['count']}</td><td class='t'>step {esc(ex.get('step'))} {esc(ex.get('phase'))}: "
            f"{esc(ex.get('explanation', ''))}</td><td class='t'>{esc(status)}</td>"
            f"<td class='t'><code>{esc(c['scenario_file'])}</code></td>"
            f"<td>{esc(shrink.get('runs'))} runs, {esc(shrink.get('seconds'))} s{esc(cut)}</td></tr>")
    head = "".join(f"<th class='t'>{h}</th>" for h in ("cluster", "fingerprint", "tensor", "needs", "pairs",
                                                       "first divergence", "status", "minimal scenario",
                                                       "shrink"))
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>" if rows else "<p>No finding.</p>"


def _judged_rows(doc: dict) -> str:
    rows = []
    for j in doc["judged"]:
        d = j["draw"]
        settings = ", ".join(f"{s}.{k}={v}" for s, k, v in d["settings"]) or "(defaults)"
        fp = " / ".join(j["fingerprint"])
        rows.append(f"<tr{' class=failed' if j['finding'] else ''}><td class='t'>{esc(j['name'])}</td>"
                    f"<td class='t'>{esc(d['axis'][0])}: {esc(d['axis'][1])} vs {esc(d['axis'][2])}</td>"
                    f"<td>{esc(d['world_size'])}</td><td class='t'>{esc(settings)}</td>"
                    f"<td class='t'>{esc(j['verdict'])}</td><td class='t'>{esc(fp)}</td>"
                    f"<td class='t'>{esc(j.get('cluster') or '')}</td></tr>")
    head = "".join(f"<th class='t'>{h}</th>" for h in ("pair", "axis", "world", "settings", "verdict",
                                                       "fingerprint", "cluster"))
    return f"<table id='results'><tr>{head}</tr>{''.join(rows)}</table>"


def write(doc: dict, path: Path) -> Path:
    ident, cov, tp = doc["identity"], doc["coverage"], doc["throughput"]
    refused = "".join(f"<li>{esc(r)}: {n}</li>" for r, n in list(doc["refused"].items())[:12])
    rate = "-" if tp["pairs_per_hour"] is None else f"{tp['pairs_per_hour']:.0f}"
    head = (
        f"<h1>gtp-parity fuzz</h1><p>seed {esc(ident['seed'])}, megatron-core {esc(ident['megatron_core'])}"
        f"{', faults ' + esc(', '.join(ident['inject'])) if ident['inject'] else ''}; space "
        f"{esc(doc['space']['source'])} ({esc(doc['space']['digest'])}, backend "
        f"{esc(doc['space']['backend'])})."
        f"</p><dl class='kv'><dt>pairs judged</dt><dd>{tp['pairs']}</dd><dt>clusters</dt>"
        f"<dd>{len(doc['clusters'])} ({sum(1 for c in doc['clusters'] if not c.get('known'))} new)</dd>"
        f"<dt>time</dt><dd>{doc['elapsed_s']:.0f} s, of which judging drawn pairs {doc['pair_s']:.0f} s "
        f"({rate} pairs an hour)</dd><dt>coverage</dt><dd>{cov['values']} of {cov['values_in_space']} "
        f"values, "
        f"{cov['pairs']} of at most {cov['pairs_in_space']} value pairs</dd></dl>")
    if doc.get("aimed"):  # a self-test's draws each started from one of these (harness/fuzz/reach.py)
        head += (f"<p>Draws aimed at the planted faults' reach: each started from one of "
                 f"{len(doc['aimed'])} seeds, e.g. {esc('; '.join(doc['aimed'][:4]))}.</p>")
    failed = "".join(f"<li>{esc(what)}: {len(pairs)} pair(s), {esc(', '.join(pairs[:5]))}</li>"
                     for what, pairs in doc.get("errors", {}).items())
    body = (head + "<h2>Clusters</h2>" + _cluster_rows(doc)
            + "<h2>Runs that failed</h2><ul>" + (failed or "<li>none</li>") + "</ul>"
            + f"<h2>Draws the rules refused</h2><ul>{refused or '<li>none</li>'}</ul>"
            + "<h2>Pairs</h2>" + _judged_rows(doc))
    path.write_text(document("gtp-parity fuzz", body), encoding="utf-8")
    return path
