"""The mutation campaign with and without skipping a mutant where a stage's clean sides never ran
its lines, in one sitting: the same mutants and matrix run twice (warm workers both times).
Prints each run's mutant sides and seconds, every mutant whose status differs between the two
(the claim skipping rests on: none does), every side skipped that fails when run anyway, and
every mutant called unreachable whose lines did run when it was run everywhere.

    PYTHONPATH=. python benchmarks/mutation_skip.py [--matrix scenarios/mutate.toml] [--stages 1]
        [--budget 150] [--out runs/mutate-skip]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from harness import scenario
from harness.mutation.campaign import read_triage, run_campaign, select
from harness.mutation.command import TRIAGE
from harness.scenario.mutants import TARGETS, mutants_of


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--matrix", default="scenarios/mutate.toml")
    ap.add_argument("--stages", type=int, default=1, help="the matrix's first N scenarios")
    ap.add_argument("--budget", type=int, default=150)
    ap.add_argument("--out", default="runs/mutate-skip")
    args = ap.parse_args()
    scenarios = scenario.load(args.matrix)[: args.stages]
    mutants = select([m for t in TARGETS for m in mutants_of(t, validate=False)], args.budget or None)
    docs = {}
    for skip in (True, False):
        out = Path(args.out) / ("skip" if skip else "all")
        shutil.rmtree(out, ignore_errors=True)
        docs[skip] = run_campaign(mutants, scenarios, out, timeout_s=90, per_launch=12,
                                  triage=read_triage(TRIAGE), say=lambda *a: None, skip=skip)
        t = docs[skip]["timing"]
        print(f"skip={skip}: {t['mutant_sides']} mutant sides, {t['total_s']:.0f} s "
              f"(clean {t['clean_s']:.0f} s), score {docs[skip]['score']['overall']['score']:.1%}")
    status = {skip: {m["id"]: m["status"] for m in d["mutants"]} for skip, d in docs.items()}
    differ = [i for i in status[True] if status[True][i] != status[False][i]]
    print(f"statuses that differ: {len(differ)}" + "".join(f"\n  {i}: skipping {status[True][i]}, "
                                                            f"running {status[False][i]}" for i in differ))
    ran_anyway = {m["id"]: m for m in docs[False]["mutants"]}
    checked = 0
    for st in docs[True]["stages"]:  # a skipped side, run anyway, is judged as clean code is
        for i in sorted(set(status[True]) - set(st["can_differ"])):
            v = ran_anyway[i]["verdicts"].get(f"{st['scenario']}@{i}")
            if v is not None:
                checked += 1
                if v != "pass":
                    print(f"  {i} at {st['scenario']}: skipped, but run there it is {v}")
    never = [m["id"] for m in docs[True]["mutants"] if (m["reason"] or "").startswith("the mutated line")]
    unreached = [i for i in never if ran_anyway[i]["reached"] is not False]
    print(f"mutant sides skipped, run anyway and passing: {checked}; unreachable ones whose lines ran when "
          f"run: {unreached}")

if __name__ == "__main__":
    main()
