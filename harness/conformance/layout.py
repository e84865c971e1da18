"""Where each rank's rows of a distributed weight live, and the seeded data the kit feeds in.

The layout is the one GTP uses (megatron-core's ``GTPShardedParam``):

- A weight's *logical* value is its TP-local weight ``[D, ...]``; TP slicing happens before the
  kit ever sees it, so the kit works in TP-local shapes only.
- Dim 0 is zero-padded at the tail to ``P = roundup(D, a * G)`` (``a = pad_for_alignment``;
  ``a = 0`` means no padding, and ``D`` must then divide by ``G``) and cut into ``G`` contiguous
  shards of ``S = P / G`` rows in GTP-group rank order: GTP rank ``g`` holds padded rows
  ``[g * S, (g + 1) * S)``. Pad rows therefore sit on the last ranks.
- A weight's gradient buffer of record (``main_grad``) has the shard's shape and layout.

Global rank order is ``tp`` fastest, then ``gtp``, then replicate ``dp``:
``rank = t + TP * (g + G * d)``.

All data is generated from integer seeds with private generators, so every rank can compute
every other rank's inputs (and so the expected reduction) without communicating.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.common.dtypes import BY_TORCH_NAME
from harness.common.mesh import Mesh


def dtype_of(name: str) -> torch.dtype:
    """Map a dtype name used in cases and JSON ("float32", "bfloat16") to the torch dtype."""
    try:
        return BY_TORCH_NAME[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(BY_TORCH_NAME)}") from None


@dataclass(frozen=True, slots=True)
class Coords:
    """This rank's place in a ``TP x G x DP`` mesh (:class:`harness.common.mesh.Mesh`)."""

    tp: int
    """Tensor-parallel size."""
    gtp: int
    """GTP (weight-rematerialization) group size G."""
    dp: int
    """Replicate data-parallel size: world / (TP * G)."""
    rank: int
    """Global rank."""

    @property
    def mesh(self) -> Mesh:
        return Mesh(self.tp, self.gtp, self.dp)

    @property
    def tp_rank(self) -> int:
        """Rank inside the TP group."""
        return self.mesh.coord(self.rank)["tp"]

    @property
    def gtp_rank(self) -> int:
        """Rank inside the GTP group."""
        return self.mesh.coord(self.rank)["gtp"]

    @property
    def dp_rank(self) -> int:
        """Rank inside the replicate group."""
        return self.mesh.coord(self.rank)["dp"]

    def global_rank(self, *, tp_rank: int, gtp_rank: int, dp_rank: int) -> int:
        """Global rank of the given coordinates."""
        return self.mesh.rank({"tp": tp_rank, "gtp": gtp_rank, "dp": dp_rank})

    def gtp_peers(self) -> list[int]:
        """Global ranks of this rank's GTP group, in GTP-rank order."""
        return self.mesh.group(self.rank, "gtp")


def padded_rows(rows: int, gtp: int, pad_for_alignment: int) -> int:
    """Dim 0 after tail padding: ``roundup(rows, a * G)``, or ``rows`` when ``a == 0``."""
    if pad_for_alignment <= 0:
        if rows % gtp:
            raise ValueError(f"{rows} rows do not divide by G={gtp} and padding is off")
        return rows
    step = pad_for_alignment * gtp
    return -(-rows // step) * step


def shard_slice(rows: int, gtp: int, pad_for_alignment: int, gtp_rank: int) -> slice:
    """The padded rows GTP rank ``gtp_rank`` holds."""
    size = padded_rows(rows, gtp, pad_for_alignment) // gtp
    return slice(gtp_rank * size, (gtp_rank + 1) * size)


def pad_dim0(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero-pad ``tensor`` at the tail of dim 0 to ``rows`` rows (a copy)."""
    out = tensor.new_zeros((rows, *tensor.shape[1:]))
    out[: tensor.shape[0]] = tensor
    return out


def _generator(*parts: int) -> torch.Generator:
    # A stable mix of small integers; Python's hash() of tuples is salted per process.
    seed = 0
    for part in parts:
        seed = (seed * 1_000_003 + int(part) + 7) % (2**62)
    return torch.Generator().manual_seed(seed)


def logical_weight(
    seed: int, module: int, member: int, tp_rank: int, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """The TP-local logical weight of ``member`` in ``module`` for TP rank ``tp_rank``."""
    gen = _generator(seed, 1, module, member, tp_rank)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def wgrad(
    seed: int,
    microbatch: int,
    module: int,
    member: int,
    rank: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
) -> torch.Tensor:
    """The weight gradient global rank ``rank`` computes for one weight in one micro-batch.

    Values are drawn in float64 and rounded once to ``dtype`` (the grad buffer's dtype), so the
    expected reduction can be computed exactly from what the implementer actually received.
    """
    gen = _generator(seed, 2, microbatch, module, member, rank)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


@dataclass(frozen=True, slots=True)
class GradExpectation:
    """What one rank's ``main_grad`` must hold after some micro-batches, in float64."""

    value: torch.Tensor
    """Expected shard, padded layout, pad rows zero."""
    bound: torch.Tensor
    """Per-element allowed |diff|; zero on pad rows (they must be exactly zero)."""
    real_rows: int
    """How many leading rows of the shard are real (not padding)."""


def expected_main_grad(
    *,
    seed: int,
    coords: Coords,
    module: int,
    member: int,
    shape: tuple[int, ...],
    pad_for_alignment: int,
    microbatches: int,
    reduction: str,
    grad_dtype: torch.dtype,
    main_grad_dtype: torch.dtype,
) -> GradExpectation:
    """This rank's rows of the GTP-group mean (or sum) of the wgrads, summed over micro-batches.

    The bound models a sum of ``G * microbatches`` terms plus one scaling, each rounded in
    ``main_grad_dtype``: ``(G * M + 1) * eps * sum(|terms|)``. It is exact for the order an
    implementer chooses, so it holds for any summation order and for pre- or post-scaling.
    """
    peers = coords.gtp_peers()
    scale = 1.0 / len(peers) if reduction == "mean" else 1.0
    total = torch.zeros(shape, dtype=torch.float64)
    magnitude = torch.zeros(shape, dtype=torch.float64)
    for mb in range(microbatches):
        for peer in peers:
            term = wgrad(seed, mb, module, member, peer, shape, grad_dtype).double() * scale
            total += term
            magnitude += term.abs()
    eps = torch.finfo(main_grad_dtype).eps
    bound = (len(peers) * microbatches + 1) * eps * magnitude
    rows = padded_rows(shape[0], coords.gtp, pad_for_alignment)
    cut = shard_slice(shape[0], coords.gtp, pad_for_alignment, coords.gtp_rank)
    value = pad_dim0(total, rows)[cut]
    real_rows = max(0, min(shape[0] - cut.start, cut.stop - cut.start))
    return GradExpectation(value=value, bound=pad_dim0(bound, rows)[cut], real_rows=real_rows)
