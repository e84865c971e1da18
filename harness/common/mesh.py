"""The device mesh: which rank sits where on the TP x GTP x DP x PP axes, and the groups they form.

Ranks are ordered as megatron-core orders them for the dense decoder: TP fastest, then GTP,
then DP, then the pipeline stage (``parallel_state._inject_gtp_remat_axis`` turns the default
``tp-cp-ep-dp-pp`` into ``tp-gtp_remat-cp-ep-dp-pp``; CP = EP = 1 here), so
``rank = tp + TP * (gtp + G * (dp + DP * pp))``. A caller may hand megatron-core groups that
pair ranks otherwise (``Side.process_groups = "collection-permuted"``): GTP peers across
replicate DP, ``rank = tp + TP * (dp + DP * gtp)`` (:data:`PERMUTED`), the same sizes on another
pairing; the data rank is the same either way. The ``pp`` axis is named only in a pipelined
mesh (PP > 1): an unpipelined side's coordinates and traces read as they always have. A
stage's tensors are laid out on the stage's own (tp, gtp, dp) mesh (:meth:`Mesh.stage_sizes`).
New axes (expert parallel, expert GTP, pipeline stage) belong here and nowhere else.
Torch-free: traces, scenarios and process groups all read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum


class Axis(StrEnum):
    TP = "tp"
    """Tensor parallel."""
    GTP = "gtp"
    """GTP weight rematerialization (megatron-core's ``gtp_remat``): the group of size G."""
    DP = "dp"
    """Replicate data parallel: world / (TP * G * PP)."""
    PP = "pp"
    """Pipeline stage."""


AXES = tuple(Axis)
"""Every axis, fastest-varying first (the rank order)."""
PERMUTED = (Axis.TP, Axis.DP, Axis.GTP, Axis.PP)
"""The rank order of a collection pairing GTP peers across replicate DP (see the module docstring)."""


@dataclass(frozen=True)
class Mesh:
    tp: int = 1
    gtp: int = 1
    dp: int = 1
    pp: int = 1
    order: tuple[Axis, ...] = AXES
    """The axes, fastest-varying first: :data:`AXES` (megatron-core's) or :data:`PERMUTED`."""

    @classmethod
    def of_world(cls, world_size: int, tp: int = 1, gtp: int = 1, pp: int = 1, order=AXES) -> Mesh:
        """The mesh of ``world_size`` ranks with TP, G and PP given (DP is what remains)."""
        if world_size % (tp * gtp * pp):
            what = "TP x G" if pp == 1 else "TP x G x PP"
            raise ValueError(f"world size {world_size} is not a multiple of {what} = {tp * gtp * pp}")
        return cls(tp, gtp, world_size // (tp * gtp * pp), pp, tuple(order))

    @classmethod
    def of_side(cls, side) -> Mesh:
        """The mesh of a scenario side (anything with ``world_size``, ``tp``, ``gtp`` and,
        optionally, ``pipeline_parallel`` and ``process_groups``)."""
        order = PERMUTED if getattr(side, "process_groups", "") == "collection-permuted" else AXES
        return cls.of_world(side.world_size, side.tp, side.gtp, getattr(side, "pipeline_parallel", 1), order)

    @property
    def world_size(self) -> int:
        return self.tp * self.gtp * self.dp * self.pp

    def size(self, axis: str) -> int:
        return getattr(self, Axis(axis).value)

    def _named(self) -> tuple[Axis, ...]:
        return AXES if self.pp > 1 else AXES[:-1]

    def sizes(self) -> dict[str, int]:
        """``{"tp": TP, "gtp": G, "dp": DP}`` (and ``"pp"`` when pipelined): the mesh as traces
        record it."""
        return {a.value: self.size(a) for a in self._named()}

    def stage_sizes(self) -> dict[str, int]:
        """The (tp, gtp, dp) mesh of one pipeline stage: where a stage's tensors are laid out."""
        return {a.value: self.size(a) for a in AXES if a is not Axis.PP}

    def coord(self, rank: int) -> dict[str, int]:
        """``rank``'s coordinate on every axis (``pp`` only when pipelined)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.world_size} ranks")
        out = {}
        for axis in self.order:
            rank, out[axis.value] = divmod(rank, self.size(axis))
        out = {a.value: out[a.value] for a in AXES}  # listed in the usual order whatever the rank order
        if self.pp == 1:
            del out[Axis.PP.value]
        return out

    def rank(self, coord: Mapping[str, int]) -> int:
        """The rank at ``coord`` (an axis left out is coordinate 0)."""
        rank, stride = 0, 1
        for axis in self.order:
            c = coord.get(axis.value, 0)
            if not 0 <= c < self.size(axis):
                raise ValueError(f"{axis.value} coordinate {c} is outside 0..{self.size(axis) - 1}")
            rank += c * stride
            stride *= self.size(axis)
        return rank

    def data_rank(self, rank: int) -> int:
        """``rank``'s index among the ranks that read distinct samples (GTP x DP: GTP peers are
        data ranks, TP peers and pipeline stages read the same samples)."""
        return rank % (self.tp * self.gtp * self.dp) // self.tp

    def group(self, rank: int, *axes: str) -> list[int]:
        """The ranks that differ from ``rank`` only on ``axes``, in rank order."""
        return next(g for g in self.groups(*axes) if rank in g)

    def groups(self, *axes: str) -> list[list[int]]:
        """Every group spanning ``axes`` (the other axes fixed), each in rank order, listed by
        first rank: the groups megatron-core's ``RankGenerator.get_ranks`` makes for them."""
        varying = {Axis(a) for a in axes}
        fixed = [a for a in self.order if a not in varying]
        out: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            c = self.coord(rank)
            out.setdefault(tuple(c.get(a.value, 0) for a in fixed), []).append(rank)
        return list(out.values())


def expert_coord(rank: int, world_size: int, tp: int = 1, ep: int = 1, egtp: int = 1,
                 pp: int = 1) -> dict[str, int]:
    """``rank``'s coordinate on the expert grid: megatron-core orders expert ranks
    ``tp-ep-gtp_remat-dp-pp`` (``initialize_model_parallel``: the expert generator's order is the
    dense one with EGTP injected after EP, the pipeline stage outermost in both), so
    ``rank = etp + TP * (ep + EP * (egtp + EG * (edp + EDP * pp)))``."""
    out, edp = {}, expert_dp(world_size, tp, ep, egtp, pp)
    for axis, size in (("etp", tp), ("ep", ep), ("egtp", egtp), ("edp", edp)):
        rank, out[axis] = divmod(rank, size)
    return out


def expert_dp(world_size: int, tp: int, ep: int, egtp: int, pp: int) -> int:
    """The expert grid's data-parallel size: what expert TP x EP x EGTP x PP leave of the world."""
    return world_size // (tp * ep * egtp * pp)


def on_grid(coord: Mapping[str, int], grid: str) -> dict[str, int]:
    """A rank's (tp, gtp, dp) coordinate on ``grid``: the dense mesh's, or on the expert grid
    (``expert_coord``) expert TP, expert GTP and expert DP in those places."""
    if grid == "expert":
        return {"tp": coord["etp"], "gtp": coord["egtp"], "dp": coord["edp"]}
    return {a.value: coord[a.value] for a in AXES if a.value in coord}  # pp only when pipelined
