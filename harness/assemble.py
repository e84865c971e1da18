"""Assemble: rebuild logical tensors from a trace's shards, offline.

Weights, gradients and optimizer state are rebuilt from their layouts (the rank holding each
shard found through the trace's mesh coordinates). Activations, logits and per-sample losses
are keyed by global sample id, so traces of different topologies line up sample by sample.

While assembling, two invariants of the trace itself are checked (each trace on its own):
``replica`` - a tensor declared Replicate on a mesh axis is bitwise equal on every rank of
that axis; ``padding`` - GTP pad rows of weights and gradients are zero.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import Replicate, Shard

from harness.errors import BadInput
from harness.layout import MESH_AXES, assemble, holds
from harness.mesh import on_grid
from harness.trace import Entry, Trace

SAMPLE_KINDS = ("activation", "logits")
PADDED_KINDS = ("param", "param_before", "main_grad", "master")


@dataclass
class Logical:
    """Every logical tensor of one trace."""

    tensors: dict[tuple[int, str, str], torch.Tensor] = field(default_factory=dict)
    """(step, kind, name) -> tensor, for layout-placed tensors (weights, grads, state)."""
    samples: dict[tuple[int, str, str], dict[int, torch.Tensor]] = field(default_factory=dict)
    """(step, kind, module) -> sample id -> that sample's tensor (activations, logits)."""
    inputs: dict[int, dict[int, list[int]]] = field(default_factory=dict)
    """step -> rank -> sample ids read, in order."""
    replica_violations: list[dict] = field(default_factory=list)
    padding_violations: list[dict] = field(default_factory=list)
    shard_owner: dict[tuple[int, str, str], dict] = field(default_factory=dict)
    """(step, kind, name) -> {"layout": Layout, "ranks": {coord tuple: rank}}."""
    fingerprints: dict[tuple[int, str, str], dict[int, dict]] = field(default_factory=dict)


def _rank_of(trace: Trace) -> dict[tuple[int, int, int, int], int]:
    out = {}
    for rank, c in trace.coords().items():
        out[(c["tp"], c["gtp"], c["dp"], c.get("pp", 0))] = rank
    return out


def assemble_trace(trace: Trace) -> Logical:
    """Rebuild every logical tensor of ``trace`` and check its replica and padding invariants."""
    rank_of = _rank_of(trace)
    coords = trace.coords()
    grouped: dict[tuple[int, str, str], list[Entry]] = defaultdict(list)
    out = Logical()
    tp_reads: dict[tuple[int, int, int], list[int]] = defaultdict(list)
    for e in trace.entries:
        if e.kind == "input":
            tp_reads[(e.step, e.rank, 0)].extend(e.sample_ids or ())
        else:
            grouped[(e.step, e.kind, e.name)].append(e)
    # A data rank's samples are read by all its TP ranks and pipeline stages: keep TP rank 0's
    # of the first stage, check the others.
    for (step, rank, _), ids in sorted(tp_reads.items()):
        c = coords.get(rank, {"tp": 0, "gtp": 0, "dp": 0})
        if c["tp"] == 0 and c.get("pp", 0) == 0:
            out.inputs.setdefault(step, {})[rank] = ids
            continue
        peer = rank_of.get((0, c["gtp"], c["dp"], 0))
        if peer is not None and tp_reads.get((step, peer, 0)) != ids:
            axis = "tp" if c["tp"] else "pp"
            out.replica_violations.append({"step": step, "kind": "input", "tensor": "sample_ids",
                                           "axis": axis, "ranks": [peer, rank], "max_abs": None})  # fmt: skip
    for key, entries in grouped.items():
        if entries[0].fingerprint is not None:
            out.fingerprints[key] = {e.rank: e.fingerprint for e in entries}
            continue
        if key[1] in SAMPLE_KINDS:
            _assemble_samples(trace, key, entries, coords, out)
        else:
            _assemble_placed(trace, key, entries, coords, rank_of, out)
    return out


def _assemble_placed(trace, key, entries, coords, rank_of, out: Logical) -> None:
    by_rank = {e.rank: e for e in entries}
    layout = entries[0].layout
    # A tensor lives on one pipeline stage: its shards are the ranks that recorded it.
    rank_of = {k[:3]: r for k, r in rank_of.items() if r in by_rank}
    if layout is None:
        raise BadInput(str(trace.path), f"{key[2]} ({key[1]}, step {key[0]}) has no layout")
    if layout.grid != "dense":  # a routed expert's weight: the ranks of its EP coordinate, on the expert grid
        coords = {r: on_grid(c, layout.grid) for r, c in coords.items() if holds(layout, c)}
        rank_of = {(c["tp"], c["gtp"], c["dp"]): r for r, c in coords.items()}

    def shard_of(c: dict) -> torch.Tensor:
        rank = rank_of.get((c.get("tp", 0), c.get("gtp", 0), c.get("dp", 0)))
        if rank is None or rank not in by_rank:
            raise BadInput(str(trace.path), f"{key[2]} ({key[1]}, step {key[0]}): no shard for mesh coordinate {c}")
        return trace.tensor(by_rank[rank])

    out.tensors[key] = assemble(layout, shard_of)
    out.shard_owner[key] = {"layout": layout, "ranks": dict(rank_of)}
    _check_replicas(trace, key, by_rank, layout, coords, out)
    if key[1] in PADDED_KINDS:
        _check_padding(trace, key, by_rank, layout, coords, out)


def _check_replicas(trace, key, by_rank, layout, coords, out: Logical) -> None:
    """Ranks that differ only on a Replicate axis must hold identical bytes."""
    for axis in MESH_AXES:
        if layout.mesh.get(axis, 1) <= 1 or not isinstance(layout.placement(axis), Replicate):
            continue
        groups = defaultdict(list)
        for rank, e in by_rank.items():
            c = coords[rank]
            groups[tuple(c.get(a, 0) for a in MESH_AXES if a != axis)].append(rank)
        for ranks in groups.values():
            ranks = sorted(ranks)
            first = trace.tensor(by_rank[ranks[0]])
            for r in ranks[1:]:
                other = trace.tensor(by_rank[r])
                if not torch.equal(first.view(torch.uint8) if first.dtype.is_floating_point else first,
                                   other.view(torch.uint8) if other.dtype.is_floating_point else other):
                    diff = (first.double() - other.double()).abs()
                    out.replica_violations.append({
                        "step": key[0], "kind": key[1], "tensor": key[2], "axis": axis,
                        "ranks": [ranks[0], r], "max_abs": float(diff.max()),
                    })  # fmt: skip


def _check_padding(trace, key, by_rank, layout, coords, out: Logical) -> None:
    pad = layout.pads.get("gtp", 0)
    if not pad or not isinstance(layout.placement("gtp"), Shard):
        return
    g = layout.mesh.get("gtp", 1)
    local_rows = layout.local_shape()[0]
    # Pad rows are the last `pad` rows of the gathered block: they sit on the last GTP ranks.
    for rank, e in by_rank.items():
        gi = coords[rank]["gtp"]
        start = gi * local_rows
        first_pad = g * local_rows - pad
        lo = max(first_pad - start, 0)
        if lo >= local_rows:
            continue
        rows = trace.tensor(e)[lo:]
        if rows.numel() and bool((rows != 0).any()):
            out.padding_violations.append({
                "step": key[0], "kind": key[1], "tensor": key[2], "rank": rank,
                "rows": [start + lo, start + local_rows], "max_abs": float(rows.double().abs().max()),
            })  # fmt: skip


def _assemble_samples(trace, key, entries, coords, out: Logical) -> None:
    """Per sample id: concatenate the TP shards (vocab-parallel logits, sequence-parallel
    activations) or take TP rank 0."""
    per_sample: dict[int, dict[int, torch.Tensor]] = defaultdict(dict)
    for e in entries:
        t = trace.tensor(e)
        tp = coords[e.rank]["tp"] if coords else 0
        for i, sid in enumerate(e.sample_ids or ()):
            # A sample read by several data ranks (a routing fault) keeps the first reading.
            per_sample[sid].setdefault(tp, t[i])
    layout = entries[0].layout
    placement = layout.placement("tp") if layout is not None else None
    sharded = isinstance(placement, Shard)
    tp_size = layout.mesh.get("tp", 1) if layout is not None else 1
    result = {}
    for sid, parts in per_sample.items():
        if sharded and tp_size > 1:
            if len(parts) != tp_size:
                raise BadInput(str(trace.path), f"{key[2]} step {key[0]}: sample {sid} lacks TP shards")
            # One sample drops the batch dim: the vocab (logits) or sequence (SP) shards join
            # along the placement's dim less one.
            result[sid] = torch.cat([parts[i] for i in range(tp_size)], dim=placement.dim - 1)
        else:
            result[sid] = parts[min(parts)]
    out.samples[key] = result
