"""The campaign's HTML page: scores per operator and file, and a source view of every mutated
line marked killed, survived, crashed or timeout (self-contained, every string escaped)."""

from __future__ import annotations

from collections import defaultdict
from html import escape
from pathlib import Path

COLOURS = {"killed": "#2e7d32", "crashed": "#6a1b9a", "timeout": "#ef6c00", "survived": "#c62828",
           "equivalent": "#757575", "unreachable": "#9e9e9e"}
CSS = ("body{font:14px sans-serif;margin:1.5em}table{border-collapse:collapse;margin:.5em 0}"
       "td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}pre{margin:0}"
       ".src td{font:12px monospace;vertical-align:top}.m{color:#fff;border-radius:3px;padding:0 4px;"
       "margin-right:3px;white-space:nowrap}")


def _score_table(title: str, rows: dict) -> str:
    head = "".join(f"<th>{h}</th>" for h in ("", "total", *COLOURS, "score", "score where reached"))
    body = "".join(
        f"<tr><td>{escape(str(k))}</td><td>{v['total']}</td>"
        + "".join(f"<td>{v.get(s, 0)}</td>" for s in COLOURS)
        + "".join(f"<td>{'-' if v.get(k) is None else f'{v[k]:.1%}'}</td>"
                  for k in ("score", "score_reached"))
        + "</tr>"
        for k, v in rows.items()
    )
    return f"<h2>{escape(title)}</h2><table><tr>{head}</tr>{body}</table>"


def _badge(m: dict) -> str:
    where = m.get("first_divergence") or {}
    title = (f"{m['id']} [{m['operator']}] {m['function']}: {m['original']!r} -> {m['replacement']!r}; "
             f"{m['status']}" + (f"; first divergence {where.get('kind')} {where.get('tensor')} "
                                 f"{where.get('signature')}" if where else "")
             + (f"; {m['reason']}" if m.get("reason") else ""))
    return (f'<span class="m" style="background:{COLOURS.get(m["status"], "#000")}" '
            f'title="{escape(title, quote=True)}">{escape(m["id"])} {escape(m["status"])}</span>')


def _source_view(module: str, mutants: list[dict]) -> str:
    path = mutants[0]["file"]
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError:
        lines = []
    by_line = defaultdict(list)
    for m in mutants:
        by_line[m["line"]].append(m)
    rows = "".join(
        f"<tr><td>{n}</td><td><pre>{escape(lines[n - 1] if 0 < n <= len(lines) else '')}</pre></td>"
        f"<td>{''.join(_badge(m) for m in by_line[n])}</td></tr>"
        for n in sorted(by_line)
    )
    return f"<h3>{escape(module)}</h3><p>{escape(path)}</p><table class='src'>{rows}</table>"


def _stages(stages: list[dict]) -> str:
    """The matrix stage by stage: mutants still undetected, and those of them the stage's clean
    sides ran the lines of (the only ones launched there)."""
    if not stages:
        return ""
    rows = "".join(f"<tr><td>{escape(st['scenario'])}</td><td>{st['alive']}</td><td>{st['ran']}"
                   f"{'' if st['lines_recorded'] else ' (lines not recorded)'}</td>"
                   f"<td>{st['seconds']:.0f}</td></tr>" for st in stages)
    return ("<h2>Stages</h2><table><tr><th>scenario</th><th>undetected</th><th>run (reach its lines)</th>"
            f"<th>s</th></tr>{rows}</table>")


def write(doc: dict, out: Path) -> Path:
    s = doc["score"]
    loc = s["localization"]
    by_module = defaultdict(list)
    for m in doc["mutants"]:
        by_module[m["module"]].append(m)
    overall = s["overall"]
    score = "-" if overall["score"] is None else f"{overall['score']:.1%}"
    accuracy = "-" if loc["accuracy"] is None else f"{loc['accuracy']:.1%}"
    head = (f"<h1>Mutation campaign</h1><p>{overall['total']} mutants over {len(by_module)} file(s), "
            f"matrix: {escape(', '.join(doc['scenarios']))}. Score killed / (total - equivalent): "
            f"<b>{score}</b>; localization "
            f"accuracy of killed mutants: <b>{accuracy}</b> "
            f"({loc['localized']} / {loc['killed']}); per mutant {doc['timing']['per_mutant_s']:.1f} s.</p>")
    body = (head + _stages(doc.get("stages", [])) + _score_table("Per operator", s["operator"])
            + _score_table("Per file", s["file"])
            + "<h2>Source</h2>" + "".join(_source_view(k, v) for k, v in sorted(by_module.items())))
    page = out / "index.html"
    page.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>gtp-parity mutate</title>"
                    f"<style>{CSS}</style></head><body>{body}</body></html>", encoding="utf-8")
    return page
