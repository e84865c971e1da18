"""``gtp-parity conformance``: run the DistributedWeight kit on N local ranks and print a table.

Usage::

    gtp-parity conformance --impl module:factory --nproc N [--tp T --gtp G] [--json OUT]
                           [--dispatch auto|te|kit]

The clauses drive Transformer Engine's own dispatchers, from the pinned release's
``distributed_weight.py`` that set-up caches (:mod:`harness.conformance.te_source`); the table's
header names that file and its sha256. ``--dispatch auto`` (the default) falls back to the kit's
mirror of them, and says why, only when the file was never fetched; ``te`` insists on TE's file.

The command checks its arguments and imports the factory here, then launches
``torchrun --standalone --nproc-per-node N -m harness.conformance.worker`` as a subprocess with
a timeout, reads the JSON it writes, and prints a per-clause table. Exit status: 0 when every
clause passes (skips allowed), 1 when any fails or the launch fails, 2 for a bad argument.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from harness.conformance import te_source
from harness.conformance.protocol import DISPATCH_CHOICES, select_dispatch
from harness.conformance.kit import (
    BadSpec,
    ConformanceResult,
    Topology,
    default_topologies,
    format_table,
    load_factory,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TIMEOUT_S = 600


class _ArgumentError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    # argparse exits on its own; raise instead so main() can return 2 like every other bad argument.
    def error(self, message):
        raise _ArgumentError(message)


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface, exposed so a parent command can embed it."""
    parser = _Parser(prog="gtp-parity conformance", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--impl", required=True, metavar="MODULE:FACTORY", help="weight factory to check"
    )
    parser.add_argument("--nproc", required=True, type=int, help="ranks to launch (>= 2)")
    parser.add_argument("--tp", type=int, help="tensor-parallel size (default: all that fit)")
    parser.add_argument("--gtp", type=int, help="GTP group size G >= 2 (default: all that fit)")
    parser.add_argument(
        "--dispatch",
        choices=DISPATCH_CHOICES,
        default="auto",
        help="whose dispatchers to drive: TE's pinned file (te), the kit's mirror (kit), or TE's "
        "file when it is cached (auto, the default)",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds for the launch"
    )
    parser.add_argument("--seed", type=int, default=1234)
    return parser


def _topologies(args) -> list[Topology]:
    if args.nproc < 2:
        raise _ArgumentError(f"--nproc {args.nproc}: need at least 2 ranks for a GTP group")
    if args.tp is None and args.gtp is None:
        chosen = default_topologies(args.nproc)
        if not chosen:
            raise _ArgumentError(
                f"--nproc {args.nproc}: no TP in {{1, 2}} x G in {{2, 4}} divides it"
            )
        return chosen
    topology = Topology(args.tp or 1, args.gtp or 2)
    try:
        topology.check(args.nproc)
    except ValueError as exc:
        raise _ArgumentError(f"--tp/--gtp: {exc}") from None
    return [topology]


def _launch(args, topologies: list[Topology], out: Path) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.nproc}",
        "-m",
        "harness.conformance.worker",
        "--impl",
        f"{args.impl}@{','.join(str(t) for t in topologies)}",
        "--dispatch",
        args.dispatch,
        "--seed",
        str(args.seed),
        "--json",
        str(out),
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 pass, 1 fail, 2 bad argument)."""
    try:
        args = build_parser().parse_args(argv)
        topologies = _topologies(args)
        load_factory(args.impl)
        try:
            select_dispatch(args.dispatch)  # each rank loads it again; fail here, once, first
        except te_source.SourceError as exc:
            raise _ArgumentError(f"--dispatch {args.dispatch}: {exc}") from None
    except (_ArgumentError, BadSpec) as exc:
        print(f"gtp-parity conformance: error: {exc}", file=sys.stderr)
        return 2

    with tempfile.TemporaryDirectory(prefix="gtp-conformance-") as tmp:
        out = Path(tmp) / "result.json"
        try:
            proc = _launch(args, topologies, out)
        except subprocess.TimeoutExpired as exc:
            print(
                f"gtp-parity conformance: the launch ran past --timeout {exc.timeout:g} s",
                file=sys.stderr,
            )
            return 1
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join((proc.stderr or "").splitlines()[-30:])
            print(
                f"gtp-parity conformance: torchrun exited with {proc.returncode}\n{tail}",
                file=sys.stderr,
            )
            return 1
        data = json.loads(out.read_text())
    result = ConformanceResult.from_json(data[0])
    if args.json:
        args.json.write_text(json.dumps(result.to_json(), indent=1))
    print(format_table(result))
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
