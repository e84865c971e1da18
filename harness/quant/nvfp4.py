"""NVFP4: E2M1 elements, E4M3 scales per 16 elements and one fp32 scale per tensor.

Follows TE's NVFP4QuantizerRef (transformer_engine/pytorch/custom_recipes/reference_nvfp4.py)
and, where the two differ on edge cases, the CUDA kernel
(transformer_engine/common/cast/nvfp4/core_nvfp4.cuh, quantize_transpose_nvfp4.cuh):

    S_enc   = 448 * 6 / global_amax                      (global encode scale)
    S_dec_b = e4m3(block_amax * (S_enc * (1/6)))         (stored per block)
    enc_b   = min(1 / (float(S_dec_b) * (1 / S_enc)), FLT_MAX)
    q       = E2M1(clamp(x * enc_b, -6, 6))

Dequantized value = q * S_dec_b * (1 / S_enc).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .formats import E2M1, E4M3, FLT_MAX, cast_to_fp8, e2m1_encode, pack_fp4
from .hadamard import apply_rht
from .qtensor import (
    AmaxReduction,
    OperandSpec,
    Quantized,
    QuantizedTensor,
    Quantizer,
    abs_max,
    as_2d,
    block_abs_max,
    check_usage,
    expand_blocks,
    reduce_amax,
)

__all__ = ["NVFP4Quantizer", "nvfp4_global_encode_scale"]

NVFP4_BLOCK = 16
_FP4_X_FP8_MAX = E4M3.max * E2M1.max  # 2688


def nvfp4_global_encode_scale(global_amax: torch.Tensor) -> torch.Tensor:
    """S_enc = 448 * 6 / amax, as ``compute_global_encode_scaling_factor_FP4``.

    Capped at FLT_MAX (``fminf``, which also turns NaN into FLT_MAX); an amax of 0, or one so
    large that the scale is 0, gives 1. (TE's Python reference keeps FLT_MAX for amax 0; the
    data bytes are all zero either way.)
    """
    amax = global_amax.to(torch.float32)
    s = torch.div(_FP4_X_FP8_MAX, amax)
    s = torch.where(torch.isnan(s) | (s > FLT_MAX), torch.full_like(s, FLT_MAX), s)
    return torch.where((amax == 0) | (s == 0), torch.ones_like(s), s)


@dataclass(kw_only=True)
class NVFP4Quantizer(Quantizer):
    """NVFP4 quantizer with TE's options: 2D weight blocks, RHT, stochastic rounding."""

    with_rht: bool = False
    """Apply the 16-point random Hadamard transform to the columnwise copy (inputs, grads)."""
    with_2d_quantization: bool = False
    """16x16 blocks share one scale (weights)."""
    stochastic_rounding: bool = False
    """Round elements stochastically (grads); needs ``generator``."""
    generator: Optional[torch.Generator] = None
    """CPU generator drawing the stochastic rounding decisions."""
    amax_reduction: Optional[AmaxReduction] = None
    """Reduces the global amaxes in place across a group before scaling."""
    fmt = E2M1

    def _check_shape(self, x2: torch.Tensor) -> None:
        rows, cols = x2.shape
        if rows % NVFP4_BLOCK or cols % NVFP4_BLOCK:
            # NVFP4Quantizer.is_quantizable (transformer_engine/pytorch/tensor/nvfp4_tensor.py)
            raise ValueError(
                f"NVFP4 needs both dims of the (flattened) tensor to be multiples of {NVFP4_BLOCK}, "
                f"got {rows}x{cols}"
            )

    def _quantize_matrix(
        self, x: torch.Tensor, global_amax: torch.Tensor, *, columnwise: bool, hadamard: bool
    ) -> QuantizedTensor:
        block = (NVFP4_BLOCK, NVFP4_BLOCK) if self.with_2d_quantization else (1, NVFP4_BLOCK)
        s_enc = nvfp4_global_encode_scale(global_amax)
        s_dec = torch.div(1.0, s_enc)
        fp4_max_inv = torch.tensor(1.0 / E2M1.max, dtype=torch.float32, device=x.device)
        block_amax = block_abs_max(x, block)
        scale_fp8 = cast_to_fp8(torch.clamp(block_amax * (s_enc * fp4_max_inv), max=FLT_MAX), E4M3)
        encode = torch.div(1.0, scale_fp8.to(torch.float32) * s_dec)
        encode = torch.clamp(encode, max=FLT_MAX)
        scaled = x.to(torch.float32) * expand_blocks(encode, block, tuple(x.shape))
        scaled = torch.clamp(scaled, -E2M1.max, E2M1.max)
        codes = e2m1_encode(scaled, stochastic=self.stochastic_rounding, generator=self.generator)
        return QuantizedTensor(
            data=pack_fp4(codes), scale_inv=scale_fp8.view(torch.uint8), scale_format="e4m3", fmt=E2M1,
            block=block, shape=tuple(x.shape), columnwise=columnwise, amax=global_amax,
            global_scale_inv=s_dec, hadamard=hadamard,
        )

    def quantize(
        self,
        x: torch.Tensor,
        *,
        rowwise: bool = True,
        columnwise: bool = True,
        amax: Optional[torch.Tensor] = None,
        columnwise_amax: Optional[torch.Tensor] = None,
    ) -> Quantized:
        """Quantize rowwise (blocks along rows) and/or columnwise (of x.T, RHT'd if enabled).

        ``amax`` overrides the global amax of x (e.g. the amax of the full weight a GTP shard
        belongs to). With RHT the columnwise copy is scaled by the amax of the transformed
        tensor (TE's ``with_post_rht_amax``); ``columnwise_amax`` overrides that one; without
        RHT it equals ``amax``.
        """
        check_usage(rowwise, columnwise)
        x2 = as_2d(x)
        self._check_shape(x2)
        if amax is None:
            amax = reduce_amax(abs_max(x2), self.amax_reduction)
        amax = torch.as_tensor(amax, dtype=torch.float32, device=x.device).reshape(1)
        out = Quantized()
        if rowwise:
            out.rowwise = self._quantize_matrix(x2, amax, columnwise=False, hadamard=False)
        if columnwise:
            xt = x2.t().contiguous()
            if self.with_rht:
                xt = apply_rht(xt)
                if columnwise_amax is None:
                    columnwise_amax = reduce_amax(abs_max(xt), self.amax_reduction)
            elif columnwise_amax is None:
                columnwise_amax = amax
            col_amax = torch.as_tensor(columnwise_amax, dtype=torch.float32, device=x.device).reshape(1)
            out.columnwise = self._quantize_matrix(xt, col_amax, columnwise=True, hadamard=self.with_rht)
        return out

    def spec(self, usage: str) -> OperandSpec:
        """Describe the rowwise or columnwise copy."""
        if self.with_2d_quantization:
            block = (NVFP4_BLOCK, NVFP4_BLOCK)
        else:
            block = (1, NVFP4_BLOCK) if usage == "rowwise" else (NVFP4_BLOCK, 1)
        return OperandSpec(
            fmt=E2M1.name, scaling="block", block=block, scale_format="e4m3 x fp32",
            hadamard=self.with_rht and usage == "columnwise",
            stochastic_rounding=self.stochastic_rounding,
        )
