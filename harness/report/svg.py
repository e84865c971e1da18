"""Inline SVG views: line charts, the error heatmap and the shard-block picture.

Every function returns an ``<svg>`` string with no external reference; every text from a
trace goes through :func:`esc`. Hover titles carry exact values.
"""

from __future__ import annotations

import math
from html import escape

from harness.report.blocks import Picture
from harness.report.model import Heatmap, fmt

COLORS = {"reference": "#1f5fbf", "candidate": "#d9480f", "golden": "#444",
          "candidate vs golden": "#d9480f", "reference vs golden": "#1f5fbf"}
DASHES = {"golden": "2 3", "reference vs golden": "5 3"}


def esc(text) -> str:
    return escape(str(text), quote=True)


def text(x: float, y: float, content: str, anchor: str = "start", cls: str = "tick") -> str:
    """An SVG text element; ``content`` is escaped."""
    return f'<text x="{x:.1f}" y="{y:.1f}" class="{cls}" text-anchor="{anchor}">{esc(content)}</text>'


def _ticks(lo: float, hi: float, n: int = 4) -> list[float]:
    if hi <= lo:
        return [lo]
    return [lo + (hi - lo) * k / n for k in range(n + 1)]


def line_chart(
    title: str,
    series: dict[str, list[tuple[float, float]]],
    log_y: bool = False,
    width: int = 340,
    height: int = 200,
) -> str:
    """Lines of (x, y) points, one per series, with a legend; log_y drops y <= 0."""
    left, right, top, bottom = 62, 10, 22, 44
    pts = {k: [(x, y) for x, y in v if math.isfinite(y) and (y > 0 or not log_y)] for k, v in series.items()}
    pts = {k: v for k, v in pts.items() if v}
    out = [f'<svg class="chart" role="img" width="{width}" height="{height}" viewBox="0 0 {width} {height}">',
           f'<title>{esc(title)}</title><text x="{left}" y="14" class="ct">{esc(title)}</text>']
    if not pts:
        out.append(f'<text x="{left}" y="{height // 2}" class="muted">no data</text></svg>')
        return "".join(out)
    xs = [x for v in pts.values() for x, _ in v]
    ys = [math.log10(y) if log_y else y for v in pts.values() for _, y in v]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if y1 - y0 < 1e-12 * max(1.0, abs(y1)):
        y0, y1 = (
            y0 - (1 if log_y else max(abs(y0) * 1e-3, 1e-12)),
            y1 + (1 if log_y else max(abs(y1) * 1e-3, 1e-12)),
        )
    w, h = width - left - right, height - top - bottom

    def sx(x):
        return left + (w * (x - x0) / (x1 - x0) if x1 > x0 else w / 2)

    def sy(y):
        return top + h - h * ((math.log10(y) if log_y else y) - y0) / (y1 - y0)

    out.append(f'<rect x="{left}" y="{top}" width="{w}" height="{h}" class="frame"/>')
    if log_y:
        y0, y1 = math.floor(y0), math.ceil(y1)
        step = max(1, math.ceil((y1 - y0) / 5))
        ticks = [float(e) for e in range(int(y0), int(y1) + 1, step)]
    else:
        ticks = _ticks(y0, y1)
    for t in ticks:
        yy = top + h - h * (t - y0) / (y1 - y0)
        label = f"1e{int(t)}" if log_y else f"{t:.6g}"
        out.append(f'<line x1="{left}" x2="{left + w}" y1="{yy:.1f}" y2="{yy:.1f}" class="grid"/>')
        out.append(text(left - 4, yy + 4, label, "end"))
    for x in sorted(set(xs)):
        out.append(text(sx(x), top + h + 14, fmt(int(x)), "middle"))
    out.append(text(left + w / 2, top + h + 27, "step", "middle"))
    for k, (label, v) in enumerate(pts.items()):
        color, dash = COLORS.get(label, "#777"), DASHES.get(label, "")
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in v)
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.6"'
                   + (f' stroke-dasharray="{dash}"' if dash else "") + "/>")
        for x, y in v:
            out.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="{3.2 - k * 0.6:.1f}" fill="{color}">'
                       f"<title>{esc(label)} step {fmt(int(x))}: {y!r}</title></circle>")
        lx = left + k * (w // max(1, len(pts)))
        out.append(f'<rect x="{lx}" y="{height - 11}" width="10" height="3" fill="{color}"/>'
                   f'<text x="{lx + 13}" y="{height - 6}" class="tick">{esc(label)}</text>')
    out.append("</svg>")
    return "".join(out)


def heat_color(value: float, lo: float = -2.0, hi: float = 6.0) -> str:
    """Grey for 0 (bitwise equal), then pale yellow (10^lo) to dark red (10^hi), log scale."""
    if value <= 0:
        return "#e4e4e4"
    t = 1.0 if not math.isfinite(value) else min(1.0, max(0.0, (math.log10(value) - lo) / (hi - lo)))
    r, g, b = 255, int(240 - 200 * t), int(170 - 150 * t)
    return f"rgb({r - int(90 * t * t)},{g},{b})"


def heatmap_svg(hm: Heatmap) -> str:
    """Rows: layers; columns: kind groups, one column per step; outlined cells fail."""
    cw, ch, left, top = 22, 18, 92, 40
    ncols = len(hm.groups) * len(hm.steps)
    gap = 10
    width = left + ncols * cw + gap * max(0, len(hm.groups) - 1) + 10
    height = top + len(hm.layers) * ch + 8
    out = [f'<svg class="heat" role="img" width="{width}" height="{height}" viewBox="0 0 {width} {height}">'
           "<title>error by layer, kind and step</title>"]
    for gi, group in enumerate(hm.groups):
        gx = left + gi * (len(hm.steps) * cw + gap)
        out.append(f'<text x="{gx}" y="14" class="tick">{esc(group)}</text>')
        for si, step in enumerate(hm.steps):
            x = gx + si * cw
            out.append(
                f'<text x="{x + cw / 2}" y="{top - 6}" class="tick" text-anchor="middle">{step}</text>'
            )
            for li, layer in enumerate(hm.layers):
                y = top + li * ch
                cell = hm.cells.get((layer, group, step))
                if cell is None:
                    continue
                cls = ' class="bad"' if cell.failed else ""
                color = heat_color(cell.value, *((0.0, 6.0) if hm.unit == "golden" else (-2.0, 6.0)))
                what = "error vs golden / reference's" if hm.unit == "golden" else "rel L2 in eps"
                out.append(
                    f'<rect x="{x}" y="{y}" width="{cw - 2}" height="{ch - 2}" fill="{color}"{cls}>'
                    f"<title>{esc(layer)} {esc(group)} step {step}: {what} {fmt(cell.value, 3)} (worst "
                    f"{esc(cell.worst)}); {cell.failed} of {cell.count} fail</title></rect>"
                )
    for li, layer in enumerate(hm.layers):
        out.append(text(left - 6, top + li * ch + 13, layer, "end"))
    out.append("</svg>")
    return "".join(out)


def blocks_svg(pic: Picture, max_side: int = 260) -> str:
    """The logical tensor as its shard blocks: marked block red, pad rows hatched."""
    rows, cols = max(1, pic.rows), max(1, pic.cols)
    scale = min(max_side / rows, max_side / cols)
    sy_ = max(scale, 60 / rows)  # keep thin tensors visible
    sx_ = max(scale, 60 / cols)
    w, h = cols * sx_, rows * sy_
    left, top = 10, 10
    width, height = int(left + w + 170), int(top + h + 20)
    out = [f'<svg class="blocks" role="img" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}"><title>shard blocks of {esc(pic.tensor)}</title>',
           '<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
           'patternTransform="rotate(45)"><rect width="6" height="6" fill="#fff"/>'
           '<line x1="0" y1="0" x2="0" y2="6" stroke="#999" stroke-width="2"/></pattern></defs>']
    for b in pic.blocks:
        x, y = left + b.col0 * sx_, top + b.row0 * sy_
        bw, bh = (b.col1 - b.col0) * sx_, (b.row1 - b.row0) * sy_
        fill, cls = ("#f7c6c0", "marked") if b.marked else ("#dfe8f5", "block")
        pads = f", {b.pad_rows} pad rows" if b.pad_rows else ""
        out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{bw:.1f}" height="{bh:.1f}" fill="{fill}" '
                   f'stroke="#333" class="{cls}"><title>TP {b.tp}, GTP {b.gtp}: ranks {list(b.ranks)}, '
                   f"rows {b.row0}-{b.row1}{pads}</title></rect>")
        if b.pad_rows:
            py = y + bh - b.pad_rows * sy_
            out.append(f'<rect x="{x:.1f}" y="{py:.1f}" width="{bw:.1f}" height="{b.pad_rows * sy_:.1f}" '
                       'fill="url(#hatch)" stroke="#333" class="pad">'
                       "<title>GTP pad rows</title></rect>")
        label = f"tp{b.tp} gtp{b.gtp}: r{','.join(map(str, b.ranks))}"
        out.append(text(x + 3, y + 12, label))
    if pic.region is not None:
        r0, r1, c0, c1 = pic.region
        out.append(f'<rect x="{left + c0 * sx_:.1f}" y="{top + r0 * sy_:.1f}" '
                   f'width="{(c1 - c0) * sx_:.1f}" height="{(r1 - r0) * sy_:.1f}" fill="none" '
                   'stroke="#c00" stroke-width="2.5" class="region">'
                   f"<title>faulty rows {r0}-{r1}</title></rect>")
    if pic.worst is not None:
        cx, cy = left + (pic.worst[1] + 0.5) * sx_, top + (pic.worst[0] + 0.5) * sy_
        where = f"drawn row {pic.worst[0]}, column {pic.worst[1]}"
        out.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="4" fill="#c00" stroke="#fff" class="worst">'
                   f"<title>worst element ({where})</title></circle>")
    tx = left + w + 12
    legend = [f"logical {list(pic.logical_shape)}",
              "placements " + ", ".join(f"{a} {p}" for a, p in sorted(pic.placements.items())),
              "GTP pad rows " + str(pic.pads.get("gtp", 0))]
    for k, line in enumerate(legend):
        out.append(text(tx, top + 12 + 16 * k, line))
    out.append("</svg>")
    return "".join(out)
