"""``gtp-parity fuzz``: search the declared configuration space for divergences (harness/fuzz)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from harness.cli.args import count, out_dir, positive_int

DURATION = re.compile(r"(\d+(?:\.\d+)?)([smh]?)")
EXIT_NEW_FINDINGS = 1


def duration(text: str) -> float:
    """Seconds from ``90``, ``90s``, ``45m`` or ``1.5h``."""
    m = DURATION.fullmatch(text.strip())
    if m is None or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"a positive duration such as 90s, 45m or 1h, got {text!r}")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def node_share(text: str) -> tuple[int, int]:
    """(node, nodes) from ``I/N`` with 0 <= I < N."""
    m = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if m is None or not 0 <= int(m.group(1)) < int(m.group(2)):
        raise argparse.ArgumentTypeError(f"a node's share as I/N with 0 <= I < N (0/4 ... 3/4), got {text!r}")
    return int(m.group(1)), int(m.group(2))


def _cmd_fuzz(args) -> int:
    from harness.common.errors import EXIT_RUN_FAILED, BadInput
    from harness.fuzz.campaign import Settings, run
    from harness.fuzz.space import load_space
    from harness.scenario.faults import check_name

    for name in args.inject:
        if (problem := check_name(name)) is not None:
            raise BadInput("--inject", problem)
    recorded = Path(args.recorded) if args.recorded else None
    if recorded is not None and not recorded.is_dir():
        raise BadInput("--recorded", f"{args.recorded} is not a folder of scenario files")
    settings = Settings(seed=args.seed, space=load_space(args.space), megatron_core=args.megatron_core,
                        inject=tuple(args.inject), budget_s=args.budget, max_pairs=args.pairs,
                        shrink_s=args.shrink_budget, batch=args.batch, jobs=args.jobs, warm=not args.cold,
                        recorded=recorded,
                        node=args.node[0], nodes=args.node[1])
    out = out_dir(args.out, "--out")
    if args.merge:
        from harness.fuzz.merge import merge

        if args.node[1] > 1:
            raise BadInput("--merge", "folds every node's folder into one: give it without --node")
        missing = [d for d in args.merge if not (Path(d) / "fuzz.json").is_file()]
        if missing:
            raise BadInput("--merge", f"{missing[0]} holds no fuzz.json (a node's campaign folder)")
        doc = merge([Path(d) for d in args.merge], settings, out)
    else:
        doc = run(settings, out)
    new = [c for c in doc["clusters"] if not c.get("known")]
    print(f"\ngtp-parity fuzz: {doc['throughput']['pairs']} pairs judged in {doc['elapsed_s']:.0f} s, "
          f"{len(doc['clusters'])} cluster(s), {len(new)} new -> {out / 'index.html'}")
    for c in doc["clusters"]:
        print(f"  {c['id']} {'/'.join(c['fingerprint'])} {c['pattern']}: needs {', '.join(c['needs'])}; "
              f"{c['count']} pair(s); {'known: ' + c['known'] if c.get('known') else 'new'}; "
              f"{c['scenario_file']}")
    for what, pairs in doc["errors"].items():
        print(f"  run failed ({len(pairs)} pair(s), e.g. {pairs[0]}): {what}")
    return EXIT_NEW_FINDINGS if new else EXIT_RUN_FAILED if doc["errors"] else 0


def add_parser(sub) -> None:
    f = sub.add_parser("fuzz",
                       help="search the configuration space for divergences nobody wrote a scenario for")
    f.add_argument("--out", required=True, help="campaign folder: fuzz.json, index.html, minimal scenarios; "
                   "the same command on it continues the campaign")
    f.add_argument("--budget", type=duration, default=3600.0,
                   help="time in all, resumes included (default 60m)")
    f.add_argument("--seed", type=count, default=0, help="the campaign's seed (default 0)")
    f.add_argument("--space", metavar="FILE", default="scenarios/fuzz/space.toml",
                   help="a space file narrowing or widening the declared space (default "
                        "scenarios/fuzz/space.toml)")
    f.add_argument("--megatron-core", metavar="SPEC", default="installed",
                   help="installed, a folder, or git:REPO@REV (default installed)")
    f.add_argument("--inject", action="append", default=[], metavar="FAULT",
                   help="plant a fault in every candidate (the fuzzer's self-test)")
    f.add_argument("--pairs", type=positive_int, help="stop after this many pairs are judged")
    f.add_argument("--shrink-budget", type=duration, default=600.0,
                   help="time to shrink one finding (default 10m)")
    f.add_argument("--batch", type=positive_int, default=8,
                   help="pairs judged per batch of launches (default 8)")
    f.add_argument("--jobs", type=positive_int, default=2, help="launches run at once (default 2)")
    f.add_argument("--cold", action="store_true",
                   help="start every batch's launches afresh instead of on warm workers kept across batches "
                        "and shrinks (the traces are the same; warm is faster)")
    f.add_argument("--recorded", metavar="DIR", default=None,
                   help="scenario files whose [expect] divergences are known (e.g. scenarios)")
    f.add_argument("--node", type=node_share, default=(0, 1), metavar="I/N",
                   help="judge node I's share of a campaign spread over N nodes (each draws every pair, "
                        "judges those with index mod N = I); the same --seed and --space on every node")
    f.add_argument("--merge", nargs="+", metavar="DIR",
                   help="fold the nodes' folders of one campaign into --out (no pair is run)")
    f.set_defaults(fn=_cmd_fuzz)
