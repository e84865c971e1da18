"""The fuzzer's throughput with warm workers off and on, measured in one sitting: the same
campaign (default space, one seed, a few pairs in one batch) run cold (every batch's launches
started afresh) then warm (:mod:`harness.run.warm`), ``--rounds`` times alternately; prints each
run's pairs an hour of judging (shrinking excluded), each batch's seconds, the CPU seconds the
campaign's processes used (steadier than wall time on a shared machine), and the ratios of the
medians. A warm campaign's first batch still starts its workers: the ratio grows with the number
of batches (``--pairs`` / ``--batch``). On a shared machine quote the ratio, not the rates.

    PYTHONPATH=. python benchmarks/fuzz_throughput.py [--seed 9] [--pairs 16] [--batch 8] [--rounds 1]
        [--out runs/fuzz-tp]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import resource
import shutil
import statistics
import time
from pathlib import Path

from harness.fuzz.campaign import Settings, run
from harness.fuzz.runner import Runner
from harness.fuzz.space import load_space


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=9)
    ap.add_argument("--pairs", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--space", default="scenarios/fuzz/space.toml")
    ap.add_argument("--out", default="runs/fuzz-tp")
    args = ap.parse_args()
    space = load_space(args.space)
    rates: dict[bool, list[float]] = {False: [], True: []}
    cpu: dict[bool, list[float]] = {False: [], True: []}
    batches: list[float] = []
    judge = Runner.judge

    def timed(self, draws, names=None):  # each batch's (and shrink run's) seconds
        t0 = time.monotonic()
        try:
            return judge(self, draws, names)
        finally:
            batches.append(time.monotonic() - t0)

    Runner.judge = timed
    for r in range(args.rounds):
        for warm in (False, True):
            out = Path(args.out) / f"{'warm' if warm else 'cold'}-{r}"
            shutil.rmtree(out, ignore_errors=True)
            # shrinking is not judging: a budget of a second keeps it out of the wall time
            settings = Settings(seed=args.seed, space=space, max_pairs=args.pairs, batch=args.batch,
                                shrink_s=1.0, warm=warm)
            batches.clear()
            before = _cpu()
            with contextlib.redirect_stdout(io.StringIO()):
                doc = run(settings, out, say=lambda *a, **k: None)
            cpu[warm].append(_cpu() - before)
            tp = doc["throughput"]
            rates[warm].append(tp["pairs_per_hour"])
            verdicts = [j["verdict"] for j in doc["judged"]]
            print(f"round {r} {'warm' if warm else 'cold'}: {tp['pairs']} pairs judged in "
                  f"{doc['pair_s']:.1f} s = {tp['pairs_per_hour']:.0f} pairs an hour; verdicts {verdicts}; "
                  f"judge calls (s): {[round(b, 1) for b in batches]}; CPU {cpu[warm][-1]:.0f} s", flush=True)
    cold, warm = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"warm / cold: {warm / cold:.2f}x ({warm:.0f} vs {cold:.0f} pairs an hour, "
          f"medians of {args.rounds}); CPU seconds cold / warm: "
          f"{statistics.median(cpu[False]) / statistics.median(cpu[True]):.2f}x")


def _cpu() -> float:
    """CPU seconds of this process and of every process it started and reaped (torchrun's ranks
    too): what a campaign costs the cores, whatever else the machine runs."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


if __name__ == "__main__":
    main()
