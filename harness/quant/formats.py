"""Low-precision number formats: FP8 (E4M3, E5M2), FP4 (E2M1) and the E8M0 scale format.

Every cast here is written so that CPU and CUDA give the same bytes: only IEEE fp32
arithmetic, comparisons, integer bit operations and torch's own FP8 casts (round to
nearest even) are used, never a device library call whose rounding is unspecified.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "E2M1",
    "E4M3",
    "E5M2",
    "E2M1_GRID",
    "FLT_MAX",
    "FloatFormat",
    "cast_to_fp8",
    "e2m1_decode",
    "e2m1_encode",
    "e8m0_decode",
    "e8m0_from_float",
    "e8m0_reciprocal",
    "fp8_decode",
    "pack_fp4",
    "unpack_fp4",
]

FLT_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True, slots=True)
class FloatFormat:
    """A narrow floating-point element format."""

    name: str
    """Short name as TE spells it: "E4M3", "E5M2", "E2M1"."""
    max: float
    """Largest finite magnitude; casts saturate to it."""
    bits: int
    """Storage width of one element."""
    torch_dtype: torch.dtype | None
    """The torch dtype holding one element, or None where torch has only packed storage."""


E4M3 = FloatFormat(name="E4M3", max=448.0, bits=8, torch_dtype=torch.float8_e4m3fn)
E5M2 = FloatFormat(name="E5M2", max=57344.0, bits=8, torch_dtype=torch.float8_e5m2)
E2M1 = FloatFormat(name="E2M1", max=6.0, bits=4, torch_dtype=None)

# Magnitudes of the eight non-negative E2M1 codes; code = index, sign bit = 8.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# --------------------------------------------------------------------------- FP8


def cast_to_fp8(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Cast fp32 values to an FP8 format with round-to-nearest-even and saturation.

    Matches CUDA's ``__NV_SATFINITE`` conversion TE's kernels use: finite values beyond the
    format maximum and infinities become +-max, NaN stays NaN. torch's E5M2 cast does not
    saturate (and older torch E4M3 casts gave NaN), so values are clamped first; clamping
    cannot change a rounding decision since +-max is itself representable.
    Returns a tensor of ``fmt.torch_dtype``.
    """
    if fmt.bits != 8:
        raise ValueError(f"cast_to_fp8 needs an 8-bit format, got {fmt.name}")
    x = x.to(torch.float32)
    return torch.clamp(x, -fmt.max, fmt.max).to(fmt.torch_dtype)


def fp8_decode(data: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Decode FP8 bytes (uint8 storage or an FP8 tensor) to fp32; exact."""
    if data.dtype == torch.uint8:
        data = data.view(fmt.torch_dtype)
    return data.to(torch.float32)


# --------------------------------------------------------------------------- E2M1


def _e2m1_neighbours(mag: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (code below or equal, code above) for magnitudes in [0, 6]."""
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=mag.device)
    lo = torch.searchsorted(grid, mag.contiguous(), right=True) - 1
    lo = lo.clamp(0, 7)
    hi = (lo + 1).clamp(max=7)
    return lo, hi


def e2m1_encode(
    x: torch.Tensor,
    *,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Encode fp32 values to E2M1 codes (uint8 in 0..15, sign in bit 3), saturating at +-6.

    Round to nearest even by default; ties go to the code with an even mantissa bit, i.e.
    0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4, the thresholds of TE's
    ``cast_to_fp4x2`` (transformer_engine/pytorch/custom_recipes/reference_nvfp4.py).
    Zero and NaN give code 0 (+0), also as in that reference; E2M1 has no NaN or Inf.

    With ``stochastic=True`` a magnitude between grid points lo < v < hi rounds up with
    probability (v - lo) / (hi - lo), using one uniform draw per element from
    ``generator``. The draws are always made on the CPU and then moved, so a seed gives
    the same codes on every device. Hardware SR (``cvt.rs``) uses a Philox stream that
    cannot be reproduced here; only its distribution is emulated.
    """
    x = x.to(torch.float32)
    mag = torch.clamp(x.abs(), max=E2M1.max)
    nan = torch.isnan(mag)
    mag = torch.where(nan, torch.zeros_like(mag), mag)
    lo, hi = _e2m1_neighbours(mag)
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=x.device)
    lo_val, hi_val = grid[lo], grid[hi]
    if stochastic:
        if generator is None:
            raise ValueError("stochastic rounding needs an explicit torch.Generator")
        u = torch.rand(x.shape, generator=generator, dtype=torch.float32, device="cpu")
        u = u.to(x.device)
        span = torch.where(hi > lo, hi_val - lo_val, torch.ones_like(hi_val))
        up = u < (mag - lo_val) / span
    else:
        mid = (lo_val + hi_val) * 0.5  # exact: grid points have few mantissa bits
        hi_even = (hi % 2) == 0
        up = (mag > mid) | ((mag == mid) & hi_even)
    code = torch.where(up & (hi > lo), hi, lo)
    negative = x < 0  # -0.0 is not < 0, so it encodes as +0 like TE's reference
    code = torch.where(negative, code + 8, code)
    return code.to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """Decode E2M1 codes (uint8, 0..15) to fp32; codes 0 and 8 are +0 and -0."""
    table = torch.tensor(
        E2M1_GRID + tuple(-v for v in E2M1_GRID), dtype=torch.float32, device=codes.device
    )
    return table[codes.to(torch.long)]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack E2M1 codes two per byte along the last dim: the even element in the low nibble.

    This is the byte layout of ``torch.float4_e2m1fn_x2`` and of TE's NVFP4 data; the result
    (uint8, last dim halved) can be ``.view(torch.float4_e2m1fn_x2)``.
    """
    if codes.shape[-1] % 2:
        raise ValueError(f"packing FP4 needs an even last dimension, got shape {tuple(codes.shape)}")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: uint8 (or float4_e2m1fn_x2) bytes to codes, last dim doubled."""
    if packed.dtype != torch.uint8:
        packed = packed.view(torch.uint8)
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


# --------------------------------------------------------------------------- E8M0


def e8m0_from_float(val: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 exponent of fp32 values, rounding UP to the next power of two.

    Bit-level copy of TE's ``float_to_e8m0`` (transformer_engine/common/util/ptx_arch_spec.cuh):
    take the fp32 exponent field and add one when any mantissa bit is set, except at
    exponent 254 (saturate, 255 is NaN) and for subnormals at or below 2^-127. NaN gives
    0xFF, +Inf 0xFE (satfinite), zero 0. ``.to(torch.float8_e8m0fnu)`` rounds to nearest
    instead, so it is not used.
    """
    val = val.to(torch.float32).contiguous()
    bits = val.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    round_up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    out = exponent + round_up.to(torch.int32)
    out = torch.where(val == 0, torch.zeros_like(out), out)
    out = torch.where(torch.isinf(val), torch.full_like(out, 0xFE), out)
    out = torch.where(torch.isnan(val), torch.full_like(out, 0xFF), out)
    return out.to(torch.uint8)


def _float_from_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).contiguous().view(torch.float32)


def e8m0_decode(exponent: torch.Tensor) -> torch.Tensor:
    """2^(e - 127) as fp32 for biased exponents e (uint8); 255 decodes to NaN.

    Built from bits (TE's ``ptx::exp2f``) so that 2^-127, a subnormal, is exact everywhere.
    """
    e = exponent.to(torch.int32)
    bits = e << 23
    bits = torch.where(e == 0, torch.full_like(bits, 0x00400000), bits)
    bits = torch.where(e == 255, torch.full_like(bits, 0x7FFFFFFF), bits)
    return _float_from_bits(bits)


def e8m0_reciprocal(exponent: torch.Tensor) -> torch.Tensor:
    """2^(127 - e) as fp32: the multiplier that brings a block into FP8 range.

    Mirrors TE's ``ptx::exp2f_rcp`` (transformer_engine/common/util/ptx.cuh): 254 gives the
    subnormal 2^-127, 255 gives NaN.
    """
    e = exponent.to(torch.int32)
    bits = (254 - e) << 23
    bits = torch.where(e == 254, torch.full_like(bits, 0x00400000), bits)
    bits = torch.where(e == 255, torch.full_like(bits, 0x7FFFFFFF), bits)
    return _float_from_bits(bits)
