"""The fuzzer's self-test over the catalogue: for each planted fault of the megatron backend, a
campaign of a fixed budget with the fault on every candidate; does it find the fault, fail the
way the catalogue says, and shrink it to a configuration that still fails? Prints one line per
fault (found, fingerprint, needs, pairs, shrink runs and seconds) and the totals.

    PYTHONPATH=. python benchmarks/fuzz_faults.py [--pairs 4] [--shrink-budget 180] [--out runs/fuzz-faults]
        [--fault NAME ...]

Faults whose reach no draw of the default space satisfies (a [checkpoint] scenario's, the
torch backend's, the precision baselines that are no faults) are listed as out of reach.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import time
from pathlib import Path

from harness.common.errors import BadInput
from harness.fuzz.campaign import Settings, run
from harness.fuzz.space import load_space
from harness.scenario.faults import CATALOG

NO_FAULT = {"none"}  # a catalogue entry whose expected signature is "none" is a baseline, not a bug


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--shrink-budget", type=float, default=180.0)
    ap.add_argument("--space", default="scenarios/fuzz/space.toml")
    ap.add_argument("--fault", action="append")
    ap.add_argument("--out", default="runs/fuzz-faults")
    args = ap.parse_args()
    space = load_space(args.space)
    names = args.fault or [f.name for f in CATALOG.values() if f.expect.get("signature") not in NO_FAULT]
    found = shrunk = 0
    start = time.monotonic()
    for name in names:
        settings = Settings(seed=0, space=space, inject=(name,), budget_s=1e9, max_pairs=args.pairs,
                            shrink_s=args.shrink_budget, batch=args.pairs)
        t0, log = time.monotonic(), io.StringIO()
        try:
            with contextlib.redirect_stdout(log):
                doc = run(settings, Path(args.out) / name, say=lambda *a, **k: None)
        except BadInput as e:
            print(f"{name:34s} out of reach: {str(e)[-160:]}")
            continue
        want = CATALOG[name].expect
        clusters = doc["clusters"]
        match = [c for c in clusters if c["fingerprint"][:2] == [want.get("signature"), want.get("kind")]]
        found += bool(clusters)
        shrunk += bool(match and match[0]["shrink"].get("complete"))
        best = (match or clusters or [None])[0]
        print(f"{name:34s} pairs {doc['throughput']['pairs']:2d} failing "
              f"{sum(j['finding'] for j in doc['judged']):2d} "
              + (f"{'/'.join(best['fingerprint'])} (expected {want.get('signature')}/{want.get('kind')}) "
                 f"needs "
                 f"{', '.join(best['needs'])}; shrink {best['shrink'].get('runs')} runs "
                 f"{best['shrink'].get('seconds')} s" if best else "not found")
              + f"; {time.monotonic() - t0:.0f} s")
    print(f"found {found} / {len(names)}, shrunk with the catalogue's fingerprint {shrunk}; "
          f"{time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
