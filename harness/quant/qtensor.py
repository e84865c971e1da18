"""Quantized tensors, the quantizer interface and the scale rules shared by all recipes.

A quantizer turns a high-precision matrix into a :class:`Quantized` pair: the rowwise copy
(blocks along the last dim, used by fprop and dgrad's first operand) and the columnwise copy
(used by the GEMMs that contract over the first dim). Like TE's reference quantizers, a
columnwise copy is stored as the quantized *transpose*, so both copies are matrices whose
blocks run along their own last dim and ``dequantize()`` of the columnwise copy
approximates ``x.T``.

Non-finite inputs follow TE's CUDA kernels, which differ from its Python references there:
amaxes ignore NaN (the kernels reduce with ``fmaxf``), and an amax of 0, Inf or NaN gives a
scale of 1 (``compute_scale_from_amax``), where the references give NaN or 0 scales.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .formats import E2M1, FLT_MAX, FloatFormat, e2m1_decode, e8m0_decode, fp8_decode, unpack_fp4
from .hadamard import undo_rht

__all__ = [
    "AmaxReduction",
    "OperandSpec",
    "Quantized",
    "QuantizedTensor",
    "Quantizer",
    "abs_max",
    "as_2d",
    "block_abs_max",
    "check_usage",
    "expand_blocks",
    "reduce_amax",
    "scale_from_amax",
]

AmaxReduction = Callable[[torch.Tensor], object]
"""Reduces a float32 amax tensor in place across a group (e.g. ``dist.all_reduce`` with MAX)."""


# --------------------------------------------------------------------------- results


@dataclass(kw_only=True, slots=True)
class QuantizedTensor:
    """One quantized matrix: element codes, block scales and how to decode them."""

    data: torch.Tensor
    """uint8 codes, shape ``shape``; for FP4 two codes per byte, last dim halved."""
    scale_inv: torch.Tensor
    """Decode scale per block, shape ``ceil(rows / block[0]) x ceil(cols / block[1])``;
    float32, or uint8 bytes when ``scale_format`` is "e8m0" or "e4m3"."""
    scale_format: str
    """"fp32", "e8m0" (biased exponent) or "e4m3" (FP8 bytes)."""
    fmt: FloatFormat
    """Element format."""
    block: tuple[int, int]
    """Block shape in this matrix's own orientation; per-tensor scaling uses the full shape."""
    shape: tuple[int, int]
    """Logical (rows, cols) of the stored matrix."""
    columnwise: bool = False
    """True when this holds the transpose of the quantized operand."""
    amax: Optional[torch.Tensor] = None
    """The per-tensor amax the scales came from, where the format has one."""
    global_scale_inv: Optional[torch.Tensor] = None
    """NVFP4 second-level fp32 decode scale (1 / S_enc)."""
    hadamard: bool = False
    """True when the values were Hadamard transformed along the last dim before quantizing."""

    def as_float8(self) -> torch.Tensor:
        """The data viewed as the torch FP8 dtype of ``fmt`` (FP8 formats only)."""
        if self.fmt.torch_dtype is None:
            raise TypeError(f"{self.fmt.name} has no element dtype in torch")
        return self.data.view(self.fmt.torch_dtype)

    def block_scale_factors(self) -> torch.Tensor:
        """Decode scale per block as fp32, second-level NVFP4 scale not included."""
        if self.scale_format == "fp32":
            return self.scale_inv.to(torch.float32)
        if self.scale_format == "e8m0":
            return e8m0_decode(self.scale_inv)
        if self.scale_format == "e4m3":
            return self.scale_inv.view(torch.float8_e4m3fn).to(torch.float32)
        raise ValueError(f"unknown scale format {self.scale_format!r}")

    def decoded_elements(self) -> torch.Tensor:
        """Element values as fp32 before scaling."""
        if self.fmt is E2M1:
            return e2m1_decode(unpack_fp4(self.data))
        return fp8_decode(self.data, self.fmt)

    def dequantize(self, dtype: torch.dtype = torch.float32, *, undo_hadamard: bool = False) -> torch.Tensor:
        """High-precision values of the stored matrix (transposed operand if ``columnwise``).

        Values stay in the Hadamard domain unless ``undo_hadamard``: a GEMM whose two
        operands were both transformed along the contraction dim needs no inverse.
        """
        rows, cols = self.shape
        scales = expand_blocks(self.block_scale_factors(), self.block, self.shape)
        out = self.decoded_elements() * scales
        if self.global_scale_inv is not None:
            out = out * self.global_scale_inv.to(torch.float32)
        if undo_hadamard and self.hadamard:
            out = undo_rht(out)
        return out.reshape(rows, cols).to(dtype)


@dataclass(kw_only=True, slots=True)
class Quantized:
    """The copies a quantizer produced for one tensor; unrequested copies are None."""

    rowwise: Optional[QuantizedTensor] = None
    columnwise: Optional[QuantizedTensor] = None


@dataclass(frozen=True, kw_only=True, slots=True)
class OperandSpec:
    """How one GEMM operand is quantized, in words a report can print."""

    fmt: str
    """Element format name."""
    scaling: str
    """"per-tensor delayed", "per-tensor current", "block" ..."""
    block: Optional[tuple[int, int]]
    """Block shape in the operand's original orientation, None for per-tensor."""
    scale_format: str
    """"fp32", "fp32 power-of-2", "e8m0", "e4m3 x fp32"."""
    hadamard: bool = False
    """Random Hadamard transform applied before quantizing."""
    stochastic_rounding: bool = False
    """Elements rounded stochastically instead of to nearest even."""


# --------------------------------------------------------------------------- helpers


def as_2d(x: torch.Tensor) -> torch.Tensor:
    """View a tensor as a matrix the way TE's quantizers do: leading dims flattened."""
    if x.dim() == 0:
        return x.reshape(1, 1)
    if x.dim() == 1:
        return x.reshape(1, -1)
    return x.reshape(-1, x.shape[-1])


def abs_max(x: torch.Tensor, dims: Optional[tuple[int, ...]] = None) -> torch.Tensor:
    """Max of |x| in float32, ignoring NaN as TE's ``fmaxf`` reductions do; 0 when empty."""
    a = x.detach().to(torch.float32).abs()
    a = torch.where(torch.isnan(a), torch.zeros_like(a), a)
    if dims is None:
        if a.numel() == 0:
            return torch.zeros(1, dtype=torch.float32, device=x.device)
        return a.amax().reshape(1)
    return a.amax(dim=dims)


def expand_blocks(per_block: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """Broadcast a per-block tensor to a full matrix of ``shape`` (last blocks may be partial)."""
    rows, cols = shape
    per_block = per_block.reshape(-(-rows // block[0]), -(-cols // block[1]))
    full = per_block.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return full[:rows, :cols]


def _pad_to(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = x.shape
    pad_r = -rows % block[0]
    pad_c = -cols % block[1]
    if pad_r or pad_c:
        x = torch.nn.functional.pad(x, (0, pad_c, 0, pad_r))
    return x


def block_abs_max(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Amax per block of a matrix, zero-padding partial blocks (as TE's references pad)."""
    padded = _pad_to(x, block)
    rows, cols = padded.shape
    tiles = padded.reshape(rows // block[0], block[0], cols // block[1], block[1])
    return abs_max(tiles, dims=(1, 3))


def scale_from_amax(
    amax: torch.Tensor,
    fp8_max: float,
    *,
    power_2: bool = False,
    epsilon: float = 0.0,
    value_for_inf: float = FLT_MAX,
) -> torch.Tensor:
    """Quantization scale ``fp8_max / amax`` with TE's rules for extreme amaxes.

    From ``compute_scale_from_amax`` (transformer_engine/common/recipe/recipe_common.cuh):
    amax below ``epsilon`` is raised to it; amax 0, Inf or NaN gives scale 1; a scale that
    overflows to Inf becomes ``value_for_inf`` (FLT_MAX for per-tensor scaling, the input
    dtype's max for block scaling); ``power_2`` clears the mantissa bits, i.e. rounds the
    scale down to a power of two.
    """
    amax = amax.to(torch.float32)
    amax = torch.where(amax < epsilon, torch.full_like(amax, epsilon), amax)
    scale = torch.div(fp8_max, amax)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, value_for_inf), scale)
    if power_2:
        bits = scale.contiguous().view(torch.int32) & -(1 << 23)  # 0xFF800000: sign + exponent
        scale = bits.view(torch.float32)
    special = torch.isinf(amax) | torch.isnan(amax) | (amax == 0)
    return torch.where(special, torch.ones_like(scale), scale)


def reduce_amax(amax: torch.Tensor, reduction: Optional[AmaxReduction]) -> torch.Tensor:
    """A reduced copy of ``amax`` (the caller's tensor is left alone); unchanged without a reducer."""
    if reduction is not None:
        amax = amax.clone()
        reduction(amax)
    return amax


def check_usage(rowwise: bool, columnwise: bool) -> None:
    """Refuse a request for neither copy."""
    if not (rowwise or columnwise):
        raise ValueError("ask for at least one of rowwise and columnwise")


# --------------------------------------------------------------------------- base


class Quantizer:
    """Base of all quantizers: ``quantize`` a tensor into its rowwise/columnwise copies."""

    fmt: FloatFormat

    def quantize(
        self,
        x: torch.Tensor,
        *,
        rowwise: bool = True,
        columnwise: bool = True,
        amax: Optional[torch.Tensor] = None,
    ) -> Quantized:
        """Quantize ``x`` (leading dims flattened). ``amax`` overrides the per-tensor amax."""
        raise NotImplementedError

    def spec(self, usage: str) -> OperandSpec:
        """Describe the "rowwise" or "columnwise" copy this quantizer produces."""
        raise NotImplementedError
