"""FP8 / FP4 GEMMs across TP and GTP, through the pure-PyTorch emulation of TE's recipes.

Every linear layer gets TE's quantizers for its recipe (``harness.quant``), with the amax
reductions megatron-core and Transformer Engine set up:

- delayed scaling: every amax (input, weight, grad) MAX-reduced over the FP8 group
  (TP x GTP x DP, megatron-core's ``get_amax_reduction_group``) at each scale update;
- per-tensor current scaling and NVFP4's per-tensor amax: nothing reduced for inputs and
  grads (no sequence parallelism); a GTP weight shard's amax MAX-reduced over the GTP group,
  as TE does for weights sharded before a quantized all-gather, so that every shard gets the
  scale of the whole TP-local weight;
- block formats (MXFP8, FP8 block, NVFP4 blocks): local by construction.

Quantized all-gather: a GTP shard is quantized *before* it is gathered; the codes and block
scales of all shards are concatenated and the pad rows stripped. A per-tensor scale is not
gathered: the local one is used for all shards, as TE's ``_all_gather_fp8`` and
``_all_gather_nvfp4`` do ("assume scaling factors are identical across ranks"), which holds
only when the amax was reduced. Block-scaled shards need their row count to be a multiple of
the block (megatron-core pads to 32 for MXFP8: ``gtp_pad_alignment``). FP8 block scaling with
2D weight blocks falls back, as TE does, to a high-precision all-gather then quantization.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from harness.quant import (
    RECIPES,
    Float8BlockQuantizer,
    LinearQuantizers,
    Quantized,
    QuantizedTensor,
    Quantizer,
)
from harness.quant.formats import E2M1
from harness.quant.quantizers import DelayedScalingQuantizer

from . import comm

Gather = Callable[[torch.Tensor], list[torch.Tensor]]
"""Every GTP rank's copy of a tensor, in group-rank order."""


def make_recipe(name: str):
    """TE's recipe with its defaults (environment-derived fields included)."""
    return RECIPES[name]()


def max_reducer(group) -> Optional[Callable[[torch.Tensor], None]]:
    """An in-place MAX all-reduce over ``group`` (None for a one-rank group)."""
    if group is None:
        return None
    return lambda amax: dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)


def layer_quantizers(
    recipe, *, amax_group, gtp_group, gtp_weight: bool, reduce_weight_amax: bool = True, seed: int
) -> LinearQuantizers:
    """One linear layer's quantizers with the amax reductions described in the module docstring.

    ``gtp_weight``: the layer's weight is a GTP shard. ``reduce_weight_amax=False`` leaves a
    GTP shard's weight amax unreduced (the planted fault ``fp8-unreduced-amax``).
    """
    if recipe.name == "delayed":
        weight_group = amax_group if reduce_weight_amax or not gtp_weight else None
        groups = {"input": amax_group, "weight": weight_group, "grad_output": amax_group}
    else:
        groups = {"weight": gtp_group if gtp_weight and reduce_weight_amax else None}
    return recipe.make_quantizers(amax_reduction={k: max_reducer(g) for k, g in groups.items()}, seed=seed)


def layer_seed(seed: int, name: str, tp_rank: int, data_rank: int) -> int:
    """Seed of a layer's stochastic rounding: equal on two topologies for the same data rank."""
    return zlib.crc32(f"{seed}:{name}:{tp_rank}:{data_rank}".encode())


@dataclass(kw_only=True)
class GatheredWeight(Quantizer):
    """Stands in for the weight quantizer of a GTP layer: the copies were made shard by shard
    and gathered before the GEMM (:func:`prepare_gtp_weight`); ``quantize`` hands them over."""

    inner: Quantizer
    """The recipe's weight quantizer, applied to the shard."""
    copies: Optional[Quantized] = None

    @property
    def fmt(self):
        return self.inner.fmt

    def quantize(self, x, *, rowwise=True, columnwise=True, amax=None) -> Quantized:
        q, self.copies = self.copies, None
        if q is None:
            raise RuntimeError("GTP weight was not gathered before its GEMM")
        shape = tuple(x.reshape(-1, x.shape[-1]).shape)
        if q.rowwise is not None and q.rowwise.shape != shape:
            raise RuntimeError(f"gathered weight is {q.rowwise.shape}, the GEMM reads {shape}")
        return q

    def spec(self, usage):
        return self.inner.spec(usage)


def prepare_gtp_weight(
    quantizers: LinearQuantizers, shard: torch.Tensor, full: torch.Tensor, gather: Gather, local: int
) -> None:
    """Quantize this rank's (padded) shard and gather the copies into ``quantizers.weight``.

    ``full`` is the high-precision gathered weight (unpadded), used only where TE gathers in
    high precision (FP8 block scaling). ``local`` is this rank's index in the GTP group.
    """
    wrapper = quantizers.weight
    if not isinstance(wrapper, GatheredWeight):
        raise TypeError("the layer's weight quantizer is not a GatheredWeight")
    inner = wrapper.inner
    if isinstance(inner, Float8BlockQuantizer):
        wrapper.copies = inner.quantize(full.detach(), rowwise=True, columnwise=True)
        return
    block = inner.spec("columnwise").block  # (rows, cols) of a block in the weight's orientation
    if block is not None and shard.shape[0] % block[0]:
        raise ValueError(
            f"a GTP shard of {shard.shape[0]} rows splits the {block[0]}-row blocks of "
            f"{type(inner).__name__}: pad GTP shards to a multiple of {block[0]} rows (gtp_pad_alignment)"
        )
    mine = inner.quantize(shard.detach(), rowwise=True, columnwise=True)
    rows = full.shape[0]
    wrapper.copies = Quantized(
        rowwise=assemble_copy(_gather_copy(mine.rowwise, gather), local, rows, dim=0),
        columnwise=assemble_copy(_gather_copy(mine.columnwise, gather), local, rows, dim=1),
    )


def _gather_copy(t: QuantizedTensor, gather: Gather) -> list[QuantizedTensor]:
    data, scales = gather(t.data), gather(t.scale_inv)
    return [dataclasses.replace(t, data=d, scale_inv=s) for d, s in zip(data, scales)]


def assemble_copy(shards: list[QuantizedTensor], local: int, rows: int, dim: int) -> QuantizedTensor:
    """One quantized copy of the gathered weight from every shard's copy.

    ``dim`` is the dim of the stored matrix that runs along the weight's rows (0 for the
    rowwise copy, 1 for the columnwise copy, which is stored transposed). Pad rows at the
    tail are stripped down to ``rows``. A per-tensor scale is the ``local`` shard's.
    """
    first = shards[local]
    n = first.shape[dim]
    per_tensor = tuple(first.block) == tuple(first.shape)
    block = first.block[dim]
    if not per_tensor and n % block:
        raise ValueError(
            f"a GTP shard of {n} rows splits the {first.block} blocks of {first.fmt.name}: "
            f"pad GTP shards to a multiple of {block} rows (gtp_pad_alignment)"
        )
    packed = 2 if first.fmt is E2M1 and dim == 1 else 1  # FP4 packs pairs along the last dim
    data = torch.cat([s.data for s in shards], dim=dim).narrow(dim, 0, rows // packed)
    shape = list(first.shape)
    shape[dim] = rows
    if per_tensor:
        scale_inv, new_block = first.scale_inv, tuple(shape)
    else:
        scale_inv = torch.cat([s.scale_inv for s in shards], dim=dim).narrow(dim, 0, -(-rows // block))
        new_block = first.block
    return dataclasses.replace(first, data=data.contiguous(), scale_inv=scale_inv.contiguous(),
                               block=new_block, shape=tuple(shape))


def group_gather(group) -> Gather:
    """Gather over a process group (one rank: itself)."""

    def gather(t: torch.Tensor) -> list[torch.Tensor]:
        if group is None:
            return [t]
        parts = [torch.empty_like(t) for _ in range(comm.size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return parts

    return gather


def update_weight_scale(quantizers: LinearQuantizers) -> None:
    """Delayed scaling of a GTP weight: the forward scale update the wrapper hides from
    ``LinearQuantizers.update_forward`` (reduce the amax, roll the history, new scale)."""
    inner = getattr(quantizers.weight, "inner", None)
    if isinstance(inner, DelayedScalingQuantizer):
        inner.update()
