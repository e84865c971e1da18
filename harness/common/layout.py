"""Layouts: how a logical tensor is cut into the shards ranks hold.

The vocabulary is DTensor's: a placement per mesh axis (``Replicate()``, ``Shard(dim)``,
``Partial("sum" | "avg")``), applied in mesh-axis order, outer axes first, as DTensor
does when several axes shard one dim. On top of DTensor, GTP pads dim 0 of the TP-local block
to a multiple of ``alignment x G`` before cutting it (pad rows at the tail, on the last GTP
ranks): ``pads`` records those rows per axis. The mesh axes are ``("tp", "gtp", "dp")``:
TP outer, GTP inner, as megatron-core orders ranks.

``shard`` and ``assemble`` are inverses (see tests/test_layout.py); ``from_mcore_param``
reads a layout off megatron-core's parameter attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from harness.common.mesh import AXES, Axis

# A tensor lives on one pipeline stage: layouts place it on that stage's (tp, gtp, dp) mesh.
MESH_AXES = tuple(a.value for a in AXES if a is not Axis.PP)


@dataclass(frozen=True, slots=True)
class Layout:
    """A logical tensor's placement on the (tp, gtp, dp) mesh."""

    logical_shape: tuple[int, ...]
    mesh: Mapping[str, int]
    """Axis sizes, e.g. {"tp": 2, "gtp": 2, "dp": 1}."""
    placements: Mapping[str, Placement]
    """Placement per mesh axis; missing axes are Replicate."""
    pads: Mapping[str, int] = field(default_factory=dict)
    """Rows padded onto the sharded dim before cutting it along this axis (GTP)."""
    grid: str = "dense"
    """``dense``, or ``expert``: the axes are then expert TP, expert GTP and expert DP
    (:func:`harness.common.mesh.on_grid`), on the ranks whose coordinates match ``fixed``."""
    fixed: Mapping[str, int] = field(default_factory=dict)
    """Coordinates outside the placement axes that select the ranks holding the tensor (a
    routed expert's weight lives on the ranks of one EP coordinate: ``{"ep": r}``)."""
    strides: Mapping[str, int] = field(default_factory=dict)
    """Blocks the sharded dim holds before this axis cuts it (megatron-core's ``partition_stride``):
    each of the k equal blocks is cut along the axis and a rank holds its piece of every block, in
    block order. A gated fc1 ``[gate; up]`` is cut with stride 2 over TP: rank r holds
    ``[gate_r; up_r]`` (DTensor's ``_StridedShard``)."""
    vocab_padding: int = 0
    """Rows at the tail of dim 0 that a padded vocabulary adds (the word embedding's, the output
    layer's): logical rows, cut, held, trained and compared as the others (megatron-core's softmax
    counts the output layer's), never a token's; the vocabulary's own are the first
    ``logical_shape[0] - vocab_padding``. GTP's ``pads`` come after them, in the TP-local block."""
    replica_stages: tuple[int, ...] = ()
    """Pipeline stages that each hold a whole copy of the tensor (empty: one stage, the ranks that
    recorded it). MTP's copy of the word embedding on the last stage: the first stage's copy is
    the logical tensor, the others are its replicas (checked bitwise, axis ``pp``)."""

    def placement(self, axis: str) -> Placement:
        return self.placements.get(axis, Replicate())

    def to_json(self) -> dict:
        return {
            "logical_shape": list(self.logical_shape),
            "mesh": dict(self.mesh),
            "placements": {a: placement_str(p) for a, p in self.placements.items()},
            "pads": dict(self.pads),
            **({"grid": self.grid, "fixed": dict(self.fixed)} if self.grid != "dense" else {}),
            **({"strides": dict(self.strides)} if self.strides else {}),
            **({"vocab_padding": self.vocab_padding} if self.vocab_padding else {}),
            **({"replica_stages": list(self.replica_stages)} if self.replica_stages else {}),
        }

    @staticmethod
    def from_json(doc: dict) -> "Layout":
        return Layout(
            logical_shape=tuple(doc["logical_shape"]),
            mesh=dict(doc["mesh"]),
            placements={a: parse_placement(p) for a, p in doc["placements"].items()},
            pads=dict(doc.get("pads", {})),
            grid=doc.get("grid", "dense"),
            fixed=dict(doc.get("fixed", {})),
            strides=dict(doc.get("strides", {})),
            vocab_padding=int(doc.get("vocab_padding", 0)),
            replica_stages=tuple(int(x) for x in doc.get("replica_stages", ())),
        )

    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.logical_shape)
        for axis in MESH_AXES:
            p = self.placement(axis)
            if isinstance(p, Shard):
                d = p.dim % len(shape)
                shape[d] = (shape[d] + self.pads.get(axis, 0)) // self.mesh.get(axis, 1)
        return tuple(shape)


def holds(layout: Layout, coord: Mapping[str, int]) -> bool:
    """Whether the rank at ``coord`` (its full coordinate, expert axes included) holds a shard."""
    return all(coord.get(axis) == c for axis, c in layout.fixed.items())


def replicated(shape: tuple[int, ...], mesh: Mapping[str, int] | None = None) -> Layout:
    return Layout(tuple(shape), dict(mesh or {}), {})


def placement_str(p: Placement) -> str:
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Partial):
        return f"P({p.reduce_op})"
    return "R"


def parse_placement(text: str) -> Placement:
    if text == "R":
        return Replicate()
    if text.startswith("S(") and text.endswith(")"):
        return Shard(int(text[2:-1]))
    if text.startswith("P(") and text.endswith(")"):
        return Partial(text[2:-1])
    raise ValueError(f"unknown placement {text!r} (expected R, S(dim) or P(op))")


def gtp_pad(dim0: int, gtp: int, alignment: int) -> int:
    """Pad rows megatron-core adds to dim 0 before cutting it G ways (``gtp_remat_shard_dim0``)."""
    if gtp <= 1:
        return 0
    if alignment <= 0:
        return 0
    unit = alignment * gtp
    return (unit - dim0 % unit) % unit


def shard(full: torch.Tensor, layout: Layout, coord: Mapping[str, int]) -> torch.Tensor:
    """The shard the rank at ``coord`` holds (pad rows zero, as megatron-core's local path)."""
    t = full
    for axis in MESH_AXES:
        p, n = layout.placement(axis), layout.mesh.get(axis, 1)
        if isinstance(p, Shard):
            d = p.dim % t.dim()
            pad = layout.pads.get(axis, 0)
            if pad:
                widths = [0, 0] * (t.dim() - 1 - d) + [0, pad]
                t = torch.nn.functional.pad(t, widths)
            k = layout.strides.get(axis, 1)
            if t.shape[d] % (n * k):
                raise ValueError(f"dim {d} of size {t.shape[d]} does not split {n} x {k} ways on {axis}")
            t = torch.cat([b.chunk(n, dim=d)[coord.get(axis, 0)] for b in t.chunk(k, dim=d)], dim=d)
        elif isinstance(p, Partial):
            raise ValueError("a Partial tensor has no shard of a logical value")
    return t.clone()


def assemble(layout: Layout, shard_of: Callable[[dict[str, int]], torch.Tensor]) -> torch.Tensor:
    """Rebuild the logical tensor from ``shard_of(coord)``.

    Replicate axes read coordinate 0 (replicas are checked by the ``replica`` policy, not
    here); Shard axes concatenate then strip pad rows; Partial axes reduce.
    """

    def build(level: int, fixed: dict[str, int]) -> torch.Tensor:
        if level == len(MESH_AXES):
            return shard_of(fixed)
        axis = MESH_AXES[level]
        p, n = layout.placement(axis), layout.mesh.get(axis, 1)
        if isinstance(p, Replicate) or n == 1:
            t = build(level + 1, {**fixed, axis: 0})
            if isinstance(p, Shard):
                return _strip(t, p.dim, layout.pads.get(axis, 0))
            return t
        parts = [build(level + 1, {**fixed, axis: i}) for i in range(n)]
        if isinstance(p, Shard):
            whole = _unstride(parts, p.dim, layout.strides.get(axis, 1))
            return _strip(whole, p.dim, layout.pads.get(axis, 0))
        total = torch.stack(parts).sum(0)
        return total / n if p.reduce_op == "avg" else total

    out = build(0, {})
    if tuple(out.shape) != tuple(layout.logical_shape):
        raise ValueError(f"assembled shape {tuple(out.shape)} != logical shape {layout.logical_shape}")
    return out


def _unstride(parts: list[torch.Tensor], dim: int, k: int) -> torch.Tensor:
    """The ranks' pieces put back: block by block (each rank's piece of it in rank order)."""
    if k == 1:
        return torch.cat(parts, dim=dim)
    pieces = [part.chunk(k, dim=dim) for part in parts]
    return torch.cat([piece[b] for b in range(k) for piece in pieces], dim=dim)


def _strip(t: torch.Tensor, dim: int, pad: int) -> torch.Tensor:
    if not pad:
        return t
    d = dim % t.dim()
    return t.narrow(d, 0, t.shape[d] - pad)


def from_mcore_param(param: torch.Tensor, mesh: Mapping[str, int]) -> Layout:
    """Read a parameter's layout off megatron-core's attributes.

    ``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride`` give the TP placement;
    ``is_gtp_weight_remat`` and ``pad_length`` the GTP placement: GTP always cuts dim 0 of the
    TP-local block, padded at the tail.
    """
    shape = list(param.shape)
    placements: dict[str, Placement] = {}
    pads: dict[str, int] = {}
    strides: dict[str, int] = {}
    if getattr(param, "is_gtp_weight_remat", False):
        pad = int(getattr(param, "pad_length", 0))
        placements["gtp"] = Shard(0)
        pads["gtp"] = pad
        shape[0] = shape[0] * mesh.get("gtp", 1) - pad
    if getattr(param, "tensor_model_parallel", False) and mesh.get("tp", 1) > 1:
        d = param.partition_dim
        placements["tp"] = Shard(d)
        shape[d] *= mesh["tp"]
        if (stride := int(getattr(param, "partition_stride", 1))) != 1:
            strides["tp"] = stride
    return Layout(tuple(shape), dict(mesh), placements, pads, strides=strides)
