"""FP8 quantizers of Transformer Engine's recipes: per-tensor (current, delayed), FP8 block
and MXFP8, emulated in plain PyTorch. See :mod:`harness.quant.qtensor` for the layout of
their results and the handling of non-finite values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .formats import FLT_MAX, FloatFormat, cast_to_fp8, e8m0_from_float, e8m0_reciprocal
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
    scale_from_amax,
)

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
    "scale_from_amax",
]


def _per_tensor_copies(
    x2: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, fmt: FloatFormat, rowwise: bool,
        columnwise: bool
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
        check_usage(rowwise, columnwise)
        x2 = as_2d(x)
        if amax is None:
            amax = reduce_amax(self.compute_amax(x2), self.amax_reduction)
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
    amax_compute_algo: str | Callable = "max"
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
        check_usage(rowwise, columnwise)
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
        history[0] = reduce_amax(history[0:1], self.amax_reduction)[0]
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
            amax, self.fmt.max, power_2=self.power_2_scale, epsilon=self.amax_epsilon,
                value_for_inf=value_for_inf
        )
        full = expand_blocks(scale, block, tuple(x.shape))
        data = cast_to_fp8(x.to(torch.float32) * full, self.fmt).view(torch.uint8)
        return QuantizedTensor(
            data=data, scale_inv=torch.div(1.0, scale), scale_format="fp32", fmt=self.fmt,
            block=block, shape=tuple(x.shape), columnwise=columnwise,
        )

    def quantize(self, x, *, rowwise=True, columnwise=True, amax=None) -> Quantized:
        """Quantize rowwise and/or columnwise; any shape, partial blocks allowed."""
        check_usage(rowwise, columnwise)
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
        check_usage(rowwise, columnwise)
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
