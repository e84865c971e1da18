"""Where the divergent tensor's error sits: its (TP, GTP) shard blocks as data.

The logical tensor is drawn as rows x columns in *padded* coordinates: each TP block of
dim 0 (or the whole tensor when TP cuts dim 1) is extended by the GTP pad rows megatron-core
adds at its tail, then cut into G blocks. Each block knows the ranks that hold it, how many of
its rows are padding, and whether it holds the worst element or the faulty region. Layouts
are read from the candidate trace's rank indexes (plain JSON, the ``Layout.to_json`` form).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from harness.report.model import ScenarioData
from harness.compare.summary import Region


@dataclass(frozen=True, slots=True)
class Block:
    """One shard block, in drawn (padded) element coordinates, half-open."""

    row0: int
    row1: int
    col0: int
    col1: int
    tp: int
    gtp: int
    ranks: tuple[int, ...]
    pad_rows: int
    """Rows at the block's tail that are GTP padding."""
    marked: bool
    """Holds the worst element or the faulty region."""


@dataclass(slots=True)
class Picture:
    tensor: str
    logical_shape: tuple[int, ...]
    rows: int
    cols: int
    placements: dict[str, str]
    pads: dict[str, int]
    blocks: list[Block] = field(default_factory=list)
    worst: tuple[int, int] | None = None
    """Drawn (row, col) of the worst element."""
    region: tuple[int, int, int, int] | None = None
    """Drawn (row0, row1, col0, col1) of a faulty region (pad rows that leaked)."""
    note: str = ""


def find_layout(trace_dir: Path, step: int, kind: str, name: str) -> dict | None:
    """The layout JSON of a tensor in a trace; a sharded one of the same parameter if the
    tensor itself is replicated (materialized weights are whole on every rank)."""
    exact, sharded = None, None
    for index in sorted(Path(trace_dir).glob("rank*/index.json")):
        for e in json.loads(index.read_text()).get("tensors", []):
            layout = e.get("layout")
            if e.get("name") != name or not layout:
                continue
            if (e.get("step"), e.get("kind")) == (step, kind) and exact is None:
                exact = layout
            if (
                sharded is None
                and e.get("kind") in ("param", "param_before", "main_grad")
                and _sharded(layout)
            ):
                sharded = layout
        if exact is not None and (_sharded(exact) or sharded is not None):
            break
    if exact is not None and _sharded(exact):
        return exact
    return sharded or exact


def _sharded(layout: dict) -> bool:
    return any(str(p).startswith("S(") and layout.get("mesh", {}).get(a, 1) > 1
               for a, p in layout.get("placements", {}).items())


def _shard_dim(layout: dict, axis: str) -> int | None:
    m = re.fullmatch(r"S\((-?\d+)\)", str(layout.get("placements", {}).get(axis, "R")))
    if not m or layout.get("mesh", {}).get(axis, 1) <= 1:
        return None
    return int(m.group(1)) % max(1, len(layout["logical_shape"]))


def picture(data: ScenarioData) -> Picture | None:
    """The shard picture of the first divergence, or None when there is nothing to draw."""
    fd = data.summary.first_divergence
    trace = data.trace_dirs.get("candidate")
    if fd is None or trace is None or fd.kind in ("input", "scalar", "loss", "eval", "raised"):
        return None
    layout = find_layout(trace, fd.step, fd.kind, fd.tensor)
    if layout is None or not 1 <= len(layout["logical_shape"]) <= 2:
        return None
    coords = {int(r): c for r, c in (data.manifests.get("candidate", {}).get("coords") or {}).items()}
    return build(str(fd.tensor), layout, coords, fd.region, fd.permutation)


def build(
    tensor: str, layout: dict, coords: dict[int, dict], region: Region | dict, permutation: dict | None = None
) -> Picture:
    """Blocks of a logical tensor under ``layout``; mark what ``region`` names."""
    shape = tuple(int(n) for n in layout["logical_shape"])
    R, C = shape[0], (math.prod(shape[1:]) if len(shape) > 1 else 1)
    mesh = layout.get("mesh", {})
    tp_dim, gtp_dim = _shard_dim(layout, "tp"), _shard_dim(layout, "gtp")
    tp = mesh.get("tp", 1) if tp_dim is not None else 1
    g = mesh.get("gtp", 1) if gtp_dim is not None else 1
    pad = int(layout.get("pads", {}).get("gtp", 0)) if g > 1 else 0
    row_split = tp if tp_dim == 0 else 1
    L = R // row_split  # logical rows of one TP block of dim 0
    col_w = C // tp if tp_dim not in (None, 0) else C
    chunk = (L + pad) // g
    region = region if isinstance(region, Region) else Region.from_json(region)
    shard = region.shard
    if not shard and region.rank is not None and region.rank in coords:
        shard = {a: coords[region.rank].get(a) for a in ("tp", "gtp")}
    named = set(region.ranks or ([region.rank] if region.rank is not None else []))
    pic = Picture(tensor=tensor, logical_shape=shape, rows=row_split * (L + pad), cols=C,
                  placements=dict(layout.get("placements", {})),
                  pads=dict(layout.get("pads", {})))
    for i in range(tp):
        for j in range(g):
            top = (i * (L + pad) if tp_dim == 0 else 0) + j * chunk
            left = i * col_w if tp_dim not in (None, 0) else 0
            ranks = tuple(sorted(r for r, c in coords.items()
                                 if (tp == 1 or c.get("tp") == i)
                                 and (g == 1 or c.get("gtp") == j)))
            pad_rows = max(0, min((j + 1) * chunk, L + pad) - max(j * chunk, L))
            hit = (
                (shard.get("tp", i) == i and shard.get("gtp", j) == j)
                if shard
                else (bool(named) and set(ranks) <= named and len(named) < len(coords))
            )
            pic.blocks.append(Block(top, top + chunk, left, left + col_w, i, j, ranks, pad_rows, hit))
    idx = region.worst_index
    if idx:
        r = int(idx[0])
        c = int(idx[1]) if len(idx) > 1 else 0
        pic.worst = ((r // L) * (L + pad) + r % L if tp_dim == 0 else r, c)
    if region.rows is not None:
        lo, hi = (int(x) for x in region.rows)
        i = shard.get("tp", 0) if tp > 1 else 0
        base = i * (L + pad) if tp_dim == 0 else 0
        left = i * col_w if tp_dim not in (None, 0) else 0
        pic.region = (base + lo, base + hi, left, left + col_w)
    if permutation:
        order = permutation.get("permutation")
        pic.note = f"the candidate holds the {permutation.get('blocks')} blocks in the order {order}"
    return pic
