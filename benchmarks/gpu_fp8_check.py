#!/usr/bin/env python
"""Check the quantization emulation on a GPU.

Part 1 quantizes seeded tensors with every emulated quantizer on the CPU and on the GPU and
compares the results byte for byte (element codes, block scales, global scales, amaxes and
dequantized values). The emulation promises device-independent bytes; any difference is a
failure (exit code 1).

Part 2 (GPU only) compares an emulated FP8 GEMM (dequantize, then an fp32 matmul) with
``torch._scaled_mm`` on the same FP8 bytes and scales: tensorwise scales, rowwise scales and
the 1x128 / 128x128 block scales of TE's Float8BlockScaling where this torch and GPU support
them. Both sides compute the same exact products and differ only in accumulation and output
rounding, so the difference must stay below ``2^-10 * (|A| @ |B|^T)`` (plus half an output
ulp for bf16 outputs); a larger one is a failure (exit code 2).

Without a GPU, part 1 compares the CPU with itself at one thread (parallel reductions must
not change bytes either) and part 2 is skipped. Needs only torch and this repository.

    python benchmarks/gpu_fp8_check.py [--size 512 1024] [--seeds 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.quant import (  # noqa: E402
    E4M3,
    E5M2,
    CurrentScalingQuantizer,
    DelayedScalingQuantizer,
    Float8BlockQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    Quantized,
    QuantizedTensor,
    quantized_matmul,
)

GEMM_REL_TOL = 2.0**-10


# --------------------------------------------------------------------------- part 1


@dataclass
class Case:
    name: str
    make: Callable[[], object]
    """Returns a fresh quantizer (same seed on every call)."""
    any_shape: bool = False
    """Accepts dims that are not multiples of 32."""


def _delayed(fmt):
    def run(x: torch.Tensor) -> Quantized:
        # two steps, so the second cast uses a scale computed by update() on this device
        q = DelayedScalingQuantizer(fmt=fmt, amax_history_len=4, device=x.device)
        q.quantize(x)
        q.update()
        out = q.quantize(x * 0.5)
        q.update()
        out.rowwise.amax = torch.cat([q.scale, q.amax_history])  # state compared as well
        return out

    return run


CASES = [
    Case("current e4m3", lambda: CurrentScalingQuantizer(fmt=E4M3), any_shape=True),
    Case("current e5m2", lambda: CurrentScalingQuantizer(fmt=E5M2), any_shape=True),
    Case("current e4m3 pow2", lambda: CurrentScalingQuantizer(fmt=E4M3, power_2_scale=True), any_shape=True),
    Case("delayed e4m3", lambda: _delayed(E4M3), any_shape=True),
    Case("delayed e5m2", lambda: _delayed(E5M2), any_shape=True),
    Case("block 1x128 e4m3", lambda: Float8BlockQuantizer(fmt=E4M3), any_shape=True),
    Case("block 128x128 e4m3", lambda: Float8BlockQuantizer(fmt=E4M3, block_scaling_dim=2), any_shape=True),
    Case("block 1x128 fp32 e5m2", lambda: Float8BlockQuantizer(fmt=E5M2, power_2_scale=False),
         any_shape=True),
    Case("mxfp8 e4m3", lambda: MXFP8Quantizer(fmt=E4M3)),
    Case("mxfp8 e5m2", lambda: MXFP8Quantizer(fmt=E5M2)),
    Case("mxfp8 2d e4m3", lambda: MXFP8Quantizer(fmt=E4M3, with_2d_quantization=True)),
    Case("nvfp4 1d rht", lambda: NVFP4Quantizer(with_rht=True)),
    Case("nvfp4 2d", lambda: NVFP4Quantizer(with_2d_quantization=True)),
    Case(
        "nvfp4 rht sr",
        lambda: NVFP4Quantizer(with_rht=True, stochastic_rounding=True,
                               generator=torch.Generator().manual_seed(5)),
    ),
]


def inputs(size: tuple[int, int], seeds: int) -> list[tuple[str, torch.Tensor]]:
    """Seeded CPU tensors: wide dynamic range, both dtypes, one with special values."""
    out = []
    for seed in range(seeds):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(size, generator=gen) * torch.exp(2 * torch.randn(size, generator=gen))
        out.append((f"seed{seed} fp32", x))
        out.append((f"seed{seed} bf16", x.to(torch.bfloat16)))
    special = out[0][1].clone()
    special[0, :40] = 0.0  # a zero block
    special[1, 3] = float("inf")
    special[2, 5] = float("nan")
    special[3, :32] = 448.0 * 2.0 ** torch.arange(-8, 24).float()  # exact powers
    special[4, 7] = 1e-40  # subnormal
    out.append(("specials fp32", special))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes; NaNs of a float tensor made canonical first (devices differ in NaN payloads)."""
    t = t.detach().contiguous()
    if t.dtype == torch.uint8:
        return t
    t = torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)
    return t.view(torch.uint8)


def compare_tensors(a: QuantizedTensor, b: QuantizedTensor) -> tuple[int, int]:
    """(bytes compared, bytes different) over every field that carries numbers."""
    total = diff = 0
    fields = [(a.data, b.data), (a.scale_inv, b.scale_inv)]
    for x, y in ((a.global_scale_inv, b.global_scale_inv), (a.amax, b.amax)):
        if x is not None or y is not None:
            fields.append((x, y))
    fields.append((a.dequantize(), b.dequantize()))
    for x, y in fields:
        if x is None or y is None or x.shape != y.shape or x.dtype != y.dtype:
            return total + 1, diff + 1
        bx, by = _bits(x.cpu()), _bits(y.cpu())
        total += bx.numel()
        diff += int((bx != by).sum())
    return total, diff


def run_quantizer(case: Case, x: torch.Tensor) -> Quantized:
    made = case.make()
    return made(x) if callable(made) and not hasattr(made, "quantize") else made.quantize(x)


def part1(device: str, size: tuple[int, int], seeds: int) -> int:
    """Bytes on ``device`` versus CPU; returns the number of mismatching cases."""
    other = device
    if device == "cpu":
        print("no CUDA device: comparing CPU (all threads) with CPU (1 thread)")
    print(f"\n== part 1: quantized bytes, cpu vs {other}, tensors {size[0]}x{size[1]} ==")
    print(f"{'quantizer':<24}{'tensors':>8}{'bytes':>14}{'mismatch':>10}")
    odd = (size[0] - 12, size[1] + 8)  # not multiples of the block, where allowed
    failures = 0
    threads = torch.get_num_threads()
    for case in CASES:
        cases_inputs = inputs(size, seeds) + (inputs(odd, 1)[:1] if case.any_shape else [])
        total = diff = 0
        for label, x in cases_inputs:
            ref = run_quantizer(case, x)
            if device == "cpu":
                torch.set_num_threads(1)
                got = run_quantizer(case, x.clone())
                torch.set_num_threads(threads)
            else:
                got = run_quantizer(case, x.to(device))
            for usage in ("rowwise", "columnwise"):
                t, d = compare_tensors(getattr(ref, usage), getattr(got, usage))
                total, diff = total + t, diff + d
                if d:
                    print(f"   MISMATCH {case.name} / {label} / {usage}: {d} of {t} bytes differ")
        failures += diff > 0
        print(f"{case.name:<24}{len(cases_inputs):>8}{total:>14,}{diff:>10}")
    return failures


# --------------------------------------------------------------------------- part 2


def _report(name: str, out: torch.Tensor, emulated: torch.Tensor, magnitude: torch.Tensor,
            out_ulp: float) -> bool:
    out = out.float()
    diff = (out - emulated).abs()
    bound = GEMM_REL_TOL * magnitude + out_ulp * emulated.abs()
    rel = (diff / magnitude.clamp_min(torch.finfo(torch.float32).tiny)).max().item()
    ok = bool((diff <= bound).all())
    print(f"{name:<34}{diff.max().item():>12.3e}{rel:>19.3e}{'ok' if ok else 'FAIL':>6}")
    return ok


def _block_scales_variants(scale: torch.Tensor) -> list[torch.Tensor]:
    return [scale.t().contiguous().t(), scale.contiguous()]


def part2(device: str, m: int, k: int, n: int, *, on_cpu: bool = False) -> int:
    """Emulated GEMMs versus torch._scaled_mm; returns the number of failures."""
    print(f"\n== part 2: emulated FP8 GEMM vs torch._scaled_mm on {device}, M={m} K={k} N={n} ==")
    if device == "cpu" and not on_cpu:
        print("skipped: no CUDA device (--cpu-gemm runs it against torch's CPU _scaled_mm)")
        return 0
    print("bound per element: 2^-10 * (|A| @ |B|^T) + half an output ulp (bf16: 2^-8 |out|)")
    print(f"{'gemm':<34}{'max |diff|':>12}{'max diff/(|A||B|)':>19}{'':>6}")
    gen = torch.Generator().manual_seed(11)
    a_hp = (torch.randn(m, k, generator=gen) * 2).to(device)
    b_hp = torch.randn(n, k, generator=gen).to(device)
    failures = 0

    def run(name, qa: QuantizedTensor, qb: QuantizedTensor, scale_a, scale_b, out_dtype):
        nonlocal failures
        emulated = quantized_matmul(qa, qb)
        magnitude = qa.dequantize().abs() @ qb.dequantize().abs().t()
        try:
            out = torch._scaled_mm(
                qa.as_float8(), qb.as_float8().t(), scale_a=scale_a, scale_b=scale_b,
                out_dtype=out_dtype, use_fast_accum=False,
            )
        except Exception as err:  # unsupported layouts raise RuntimeError or ValueError
            print(f"{name:<34}  not supported here: {str(err).splitlines()[0][:80]}")
            return
        ulp = 2.0**-8 if out_dtype == torch.bfloat16 else 2.0**-23
        failures += not _report(name, out, emulated, magnitude, ulp)

    for fa, fb in ((E4M3, E4M3), (E5M2, E4M3)):
        qa = CurrentScalingQuantizer(fmt=fa).quantize(a_hp, columnwise=False).rowwise
        qb = CurrentScalingQuantizer(fmt=fb).quantize(b_hp, columnwise=False).rowwise
        for out_dtype in (torch.float32, torch.bfloat16):
            run(f"tensorwise {fa.name}x{fb.name} -> {str(out_dtype)[6:]}", qa, qb,
                qa.scale_inv.reshape(()), qb.scale_inv.reshape(()), out_dtype)

    # one scale per row of A and per row of B (per output column)
    qa = Float8BlockQuantizer(fmt=E4M3, power_2_scale=False, block_len=k).quantize(a_hp,
        columnwise=False).rowwise
    qb = Float8BlockQuantizer(fmt=E4M3, power_2_scale=False, block_len=k).quantize(b_hp,
        columnwise=False).rowwise
    run("rowwise E4M3xE4M3 -> bfloat16", qa, qb, qa.scale_inv.contiguous(), qb.scale_inv.t().contiguous(),
        torch.bfloat16)

    # TE Float8BlockScaling fprop: 1x128 input, 128x128 weight; and 1x128 x 1x128
    qa = Float8BlockQuantizer(fmt=E4M3).quantize(a_hp, columnwise=False).rowwise
    for label, qb in (
        ("block 1x128 x 128x128",
         Float8BlockQuantizer(fmt=E4M3, block_scaling_dim=2).quantize(b_hp, columnwise=False).rowwise),
        ("block 1x128 x 1x128", Float8BlockQuantizer(fmt=E4M3).quantize(b_hp, columnwise=False).rowwise),
    ):
        for out_dtype in (torch.bfloat16, torch.float32):
            done = False
            for sa in _block_scales_variants(qa.scale_inv):
                for sb in _block_scales_variants(qb.scale_inv):
                    try:
                        torch._scaled_mm(qa.as_float8(), qb.as_float8().t(), scale_a=sa, scale_b=sb.t(),
                                         out_dtype=out_dtype, use_fast_accum=False)
                    except Exception:
                        continue
                    run(f"{label} -> {str(out_dtype)[6:]}", qa, qb, sa, sb.t(), out_dtype)
                    done = True
                    break
                if done:
                    break
            if not done:
                run(f"{label} -> {str(out_dtype)[6:]}", qa, qb, qa.scale_inv, qb.scale_inv.t(), out_dtype)
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, nargs=2, default=(512, 1024), help="rows cols of part 1 tensors")
    parser.add_argument("--seeds", type=int, default=3, help="random tensors per dtype in part 1")
    parser.add_argument("--gemm", type=int, nargs=3, default=(512, 1024, 768), help="M K N of part 2")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cpu-gemm", action="store_true",
                        help="run part 2 on the CPU (exercises the script)")
    args = parser.parse_args()
    start = time.time()
    if args.device != "cpu":
        print(f"device: {torch.cuda.get_device_name(args.device)}, torch {torch.__version__}, cuda "
              f"{torch.version.cuda}")
    else:
        print(f"device: cpu, torch {torch.__version__}")
    byte_failures = part1(args.device, tuple(args.size), args.seeds)
    gemm_failures = part2(args.device, *args.gemm, on_cpu=args.cpu_gemm)
    print(f"\nquantizers with byte mismatches: {byte_failures}; GEMMs out of tolerance: {gemm_failures}; "
          f"{time.time() - start:.1f} s")
    if byte_failures:
        print("FAIL: bytes differ between devices")
        return 1
    if gemm_failures:
        print("FAIL: emulated GEMM and torch._scaled_mm differ beyond accumulation tolerance")
        return 2
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
