"""Extra peak memory of ``harness.compare.metrics.metrics`` on one pair, beside its anchors.

Each figure comes from a fresh process (peak RSS only grows): the pair is built, the peak
noted, the method run, and the growth of the peak divided by the pair's bytes.

    PYTHONPATH=. python benchmarks/compare_memory.py [--numel 16777216 67108864]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys

CHILD = """
import json, resource, sys, torch
torch.set_num_threads(1)
from benchmarks.compare_throughput import _assert_close, _clone, _fused
from harness.compare.metrics import metrics
method, numel = sys.argv[1], int(sys.argv[2])
r = torch.randn(numel); c = r + 1e-3 * torch.randn(numel)
fn = {"metrics": metrics, "assert_close": _assert_close, "fused": _fused, "clone": _clone}[method]
fn(r[:1024], c[:1024])  # warm-up: library pools and kernels loaded before the baseline
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
kept = fn(r, c)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps([before * 1024, after * 1024, 2 * numel * 4]))
"""


def measure(method: str, numel: int) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD, method, str(numel)], capture_output=True, text=True,
                         check=True)
    before, after, pair = json.loads(out.stdout.strip().splitlines()[-1])
    return (after - before) / pair


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, nargs="+", default=[1 << 24, 1 << 26])
    args = ap.parse_args()
    print(f"# {platform.machine()}, fp32 pairs, extra peak RSS / pair bytes (fresh process each)")
    print("| numel | pair MiB | metrics | assert_close | fused | clone |")
    print("|---|---|---|---|---|---|")
    for numel in args.numel:
        row = {m: measure(m, numel) for m in ("metrics", "assert_close", "fused", "clone")}
        print(f"| {numel} | {2 * numel * 4 / 2**20:.0f} | " + " | ".join(f"{v:.2f}x"
                                                                         for v in row.values()) + " |",
              flush=True)


if __name__ == "__main__":
    main()
