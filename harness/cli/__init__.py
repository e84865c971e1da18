"""``gtp-parity``: run scenarios, compare traces, gate on parity.

Exit codes: 0 parity holds, 1 parity fails, 2 bad input (scenario, trace, argument),
3 a run failed (crash, hang, timeout).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from harness.cli import fuzz, trees
from harness.cli.args import Parser, count, limits_option, non_negative, out_dir, positive_int
from harness.common.errors import EXIT_BAD_INPUT, BadInput, HarnessError
from harness.scenario.schema import POLICIES


def _cmd_validate(args) -> int:
    from harness import scenario

    code = 0
    for path in args.scenarios:  # every file is reported, not only the first bad one
        try:
            for s in scenario.load(path, limits=not args.no_limits):
                print(f"ok  {s.name}  ({s.reference.label()} vs {s.candidate.label()}, golden "
                      f"{s.golden.label()})")
        except BadInput as e:
            print(f"gtp-parity: {e}", file=sys.stderr)
            code = EXIT_BAD_INPUT
    return code


def _cmd_inject(args) -> int:
    from harness.backends.faults import CATALOG

    for f in CATALOG.values():
        print(f"{f.name:28s} [{f.bug_class}] {f.description}")
    print(f"{'exit|hang|raise:RANK:STEP':28s} [launcher] a rank exits hard, hangs or raises at STEP")
    return 0


def _cmd_options(args) -> int:
    from harness.scenario.options import key_tables
    from harness.scenario.schema import DataConfig, ModelConfig, Side

    print(key_tables(ModelConfig, DataConfig, Side), end="")
    return 0


def _cmd_run(args) -> int:
    from harness.session import run_scenarios

    out = out_dir(args.out, "--out")
    return run_scenarios(_scenarios(args), out, parallel=args.jobs, verbose=True, fresh=args.fresh,
                         compare_jobs=args.compare_jobs)


def _scenarios(args) -> list:
    scenarios = _load(args, args.scenario)
    if args.inject:
        scenarios = [_with_fault(s, args.inject, args.inject_side) for s in scenarios]
    return scenarios


def _cmd_plan(args) -> int:
    from harness.run.nodes import parse_endpoint
    from harness.session import plan_launches

    out = out_dir(args.out, "--out")
    if args.rdzv_endpoint:
        parse_endpoint(args.rdzv_endpoint)
    code = plan_launches(_scenarios(args), out, nnodes=args.nnodes, endpoint=args.rdzv_endpoint,
                         fresh=args.fresh)
    same = [*(f"--inject {f}" for f in args.inject),
            *(["--inject-side", args.inject_side] if args.inject else []),
            *(["--no-limits"] if args.no_limits else [])]
    print("\nthen, once every trace is complete (it reuses them and compares):\n  "
          + " ".join(["gtp-parity", "collect", args.scenario, *same, "--out", args.out]))
    return code


def _cmd_launch(args) -> int:
    from harness.session import launch_plan

    return launch_plan(args.plan, args.nnodes, args.node_rank, args.rdzv_endpoint)


def _cmd_collect(args) -> int:
    from harness.session import run_scenarios

    return run_scenarios(_scenarios(args), out_dir(args.out, "--out"), verbose=True,
                         compare_jobs=args.compare_jobs, collect=True)


def _with_fault(s, names: list[str], role: str):
    from harness.scenario.planting import plant

    return plant([s], names, role, where="--inject", side_where="--inject-side")[0]


def _cmd_matrix(args) -> int:
    from harness import report
    from harness.common.errors import EXIT_PARITY_FAIL
    from harness.session import run_scenarios

    if args.update_baseline and not args.baseline:
        raise BadInput("--update-baseline", "needs --baseline DIR to write to")
    out, report_dir = out_dir(args.out, "--out"), out_dir(args.report, "--report")
    scenarios = _load(args, args.matrix)
    code = run_scenarios(scenarios, out, parallel=args.jobs, verbose=True, fresh=args.fresh,
                         compare_jobs=args.compare_jobs)
    print(f"report: {report.write_index(out, report_dir)}")
    print(f"compared tensors judged by expectation: {report.run_expectations(out)}")
    junit = Path(args.junit) if args.junit else report_dir / "junit.xml"
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

    if not (Path(args.run) / "summary.json").is_file():
        raise BadInput(args.run, "not a run folder (no summary.json)")
    print(f"report: {report.write_index(Path(args.run), out_dir(args.out, '--out'))}")
    if args.junit:
        print(f"junit: {report.write_junit(Path(args.run), Path(args.junit))}")
    return 0


def _cmd_compare(args) -> int:
    from harness.scenario.schema import ComparePolicy
    from harness.session import compare_traces

    chosen = {k: getattr(args, k) for k in ("policy", "k", "k_first_step", "floor")}
    chosen = {k: v for k, v in chosen.items() if v is not None}
    golden = Path(args.golden) if args.golden else None
    return compare_traces(Path(args.reference), Path(args.candidate), golden, out_dir(args.out, "--out"),
                          ComparePolicy(**chosen) if chosen else None, verify=not args.no_verify,
                          jobs=args.jobs)


def _load(args, path: str) -> list:
    """The scenarios of ``path`` with the megatron-core trees the code options name."""
    from harness import scenario
    from harness.scenario.tree_specs import with_code

    return with_code(scenario.load(path, limits=not args.no_limits),
                     every=getattr(args, "megatron_core", None),
                     reference=getattr(args, "reference_code", None),
                     candidate=getattr(args, "candidate_code", None), bridge=getattr(args, "bridge", None))


def _code_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--megatron-core", metavar="SPEC",
                   help="the megatron-core every megatron/mlm/bridge side imports: installed, a folder "
                        "holding "
                        "megatron/, or git:REPO@REV, REPO a configured name, a git URL or a folder (default: "
                        "as "
                        "the scenario says)")
    p.add_argument("--bridge", metavar="SPEC",
                   help="the Megatron-Bridge every bridge side runs: installed, a "
                   "checkout, or git:REPO@REV (default: as the scenario says)")
    p.add_argument("--reference-code", metavar="SPEC",
                   help="the reference's megatron-core (see --megatron-core)")
    p.add_argument("--candidate-code", metavar="SPEC",
                   help="the candidate's megatron-core; with a different --reference-code, a code "
                        "comparison: "
                        "the scenario's candidate on both trees, judged exact")


def _run_options(p: argparse.ArgumentParser) -> None:
    """Options shared by ``run`` and ``matrix``."""
    _code_options(p)
    p.add_argument("--jobs", type=positive_int, default=min(2, os.cpu_count() or 1),
                   help="launches run at once (default: 2)")
    p.add_argument("--compare-jobs", type=positive_int, default=1,
                   help="compare processes comparing each scenario's tensors (default 1)")
    p.add_argument("--fresh", action="store_true",
                   help="run every side again, even where a complete trace of the same configuration and "
                        "code exists")
    limits_option(p)


def _cmd_mlm(args) -> int:
    from harness.capture import trace
    from harness.session import run_mlm_command

    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    if not flags:
        raise BadInput("gtp-parity mlm", "give the pretrain_gpt.py flags after --")
    path = run_mlm_command(flags, args.nproc, out_dir(args.out, "--out"), args.timeout)
    t = trace.read(path)
    rows = sorted((s["step"], s["name"], s["value"]) for s in t.scalars if s["rank"] == 0
                  and s["name"] in ("reduced_loss", "grad_norm", "lr_logged"))
    for step in sorted({r[0] for r in rows}):
        values = {name: value for st, name, value in rows if st == step}
        print(f"iteration {step}: lm loss {values.get('reduced_loss', float('nan')):.6f} "
              f"grad norm {values.get('grad_norm', float('nan')):.3f} lr "
              f"{values.get('lr_logged', float('nan')):.3e}")
    print(f"trace: {path}")
    return 0


def _cmd_conformance(args) -> int:
    from harness.conformance.cli import main as conformance_main

    return conformance_main(args.rest)


def _cmd_mutate(args) -> int:
    from harness.mutation.command import main as mutate_main

    return mutate_main(args)


def _mutate_parser(sub) -> None:
    mu = sub.add_parser("mutate",
                        help="mutation campaign over megatron-core's GTP code: the harness's detection power")
    mu.add_argument("--target", action="append", metavar="MODULE",
                    help="module of the GTP path (default: all)")
    mu.add_argument("--matrix", help="scenarios each mutant runs (default: scenarios/mutate.toml)")
    mu.add_argument("--budget", type=count, default=150,
                    help="mutants to run, spread over files and operators (default 150; 0: all)")
    mu.add_argument("--mutant", action="append", metavar="ID", help="run these mutants only (repeatable)")
    mu.add_argument("--timeout", type=non_negative, default=90.0, help="seconds per mutant side (default 90)")
    mu.add_argument("--per-launch", type=positive_int, default=12,
                    help="mutant sides per launch (default 12)")
    mu.add_argument("--cold", action="store_true",
                    help="start every launch afresh instead of on warm workers kept across launches (a "
                         "crashed or overrun side still ends its worker; the traces are the same)")
    mu.add_argument("--retriage", action="store_true",
                    help="apply the triage file (harness/mutation/triage.toml) to the campaign in --out "
                         "again (no run)")
    mu.add_argument("--show", metavar="ID", help="print a mutant's diff and the localization it got")
    mu.add_argument("--out", required=True, help="campaign folder: mutants.json, index.html, traces")
    mu.set_defaults(fn=_cmd_mutate)


def _scenario_args(p: argparse.ArgumentParser) -> None:
    """What names a scenario's sides (their keys): ``plan``, ``collect`` and ``run`` agree on them."""
    p.add_argument("scenario", help="scenario or matrix TOML file")
    p.add_argument("--out", default="runs/latest", help="output folder (default: runs/latest)")
    p.add_argument("--inject", action="append", default=[], metavar="FAULT",
                   help="plant a fault in the candidate (see `gtp-parity inject --list`)")
    p.add_argument("--inject-side", default="candidate", choices=["reference", "candidate"])


def _node_parsers(sub) -> None:
    pl = sub.add_parser("plan",
                        help="write the launch plans of a scenario and print what each node runs (no launch)")
    _scenario_args(pl)
    pl.add_argument("--nnodes", type=positive_int, default=1,
                    help="nodes each launch is spread over (default 1)")
    pl.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="node rank 0's address and a free port")
    pl.add_argument("--fresh", action="store_true",
                    help="plan every side again, even those with a complete trace")
    limits_option(pl)
    pl.set_defaults(fn=_cmd_plan)

    la = sub.add_parser("launch", help="run this node's share of a planned launch under torchrun, watched")
    la.add_argument("plan", help="a launch plan written by `gtp-parity plan` (RUN/launches/plan-*.json)")
    la.add_argument("--nnodes", type=positive_int, default=1,
                    help="nodes the launch is spread over (default 1)")
    la.add_argument("--node-rank", type=count, default=0, help="this node's rank, 0 .. nnodes-1 (default 0)")
    la.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                    help="node rank 0's address and a free port (c10d)")
    la.set_defaults(fn=_cmd_launch)

    co = sub.add_parser("collect", help="compare a planned scenario's complete traces; launch nothing")
    _scenario_args(co)
    co.add_argument("--compare-jobs", type=positive_int, default=1,
                    help="compare processes comparing each scenario's tensors (default 1)")
    limits_option(co)
    co.set_defaults(fn=_cmd_collect)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="gtp-parity", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)

    r = sub.add_parser("run", help="run a scenario (or matrix) file and compare its sides")
    _scenario_args(r)
    _run_options(r)
    r.set_defaults(fn=_cmd_run)

    _node_parsers(sub)

    m = sub.add_parser("matrix", help="run a matrix, write the HTML report and JUnit, gate on parity")
    m.add_argument("matrix", nargs="?", default="scenarios/default.toml",
                   help="scenario or matrix TOML file (default: scenarios/default.toml)")
    m.add_argument("--out", default="runs/default", help="run folder (default: runs/default)")
    m.add_argument("--report", default="reports",
                   help="index.html, scenarios/<name>.html, summary.json, junit.xml")
    m.add_argument("--junit", metavar="FILE", help="JUnit XML path (default: REPORT/junit.xml)")
    m.add_argument("--baseline", metavar="DIR",
                   help="fail if verdicts or step scalars differ from this baseline")
    m.add_argument("--update-baseline", action="store_true", help="write --baseline from this run instead")
    _run_options(m)
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
    c.add_argument("--k", type=non_negative, help="noise-floor k (default 4)")
    c.add_argument("--k-first-step", type=non_negative, help="noise-floor k at step 1 (default: k)")
    c.add_argument("--floor", type=non_negative, help="noise-floor floor in eps x max|golden| (default 8)")
    c.add_argument("--jobs", type=positive_int, default=1,
                   help="compare processes measuring the tensors (default 1); under torchrun the ranks share "
                        "them")
    c.add_argument("--no-verify", action="store_true",
                   help="skip checking each tensor against the content hash recorded when it was written")
    c.set_defaults(fn=_cmd_compare)

    v = sub.add_parser("validate", help="validate scenario files without running them")
    v.add_argument("scenarios", nargs="+")
    limits_option(v)
    v.set_defaults(fn=_cmd_validate)

    k = sub.add_parser("conformance", help="check a DistributedWeight implementer (see --help)",
                       add_help=False)
    k.add_argument("rest", nargs=argparse.REMAINDER)
    k.set_defaults(fn=_cmd_conformance)

    ml = sub.add_parser("mlm", help="run a Megatron-LM pretrain_gpt.py command line with capture on",
                        description="gtp-parity mlm [--nproc N] [--out DIR] -- <pretrain_gpt.py flags>")
    ml.add_argument("--nproc", type=positive_int, default=1, help="ranks (torchrun --nproc-per-node)")
    ml.add_argument("--out", default="runs/mlm", help="output folder; the trace is under OUT/traces")
    ml.add_argument("--timeout", type=non_negative, default=600.0, help="seconds for the run (default 600)")
    ml.add_argument("flags", nargs=argparse.REMAINDER, help="-- then the pretrain_gpt.py flags")
    ml.set_defaults(fn=_cmd_mlm)

    _mutate_parser(sub)
    trees.add_parsers(sub)
    fuzz.add_parser(sub)

    o = sub.add_parser("options",
                       help="the scenario keys as declared: defaults, backends, golden, what each reaches")
    o.set_defaults(fn=_cmd_options)

    i = sub.add_parser("inject", help="list the planted faults")
    i.add_argument("--list", action="store_true", required=True)
    i.set_defaults(fn=_cmd_inject)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["conformance"]:  # the kit parses its own arguments, --help included
        return _cmd_conformance(argparse.Namespace(rest=argv[1:]))
    args = build_parser().parse_args(argv)
    in_main = threading.current_thread() is threading.main_thread()
    # A terminated run (a CI job cancelled) ends its launches as Ctrl-C does.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler) if in_main else None
    try:
        return args.fn(args)
    except HarnessError as e:
        print(f"gtp-parity: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:  # the launcher has already ended its launches (harness.run.launch)
        print("gtp-parity: interrupted; traces written so far are kept, marked incomplete", file=sys.stderr)
        return 130
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)

if __name__ == "__main__":
    sys.exit(main())
