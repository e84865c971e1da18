"""The shipped matrices on another megatron-core (a Megatron-LM checkout) beside the installed
wheel: every verdict of both trees and the code comparison of each scenario, with times.

    PYTHONPATH=. python benchmarks/upstream_main.py SPEC [--matrix scenarios/default.toml ...]
        [--out runs/upstream]

SPEC is a folder holding megatron/ or git:REPO@REV (for example the public Megatron-LM
repository at d98e8a64dd). Each matrix runs as ``gtp-parity gate --base installed --head SPEC``:
the code comparisons reuse the two trees' candidate traces, so a matrix costs two runs.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import time
from pathlib import Path

from harness.codecheck.gate import gate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec")
    ap.add_argument("--matrix", action="append", help="default: scenarios/default.toml and gtp_paths.toml")
    ap.add_argument("--out", default="runs/upstream")
    args = ap.parse_args()
    for matrix in args.matrix or ["scenarios/default.toml", "scenarios/gtp_paths.toml"]:
        out = Path(args.out) / Path(matrix).stem
        start = time.monotonic()
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            code = gate(matrix, "installed", args.spec, out)
        table = log.getvalue().split("\n\n")[-1]
        print(f"## {matrix} (base: installed, head: {args.spec}): exit {code}, "
              f"{time.monotonic() - start:.0f} s")
        print(table)
        (out / "gate.txt").write_text(table)


if __name__ == "__main__":
    main()
