"""``gtp-parity canary``, ``gate``, ``bisect``: checks across megatron-core trees."""

from __future__ import annotations

import os
from pathlib import Path

from harness.cli.args import limits_option, out_dir, positive_int


def _cmd_canary(args) -> int:
    from harness.codecheck.gate import canary

    return canary(args.megatron_core, out_dir(args.out, "--out"))


def _cmd_gate(args) -> int:
    from harness.codecheck.gate import gate

    return gate(args.matrix, args.base, args.head, out_dir(args.out, "--out"), parallel=args.jobs,
                limits=not args.no_limits)


def _cmd_bisect(args) -> int:
    from harness.codecheck.bisect import bisect

    return bisect(Path(args.repo), args.old, args.new, args.scenario, out_dir(args.out, "--out"))


def _cmd_bisect_step(args) -> int:
    from harness.codecheck.bisect import step

    return step(Path(args.repo), args.old_verdict, args.scenario, Path(args.out))


def add_parsers(sub) -> None:
    """canary, gate, bisect: checks across megatron-core trees (SPEC: see --megatron-core)."""
    c = sub.add_parser("canary",
                       help="does the CPU layer hold on a megatron-core tree? (tiny, GTP on/off, fp32)")
    c.add_argument("--megatron-core", metavar="SPEC", required=True,
                   help="installed, a folder, or git:REPO@REV")
    c.add_argument("--out", default="runs/canary")
    c.set_defaults(fn=_cmd_canary)
    g = sub.add_parser("gate",
                       help="a matrix on two megatron-core trees: fail where head changes what GTP trains")
    g.add_argument("matrix", nargs="?", default="scenarios/default.toml")
    g.add_argument("--base", metavar="SPEC", required=True, help="the tree before the change")
    g.add_argument("--head", metavar="SPEC", required=True, help="the tree after it")
    g.add_argument("--out", default="runs/gate")
    g.add_argument("--jobs", type=positive_int, default=min(2, os.cpu_count() or 1),
                   help="launches run at once")
    limits_option(g)
    g.set_defaults(fn=_cmd_gate)
    b = sub.add_parser("bisect", help="the first commit between OLD and NEW whose verdict differs from OLD's")
    b.add_argument("scenario", help="a scenario file holding one scenario")
    b.add_argument("--repo", required=True, help="a git repository holding megatron/ (a Megatron-LM clone)")
    b.add_argument("--old", required=True, metavar="REV")
    b.add_argument("--new", required=True, metavar="REV")
    b.add_argument("--out", default="runs/bisect", help="one run folder per commit tested")
    b.set_defaults(fn=_cmd_bisect)
    s = sub.add_parser("bisect-step", help="one step of git bisect run (used by bisect)")
    s.add_argument("scenario")
    s.add_argument("--repo", required=True)
    s.add_argument("--old-verdict", required=True)
    s.add_argument("--out", required=True)
    s.set_defaults(fn=_cmd_bisect_step)
