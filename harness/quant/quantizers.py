"""FP8 quantizers of Transformer Engine's recipes, emulated in plain PyTorch.

Each quantizer turns a high-precision matrix into a :class:`Quantized` pair: the rowwise
copy (blocks along the last dim, used by fprop and dgrad's first operand) and the
columnwise copy (used by the GEMMs that contract over the first dim). Like TE's reference
quantizers, a columnwise copy is stored as the quantized *transpose*, so both copies are
matrices whose blocks run along their own last dim and ``dequantize()`` of the columnwise
copy approximates ``x.T``.

Non-finite inputs follow TE's CUDA kernels, which differ from its Python references there:
amaxes ignore NaN (the kernels reduce with ``fmaxf``), and an amax of 0, Inf or NaN gives a
scale of 1 (``compute_scale_from_amax``), where the references give NaN or 0 scales.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .formats import (
    E2M1,
    FLT_MAX,
    FloatFormat,
    cast_to_fp8,
    e2m1_decode,
    e8m0_decode,
    e8m0_from_float,
    e8m0_reciprocal,
    fp8_decode,
    unpack_fp4,
)
from .hadamard import undo_rht

__all__ = [
    "AmaxReduction",
    "CurrentScalingQuantizer",
    "DelayedScalingQuantizer",
    "Float8BlockQuantizer",
    "MXFP8Quantizer",
    "OperandSpec",
    "Quantized",
    "QuantizedTensor",
    "Quantizer",
    "abs_max",
    "as_2d",
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


def _reduce(amax: torch.Tensor, reduction: Optional[AmaxReduction]) -> torch.Tensor:
    if reduction is not None:
        amax = amax.clone()
        reduction(amax)
    return amax


def _check_usage(rowwise: bool, columnwise: bool) -> None:
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


def _per_tensor_copies(
    x2: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, fmt: FloatFormat, rowwise: bool, columnwise: bool
) -> Quantized:
    # One cast serves both copies: per-tensor columnwise data is the transpose of the
    # rowwise data (TE's reference_current_scaling.py _quantize).
    data = cast_to_fp8(x2.to(torch.float32) * scale, fmt).view(torch.uint8)
    scale_inv = torch.div(1.0, scale)
    rows, cols = data.shape
    out = Quantized()
    if rowwise:
        out.rowwise = QuantizedTensor(
            data=data, scale_inv=scale_inv, scale_format="fp32", fmt=fmt,
            block=(rows, cols), shape=(rows, cols), amax=amax,
        )
    if columnwise:
        out.columnwise = QuantizedTensor(
            data=data.t().contiguous(), scale_inv=scale_inv, scale_format="fp32", fmt=fmt,
            block=(cols, rows), shape=(cols, rows), columnwise=True, amax=amax,
        )
    return out


# --------------------------------------------------------------------------- per-tensor


@dataclass(kw_only=True)
class CurrentScalingQuantizer(Quantizer):
    """Per-tensor scaling from this tensor's own amax (TE's Float8CurrentScalingQuantizer)."""

    fmt: FloatFormat
    """E4M3 or E5M2."""
    power_2_scale: bool = False
    """Round the scale down to a power of two."""
    amax_epsilon: float = 0.0
    """Floor for the amax."""
    amax_reduction: Optional[AmaxReduction] = None
    """Reduces the local amax across a group before the scale is computed."""

    def compute_amax(self, x: torch.Tensor) -> torch.Tensor:
        """Local amax (NaN ignored), shape (1,)."""
        return abs_max(x)

    def scale(self, amax: torch.Tensor) -> torch.Tensor:
        """Quantization scale for a given amax."""
        return scale_from_amax(amax, self.fmt.max, power_2=self.power_2_scale, epsilon=self.amax_epsilon)

    def quantize(self, x, *, rowwise=True, columnwise=True, amax=None) -> Quantized:
        """Quantize with scale ``fp8_max / amax``; ``amax`` overrides local amax and reduction."""
        _check_usage(rowwise, columnwise)
        x2 = as_2d(x)
        if amax is None:
            amax = _reduce(self.compute_amax(x2), self.amax_reduction)
        amax = torch.as_tensor(amax, dtype=torch.float32, device=x.device).reshape(1)
        return _per_tensor_copies(x2, self.scale(amax), amax, self.fmt, rowwise, columnwise)

    def spec(self, usage: str) -> OperandSpec:
        """Describe the per-tensor copy."""
        return OperandSpec(
            fmt=self.fmt.name, scaling="per-tensor current", block=None,
            scale_format="fp32 power-of-2" if self.power_2_scale else "fp32",
        )


@dataclass(kw_only=True)
class DelayedScalingQuantizer(Quantizer):
    """Per-tensor scaling with the scale from earlier steps (TE's delayed scaling state).

    ``quantize`` uses the current ``scale`` and records the tensor's amax in
    ``amax_history[0]`` (max over all quantizations since the last update, as TE's cast
    kernels atomically max into it). ``update`` then reduces that amax, rolls the history and
    computes the next scale, as TE does at the end of forward / backward.
    """

    fmt: FloatFormat
    """E4M3 or E5M2."""
    margin: int = 0
    """Scale is divided by 2**margin."""
    amax_history_len: int = 1024
    """Length of the amax window."""
    amax_compute_algo: object = "max"
    """"max", "most_recent" or a callable ``f(amax_history) -> amax``."""
    scaling_factor_compute_algo: Optional[Callable] = None
    """Optional ``f(amax, scale, fp8_max, recipe) -> scale``, as TE's recipe field."""
    amax_reduction: Optional[AmaxReduction] = None
    """Reduces amax_history[0] in place across the amax group before each update."""
    recipe: object = None
    """The recipe passed to ``scaling_factor_compute_algo``."""
    device: torch.device | str = "cpu"
    """Where the state lives."""
    scale: torch.Tensor = field(init=False)
    """Current quantization scale, shape (1,)."""
    amax_history: torch.Tensor = field(init=False)
    """Amax history, shape (amax_history_len,); slot 0 collects the current step."""

    def __post_init__(self) -> None:
        if self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be >= 1, got {self.amax_history_len}")
        # Initial state of DelayedScalingRecipeState (transformer_engine/pytorch/quantization.py).
        self.scale = torch.ones(1, dtype=torch.float32, device=self.device)
        self.amax_history = torch.zeros(self.amax_history_len, dtype=torch.float32, device=self.device)

    def quantize(self, x, *, rowwise=True, columnwise=True, amax=None) -> Quantized:
        """Quantize with the current scale and record the amax (``amax`` overrides it)."""
        _check_usage(rowwise, columnwise)
        x2 = as_2d(x)
        if amax is None:
            amax = abs_max(x2)
        amax = torch.as_tensor(amax, dtype=torch.float32, device=self.amax_history.device).reshape(1)
        self.amax_history[0] = torch.fmax(self.amax_history[0], amax[0])
        scale = self.scale.to(x.device).clone()
        return _per_tensor_copies(x2, scale, amax.to(x.device), self.fmt, rowwise, columnwise)

    def update(self) -> None:
        """Reduce amax, roll the history, compute the next scale.

        Default algorithms follow the fused kernel TE uses by default (``kernel_bulk`` in
        transformer_engine/common/recipe/delayed_scaling.cu): a step whose amax is 0 leaves
        history and scale untouched, NaN entries are ignored by the max. Callable algorithms
        follow TE's unfused Python path (``_amax_and_scale_update`` in
        transformer_engine/pytorch/quantization.py).
        """
        history = self.amax_history
        history[0] = _reduce(history[0:1], self.amax_reduction)[0]
        fp8_max = self.fmt.max
        if callable(self.amax_compute_algo) or self.scaling_factor_compute_algo is not None:
            self._unfused_update(fp8_max)
            return
        last = history[0].clone()
        if last.item() == 0.0:
            return  # fused kernel: no roll, amax 0 -> scale kept
        rolled = torch.roll(history, -1, 0)
        rolled[-1] = last
        window = rolled.clone()
        rolled[0] = 0.0
        if self.amax_compute_algo == "max":
            amax = torch.where(torch.isnan(window), torch.zeros_like(window), window).max()
        elif self.amax_compute_algo == "most_recent":
            amax = last
        else:
            raise ValueError(f"unknown amax_compute_algo {self.amax_compute_algo!r}")
        history.copy_(rolled)
        scaled_max = fp8_max * 2.0 ** (-self.margin)
        if torch.isfinite(amax) and amax > 0:
            new = torch.div(torch.tensor(scaled_max, dtype=torch.float32, device=amax.device), amax)
        else:
            new = self.scale[0].clone()
        if torch.isinf(new):
            new = torch.tensor(FLT_MAX, dtype=torch.float32, device=amax.device)
        self.scale[0] = new

    def _unfused_update(self, fp8_max: float) -> None:
        history = self.amax_history
        algo = self.amax_compute_algo
        if callable(algo):
            amax = algo(history)
        elif algo == "max":
            amax = history.max()
        else:
            amax = history[0].clone()
        if history.shape[0] > 1:
            history.copy_(torch.roll(history, -1, 0))
        history[0] = 0.0
        amax = torch.as_tensor(amax, dtype=torch.float32, device=history.device)
        if self.scaling_factor_compute_algo is not None:
            new = self.scaling_factor_compute_algo(amax, self.scale, fp8_max, self.recipe)
        else:
            # _default_sf_compute
            new = (fp8_max / amax) / (2**self.margin)
            new = torch.where(amax > 0.0, new, self.scale)
            new = torch.where(torch.isfinite(amax), new, self.scale)
            new = torch.where(torch.isinf(new), torch.full_like(new, FLT_MAX), new)
        self.scale.copy_(torch.as_tensor(new, dtype=torch.float32).reshape(1))

    def spec(self, usage: str) -> OperandSpec:
        """Describe the per-tensor copy."""
        return OperandSpec(fmt=self.fmt.name, scaling="per-tensor delayed", block=None, scale_format="fp32")


# --------------------------------------------------------------------------- FP8 block


@dataclass(kw_only=True)
class Float8BlockQuantizer(Quantizer):
    """FP8 with fp32 scales per 1x128 or 128x128 block (TE's Float8BlockQuantizer).

    From BlockwiseQuantizerReference (tests/pytorch/references/blockwise_quantizer_reference.py):
    partial blocks are zero-padded; the 1D columnwise copy is quantized separately from x.T
    with 1x128 blocks (128x1 on x); the 2D columnwise copy is the transpose of the rowwise one.
    """

    fmt: FloatFormat
    """E4M3 or E5M2."""
    block_scaling_dim: int = 1
    """1 for 1x128 blocks, 2 for 128x128."""
    power_2_scale: bool = True
    """Round scales down to powers of two (TE's default for this recipe)."""
    amax_epsilon: float = 0.0
    """Floor for block amaxes."""
    block_len: int = 128
    """Block edge."""

    def __post_init__(self) -> None:
        if self.block_scaling_dim not in (1, 2):
            raise ValueError(f"block_scaling_dim must be 1 or 2, got {self.block_scaling_dim}")

    def _quantize_matrix(self, x: torch.Tensor, block: tuple[int, int], columnwise: bool) -> QuantizedTensor:
        amax = block_abs_max(x, block)
        value_for_inf = torch.finfo(x.dtype).max  # compute_scale_from_types uses the input type
        scale = scale_from_amax(
            amax, self.fmt.max, power_2=self.power_2_scale, epsilon=self.amax_epsilon, value_for_inf=value_for_inf
        )
        full = expand_blocks(scale, block, tuple(x.shape))
        data = cast_to_fp8(x.to(torch.float32) * full, self.fmt).view(torch.uint8)
        return QuantizedTensor(
            data=data, scale_inv=torch.div(1.0, scale), scale_format="fp32", fmt=self.fmt,
            block=block, shape=tuple(x.shape), columnwise=columnwise,
        )

    def quantize(self, x, *, rowwise=True, columnwise=True, amax=None) -> Quantized:
        """Quantize rowwise and/or columnwise; any shape, partial blocks allowed."""
        _check_usage(rowwise, columnwise)
        if amax is not None:
            raise ValueError("block-scaled FP8 has no per-tensor amax to override")
        x2 = as_2d(x)
        n = self.block_len
        out = Quantized()
        if self.block_scaling_dim == 2:
            q = self._quantize_matrix(x2, (n, n), columnwise=False)
            if rowwise:
                out.rowwise = q
            if columnwise:
                out.columnwise = QuantizedTensor(
                    data=q.data.t().contiguous(), scale_inv=q.scale_inv.t().contiguous(), scale_format="fp32",
                    fmt=self.fmt, block=(n, n), shape=(q.shape[1], q.shape[0]), columnwise=True,
                )
            return out
        if rowwise:
            out.rowwise = self._quantize_matrix(x2, (1, n), columnwise=False)
        if columnwise:
            out.columnwise = self._quantize_matrix(x2.t().contiguous(), (1, n), columnwise=True)
        return out

    def spec(self, usage: str) -> OperandSpec:
        """Describe the rowwise or columnwise copy."""
        n = self.block_len
        if self.block_scaling_dim == 2:
            block = (n, n)
        else:
            block = (1, n) if usage == "rowwise" else (n, 1)
        return OperandSpec(
            fmt=self.fmt.name, scaling="block", block=block,
            scale_format="fp32 power-of-2" if self.power_2_scale else "fp32",
        )


# --------------------------------------------------------------------------- MXFP8


@dataclass(kw_only=True)
class MXFP8Quantizer(Quantizer):
    """MXFP8: FP8 elements with an E8M0 (power-of-two) scale per 32 elements.

    Scale exponent = round-up of log2(block_amax / fp8_max), bit by bit as TE's
    ``float_to_e8m0(amax * max_norm_rcp)`` (transformer_engine/common/cast/mxfp8/quantize_mxfp8.cuh);
    elements are ``cast(x * 2^(127 - e))``. Rowwise blocks are 1x32, columnwise 32x1,
    each quantized from the high-precision input; with ``with_2d_quantization`` a 32x32
    block shares one scale (tests/pytorch/test_mxfp8_2d_quantize.py).
    """

    fmt: FloatFormat
    """E4M3 or E5M2."""
    with_2d_quantization: bool = False
    """One scale per 32x32 block (weights, MXFP8BlockScaling.enable_2d_quantization)."""
    block_len: int = 32
    """Block length."""

    def _check_shape(self, x2: torch.Tensor) -> None:
        rows, cols = x2.shape
        n = self.block_len
        if rows % n or cols % n:
            # MXFP8Quantizer.is_quantizable (transformer_engine/pytorch/tensor/mxfp8_tensor.py)
            raise ValueError(
                f"MXFP8 needs both dims of the (flattened) tensor to be multiples of {n}, "
                f"got {rows}x{cols}; pad the tensor (TE pads GEMM inputs to 32)"
            )

    def _quantize_matrix(self, x: torch.Tensor, block: tuple[int, int], columnwise: bool) -> QuantizedTensor:
        amax = block_abs_max(x, block)
        rcp = torch.tensor(1.0 / self.fmt.max, dtype=torch.float32, device=x.device)
        exponent = e8m0_from_float(amax * rcp)
        multiplier = expand_blocks(e8m0_reciprocal(exponent), block, tuple(x.shape))
        data = cast_to_fp8(x.to(torch.float32) * multiplier, self.fmt).view(torch.uint8)
        return QuantizedTensor(
            data=data, scale_inv=exponent, scale_format="e8m0", fmt=self.fmt,
            block=block, shape=tuple(x.shape), columnwise=columnwise,
        )

    def quantize(self, x, *, rowwise=True, columnwise=True, amax=None) -> Quantized:
        """Quantize rowwise (1x32) and/or columnwise (32x1, stored transposed)."""
        _check_usage(rowwise, columnwise)
        if amax is not None:
            raise ValueError("MXFP8 has no per-tensor amax to override")
        x2 = as_2d(x)
        self._check_shape(x2)
        n = self.block_len
        out = Quantized()
        if self.with_2d_quantization:
            q = self._quantize_matrix(x2, (n, n), columnwise=False)
            if rowwise:
                out.rowwise = q
            if columnwise:
                out.columnwise = QuantizedTensor(
                    data=q.data.t().contiguous(), scale_inv=q.scale_inv.t().contiguous(), scale_format="e8m0",
                    fmt=self.fmt, block=(n, n), shape=(q.shape[1], q.shape[0]), columnwise=True,
                )
            return out
        if rowwise:
            out.rowwise = self._quantize_matrix(x2, (1, n), columnwise=False)
        if columnwise:
            out.columnwise = self._quantize_matrix(x2.t().contiguous(), (1, n), columnwise=True)
        return out

    def spec(self, usage: str) -> OperandSpec:
        """Describe the rowwise or columnwise copy."""
        n = self.block_len
        if self.with_2d_quantization:
            block = (n, n)
        else:
            block = (1, n) if usage == "rowwise" else (n, 1)
        return OperandSpec(fmt=self.fmt.name, scaling="block", block=block, scale_format="e8m0")
