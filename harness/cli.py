"""``gtp-parity``: run scenarios, compare traces, gate on parity.

Exit codes: 0 parity holds, 1 parity fails, 2 bad input (scenario, trace, argument),
3 a run failed (crash, hang, timeout).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from harness.errors import EXIT_BAD_INPUT, BadInput, HarnessError
from harness.scenario import POLICIES


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse exits 2 on bad arguments, which is our bad-input code
        self.print_usage(sys.stderr)
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


def _cmd_validate(args) -> int:
    from harness import scenario

    for path in args.scenarios:
        for s in scenario.load(path):
            print(f"ok  {s.name}  ({s.reference.label()} vs {s.candidate.label()}, golden {s.golden.label()})")
    return 0


def _cmd_inject(args) -> int:
    from harness.faults import CATALOG

    for f in CATALOG.values():
        print(f"{f.name:28s} [{f.bug_class}] {f.description}")
    print(f"{'exit|hang|raise:RANK:STEP':28s} [launcher] a rank exits hard, hangs or raises at STEP")
    return 0


def _cmd_run(args) -> int:
    from harness import scenario
    from harness.session import run_scenarios

    scenarios = scenario.load(args.scenario)
    if args.inject:
        scenarios = [_with_fault(s, args.inject, args.inject_side) for s in scenarios]
    return run_scenarios(scenarios, Path(args.out), parallel=args.jobs, verbose=True)


def _with_fault(s, names: list[str], role: str):
    from harness.planting import plant

    return plant([s], names, role, where="--inject", side_where="--inject-side")[0]


def _cmd_matrix(args) -> int:
    from harness import report, scenario
    from harness.errors import EXIT_PARITY_FAIL
    from harness.session import run_scenarios

    if args.update_baseline and not args.baseline:
        raise BadInput("--update-baseline", "needs --baseline DIR to write to")
    out, scenarios = Path(args.out), scenario.load(args.matrix)
    code = run_scenarios(scenarios, out, parallel=args.jobs, verbose=True)
    print(f"report: {report.write_index(out, Path(args.report))}")
    junit = Path(args.junit) if args.junit else Path(args.report) / "junit.xml"
    print(f"junit: {report.write_junit(out, junit)}")
    if args.update_baseline:
        print(f"baseline written: {report.update_baseline(out, Path(args.baseline))}")
    elif args.baseline:
        diffs = report.compare_to_baseline(out, Path(args.baseline))
        for d in diffs:
            print(f"baseline: {d}")
        if diffs:
            code = max(code, EXIT_PARITY_FAIL)
    return code


def _cmd_report(args) -> int:
    from harness import report

    if not (Path(args.run) / "summary.json").exists():
        raise BadInput(args.run, "not a run folder (no summary.json)")
    print(f"report: {report.write_index(Path(args.run), Path(args.out))}")
    if args.junit:
        print(f"junit: {report.write_junit(Path(args.run), Path(args.junit))}")
    return 0


def _cmd_compare(args) -> int:
    from harness.scenario import ComparePolicy
    from harness.session import compare_traces

    chosen = {k: getattr(args, k) for k in ("policy", "k", "k_first_step", "floor")}
    chosen = {k: v for k, v in chosen.items() if v is not None}
    golden = Path(args.golden) if args.golden else None
    return compare_traces(Path(args.reference), Path(args.candidate), golden, Path(args.out),
                          ComparePolicy(**chosen) if chosen else None)  # fmt: skip


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _cmd_conformance(args) -> int:
    from harness.conformance.cli import main as conformance_main

    return conformance_main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="gtp-parity", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    r = sub.add_parser("run", help="run a scenario (or matrix) file and compare its sides")
    r.add_argument("scenario", help="scenario or matrix TOML file")
    r.add_argument("--out", default="runs/latest", help="output folder (default: runs/latest)")
    r.add_argument("--inject", action="append", default=[], metavar="FAULT",
                   help="plant a fault in the candidate (see `gtp-parity inject --list`)")
    r.add_argument("--inject-side", default="candidate", choices=["reference", "candidate"])
    r.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="launches run at once (default: 2)")
    r.set_defaults(fn=_cmd_run)

    m = sub.add_parser("matrix", help="run a matrix, write the HTML report and JUnit, gate on parity")
    m.add_argument("matrix", nargs="?", default="scenarios/default.toml",
                   help="scenario or matrix TOML file (default: scenarios/default.toml)")
    m.add_argument("--out", default="runs/default", help="run folder (default: runs/default)")
    m.add_argument("--report", default="reports", help="index.html, scenarios/<name>.html, summary.json, junit.xml")
    m.add_argument("--junit", metavar="FILE", help="JUnit XML path (default: REPORT/junit.xml)")
    m.add_argument("--baseline", metavar="DIR", help="fail if verdicts or step scalars differ from this baseline")
    m.add_argument("--update-baseline", action="store_true", help="write --baseline from this run instead")
    m.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="launches run at once")
    m.set_defaults(fn=_cmd_matrix)

    rp = sub.add_parser("report", help="rebuild the HTML report of an existing run folder")
    rp.add_argument("run")
    rp.add_argument("--out", default="reports")
    rp.add_argument("--junit", metavar="FILE")
    rp.set_defaults(fn=_cmd_report)

    c = sub.add_parser("compare", help="compare existing traces offline")
    c.add_argument("reference")
    c.add_argument("candidate")
    c.add_argument("--golden")
    c.add_argument("--out", default="runs/compare")
    c.add_argument("--policy", choices=sorted(POLICIES), help="judge under this policy (default noise-floor)")
    c.add_argument("--k", type=_non_negative, help="noise-floor k (default 4)")
    c.add_argument("--k-first-step", type=_non_negative, help="noise-floor k at step 1 (default: k)")
    c.add_argument("--floor", type=_non_negative, help="noise-floor floor in eps x max|golden| (default 8)")
    c.set_defaults(fn=_cmd_compare)

    v = sub.add_parser("validate", help="validate scenario files without running them")
    v.add_argument("scenarios", nargs="+")
    v.set_defaults(fn=_cmd_validate)

    k = sub.add_parser("conformance", help="check a DistributedWeight implementer (see --help)",
                       add_help=False)
    k.add_argument("rest", nargs=argparse.REMAINDER)
    k.set_defaults(fn=_cmd_conformance)

    i = sub.add_parser("inject", help="list the planted faults")
    i.add_argument("--list", action="store_true", required=True)
    i.set_defaults(fn=_cmd_inject)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["conformance"]:  # the kit parses its own arguments, --help included
        return _cmd_conformance(argparse.Namespace(rest=argv[1:]))
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except HarnessError as e:
        print(f"gtp-parity: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
