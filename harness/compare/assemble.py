"""Assemble: rebuild logical tensors from a trace's shards, offline.

Weights, gradients and optimizer state are rebuilt from their layouts (the rank holding each
shard found through the trace's mesh coordinates). Activations, logits and per-sample losses
are keyed by global sample id, so traces of different topologies line up sample by sample.

:class:`LazyLogical` assembles each logical tensor when it is asked for and keeps none (a
compare streams them); :func:`assemble_trace` builds them all at once.

While assembling, two invariants of the trace itself are checked (each trace on its own):
``replica`` - a tensor declared Replicate on a mesh axis is bitwise equal on every rank of
that axis; ``padding`` - GTP pad rows of weights and gradients are zero.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from harness.common.errors import BadInput
from harness.common.layout import MESH_AXES, assemble, holds
from harness.common.mesh import on_grid
from harness.capture.trace import Entry, Trace

SAMPLE_KINDS = ("activation", "logits", "mtp_loss")  # per-sample tensors, keyed by sample id
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

    def shape(self, key) -> tuple[int, ...]:
        return tuple(self.tensors[key].shape)


def _rank_of(trace: Trace) -> dict[tuple[int, int, int, int], int]:
    out = {}
    for rank, c in trace.coords().items():
        out[(c["tp"], c["gtp"], c["dp"], c.get("pp", 0))] = rank
    return out


class LazyLogical:
    """The logical tensors of one trace, each assembled when it is asked for and not kept.

    ``tensors`` and ``samples`` are read-only mappings with the keys of :class:`Logical`;
    reading an item rebuilds it from the trace's shards (memory-mapped, read lazily), so a
    compare holds the tensors it is working on, not whole traces. The first assembly of a key
    checks its replica and padding invariants; ``replica_violations`` and
    ``padding_violations`` list those found so far, in the trace's order of keys, as
    :func:`assemble_trace` lists them. Sample ids read, fingerprints and shard owners come
    from the indexes alone.
    """

    def __init__(self, trace: Trace):
        self.trace = trace
        self._rank_of = _rank_of(trace)
        self._coords = trace.coords()
        self._grouped: dict[tuple[int, str, str], list[Entry]] = defaultdict(list)
        self._input_violations: list[dict] = []
        self._violations: dict[tuple, Logical] = {}
        self.inputs: dict[int, dict[int, list[int]]] = {}
        self.fingerprints: dict[tuple[int, str, str], dict[int, dict]] = {}
        self.shard_owner: dict[tuple[int, str, str], dict] = {}
        tp_reads: dict[tuple[int, int, int], list[int]] = defaultdict(list)
        for e in trace.entries:
            if e.kind == "input":
                tp_reads[(e.step, e.rank, 0)].extend(e.sample_ids or ())
            else:
                self._grouped[(e.step, e.kind, e.name)].append(e)
        self._check_inputs(tp_reads)
        for key, entries in self._grouped.items():
            if entries[0].fingerprint is not None:
                self.fingerprints[key] = {e.rank: e.fingerprint for e in entries}
            elif key[1] not in SAMPLE_KINDS and entries[0].layout is not None:
                ranks = _owners(entries, self._coords, self._rank_of)[1]
                self.shard_owner[key] = {"layout": entries[0].layout, "ranks": ranks}
        keys = [k for k in self._grouped if k not in self.fingerprints]
        self.placed_keys = [k for k in keys if k[1] not in SAMPLE_KINDS]
        self.sample_keys = [k for k in keys if k[1] in SAMPLE_KINDS]
        self.tensors = _View(self.placed_keys, self._placed)
        self.samples = _View(self.sample_keys, self._samples)

    def _check_inputs(self, tp_reads) -> None:
        # A data rank's samples are read by all its TP ranks and pipeline stages: keep TP rank
        # 0's of the first stage, check the others.
        for (step, rank, _), ids in sorted(tp_reads.items()):
            c = self._coords.get(rank, {"tp": 0, "gtp": 0, "dp": 0})
            if c["tp"] == 0 and c.get("pp", 0) == 0:
                self.inputs.setdefault(step, {})[rank] = ids
                continue
            peer = self._rank_of.get((0, c["gtp"], c["dp"], 0))
            if peer is not None and tp_reads.get((step, peer, 0)) != ids:
                axis = "tp" if c["tp"] else "pp"
                self._input_violations.append({"step": step, "kind": "input", "tensor": "sample_ids",
                                               "axis": axis,
                                               "ranks": [peer, rank], "max_abs": None})

    def _placed(self, key) -> torch.Tensor:
        sink = None if key in self._violations else self._violations.setdefault(key, Logical())
        return _assemble_placed(self.trace, key, self._grouped[key], self._coords, self._rank_of, sink)

    def _samples(self, key) -> dict[int, torch.Tensor]:
        self._violations.setdefault(key, Logical())  # sample tensors have no invariant of their own
        return _assemble_samples(self.trace, key, self._grouped[key], self._coords)

    def checked(self, key) -> bool:
        """Whether ``key`` has been assembled (its invariants checked) at least once."""
        return key in self._violations

    def record(self, key, replica: list[dict], padding: list[dict]) -> None:
        """Invariant violations of ``key`` found by another process assembling it."""
        sink = self._violations.setdefault(key, Logical())
        sink.replica_violations[:], sink.padding_violations[:] = replica, padding

    def violations_of(self, key) -> tuple[list[dict], list[dict]]:
        sink = self._violations.get(key) or Logical()
        return sink.replica_violations, sink.padding_violations

    @property
    def replica_violations(self) -> list[dict]:
        return self._input_violations + [v for k in self._grouped for v in self.violations_of(k)[0]]

    @property
    def padding_violations(self) -> list[dict]:
        return [v for k in self._grouped for v in self.violations_of(k)[1]]

    def shape(self, key) -> tuple[int, ...]:
        """Logical shape of a placed tensor, from its layout (nothing is read)."""
        first = self._grouped[key][0]
        return tuple(first.layout.logical_shape) if first.layout is not None else tuple(first.local_shape)

    def numel(self, key) -> int:
        """Elements of a placed tensor, or of every recorded shard of a sample key (a cost)."""
        if key[1] in SAMPLE_KINDS:
            return sum(math.prod(e.local_shape) for e in self._grouped[key])
        return math.prod(self.shape(key))


class _View(Mapping):
    """A read-only mapping whose items are assembled on every access (nothing is cached)."""

    def __init__(self, keys: list, build):
        self._keys, self._set, self._build = keys, set(keys), build

    def __getitem__(self, key):
        if key not in self._set:
            raise KeyError(key)
        return self._build(key)

    def __contains__(self, key) -> bool:
        return key in self._set

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def assemble_trace(trace: Trace) -> Logical:
    """Rebuild every logical tensor of ``trace`` and check its replica and padding invariants."""
    lazy = LazyLogical(trace)
    out = Logical(inputs=lazy.inputs, fingerprints=lazy.fingerprints, shard_owner=lazy.shard_owner)
    for key in lazy._grouped:
        if key in lazy.tensors:
            out.tensors[key] = lazy.tensors[key]
        elif key in lazy.samples:
            out.samples[key] = lazy.samples[key]
    out.replica_violations = lazy.replica_violations
    out.padding_violations = lazy.padding_violations
    return out


def _assemble_placed(trace, key, entries, coords, rank_of, sink: Logical | None) -> torch.Tensor:
    """The logical tensor of ``key``; its invariants' violations go to ``sink`` (None: not checked)."""
    by_rank = {e.rank: e for e in entries}
    layout = entries[0].layout
    if layout is None:
        raise BadInput(str(trace.path), f"{key[2]} ({key[1]}, step {key[0]}) has no layout")
    coords, rank_of = _owners(entries, coords, rank_of)

    def shard_of(c: dict) -> torch.Tensor:
        rank = rank_of.get((c.get("tp", 0), c.get("gtp", 0), c.get("dp", 0)))
        if rank is None or rank not in by_rank:
            raise BadInput(str(trace.path),
                           f"{key[2]} ({key[1]}, step {key[0]}): no shard for mesh coordinate {c}")
        return trace.tensor(by_rank[rank])

    tensor = assemble(layout, shard_of)
    if sink is not None:
        _check_replicas(trace, key, by_rank, layout, coords, sink)
        if key[1] in PADDED_KINDS:
            _check_padding(trace, key, by_rank, layout, coords, sink)
    return tensor


def _owners(entries, coords, rank_of) -> tuple[dict, dict]:
    """The coordinates of the ranks holding shards of one placed tensor, and (tp, gtp, dp) ->
    rank among them: a tensor lives on one pipeline stage (its shards are the ranks that
    recorded it), a routed expert's weight on the expert grid at its EP coordinate."""
    layout = entries[0].layout
    recorded = {e.rank for e in entries}
    if layout.grid != "dense":  # (the expert grid has no stage: the ranks that recorded it are its)
        coords = {r: on_grid(c, layout.grid) for r, c in coords.items() if r in recorded and holds(layout, c)}
        return coords, {(c["tp"], c["gtp"], c["dp"]): r for r, c in coords.items()}
    first = layout.replica_stages[:1]  # a copy per stage: the first stage's is the tensor
    return coords, {k[:3]: r for k, r in rank_of.items() if r in recorded and (not first or k[3] == first[0])}


def _check_replicas(trace, key, by_rank, layout, coords, out: Logical) -> None:
    """Ranks that differ only on a Replicate axis must hold identical bytes; so must the copies of
    a tensor held by several pipeline stages (``replica_stages``: axis ``pp``)."""
    axes = [a for a in MESH_AXES if layout.mesh.get(a, 1) > 1 and isinstance(layout.placement(a), Replicate)]
    for axis in axes + (["pp"] if layout.replica_stages else []):
        groups = defaultdict(list)
        for rank, e in by_rank.items():
            c = coords[rank]
            groups[tuple(c.get(a, 0) for a in (*MESH_AXES, "pp") if a != axis)].append(rank)
        for ranks in groups.values():
            ranks = sorted(ranks)  # the first stage's first: pp is the outermost axis of ranks
            first = trace.tensor(by_rank[ranks[0]])
            for r in ranks[1:]:
                other = trace.tensor(by_rank[r])
                if not _same_bytes(trace, by_rank[ranks[0]], by_rank[r], first, other):
                    diff = (first.double() - other.double()).abs()
                    out.replica_violations.append({
                        "step": key[0], "kind": key[1], "tensor": key[2], "axis": axis,
                        "ranks": [ranks[0], r], "max_abs": float(diff.max()),
                    })


def _same_bytes(trace, e1, e2, t1: torch.Tensor, t2: torch.Tensor) -> bool:
    """Two shards' bytes are equal. Both were just read, so where the trace verifies content
    digests both matched theirs: equal digests of one algorithm decide it without a pass."""
    if trace.verify and e1.digest and e2.digest and e1.digest_alg == e2.digest_alg:
        return e1.digest == e2.digest
    return torch.equal(t1.view(torch.uint8) if t1.dtype.is_floating_point else t1,
                       t2.view(torch.uint8) if t2.dtype.is_floating_point else t2)


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
            })


def _assemble_samples(trace, key, entries, coords) -> dict[int, torch.Tensor]:
    """Per sample id: concatenate the TP shards (vocab-parallel logits, sequence-parallel
    activations), sum the TP parts (``Partial("sum")``: a sequence-parallel router's load-balancing
    loss) or take TP rank 0."""
    per_sample: dict[int, dict[int, torch.Tensor]] = defaultdict(dict)
    for e in entries:
        t = trace.tensor(e)
        tp = coords[e.rank]["tp"] if coords else 0
        for i, sid in enumerate(e.sample_ids or ()):
            # A sample read by several data ranks (a routing fault) keeps the first reading.
            per_sample[sid].setdefault(tp, t[i])
    layout = entries[0].layout
    placement = layout.placement("tp") if layout is not None else None
    sharded, summed = isinstance(placement, Shard), isinstance(placement, Partial)
    tp_size = layout.mesh.get("tp", 1) if layout is not None else 1
    result = {}
    for sid, parts in per_sample.items():
        if (sharded or summed) and tp_size > 1 and len(parts) != tp_size:
            raise BadInput(str(trace.path), f"{key[2]} step {key[0]}: sample {sid} lacks TP shards")
        if summed and tp_size > 1:
            result[sid] = torch.stack([parts[i] for i in range(tp_size)]).sum(0)
        elif sharded and tp_size > 1:
            # One sample drops the batch dim: the vocab (logits) or sequence (SP) shards join
            # along the placement's dim less one.
            result[sid] = torch.cat([parts[i] for i in range(tp_size)], dim=placement.dim - 1)
        else:
            result[sid] = parts[min(parts)]
    return result
