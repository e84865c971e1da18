"""Throughput of ``harness.compare.metrics.metrics`` beside its anchors, interleaved in one run, one thread.

Anchors per pair: ``torch.testing.assert_close`` (with tolerances wide enough to pass: its
full check), a clone of both sides (memory bandwidth), and a fused loop (one native-dtype
difference, its max and its norm: the least any single eager pass over the pair costs).
Figures are GB/s of input read (both sides), by wall clock and by the process's CPU time
(the steadier figure on a shared machine: another job's time slices do not count in it).

    PYTHONPATH=. python benchmarks/compare_throughput.py [--pairs 32] [--numel 4194304]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from harness.compare.metrics import metrics


def _pairs(n_pairs: int, numel: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    for _ in range(n_pairs):
        r = torch.randn(numel, generator=gen)
        yield r.to(dtype), (r + 1e-3 * torch.randn(numel, generator=gen)).to(dtype)


def _fused(r, c):
    d = c - r
    return float(d.abs().max()), float(torch.linalg.vector_norm(d))


def _assert_close(r, c):
    torch.testing.assert_close(c, r, rtol=1.0, atol=1.0)


def _clone(r, c):
    return r.clone(), c.clone()


def run(n_pairs: int, numel: int, dtype: torch.dtype,
        rounds: int) -> tuple[dict[str, float], dict[str, float]]:
    """GB/s per method: (by wall clock, by process CPU time), best of ``rounds``."""
    pairs = list(_pairs(n_pairs, numel, dtype))
    metrics(*pairs[0])  # the compiled loop loads (or compiles) once per process: not timed
    nbytes = sum(r.numel() * r.element_size() * 2 for r, _ in pairs)
    fns = {"metrics": metrics, "assert_close": _assert_close, "fused": _fused, "clone": _clone}
    wall, cpu = {k: float("inf") for k in fns}, {k: float("inf") for k in fns}
    for _ in range(rounds):  # interleaved: every candidate sees the same machine state
        for name, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            for r, c in pairs:
                fn(r, c)
            wall[name] = min(wall[name], time.perf_counter() - t0)
            cpu[name] = min(cpu[name], time.process_time() - c0)
    return {k: nbytes / t / 1e9 for k, t in wall.items()}, {k: nbytes / t / 1e9 for k, t in cpu.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread, "
          f"best of {args.rounds} interleaved rounds, load average {os.getloadavg()[0]:.1f}")
    print("| dtype | pairs x numel | clock | metrics GB/s | assert_close GB/s | fused GB/s | clone GB/s "
          "| metrics / assert_close | metrics / clone |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dtype, n_pairs, numel in ((torch.float32, 32, 1 << 22), (torch.bfloat16, 32, 1 << 20)):
        for clock, g in zip(("wall", "CPU"), run(n_pairs, numel, dtype, args.rounds)):
            print(f"| {str(dtype)[6:]} | {n_pairs} x {numel} | {clock} | {g['metrics']:.3f} | "
                  f"{g['assert_close']:.3f} "
                  f"| {g['fused']:.3f} | {g['clone']:.3f} | {g['metrics'] / g['assert_close']:.2f}x "
                  f"| {g['metrics'] / g['clone']:.0%} |", flush=True)


if __name__ == "__main__":
    main()
