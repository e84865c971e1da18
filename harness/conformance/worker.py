"""Per-rank entry point: ``torchrun ... -m harness.conformance.worker --impl SPEC --json OUT``.

Initializes the default gloo process group from torchrun's environment, runs the kit for each
``--impl`` (optionally restricted to topologies: ``module:factory@1x2,2x2``), and has rank 0
write a JSON list with one :class:`~harness.conformance.kit.ConformanceResult` per implementer.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from harness.conformance.protocol import DISPATCH_CHOICES, select_dispatch
from harness.conformance.kit import Topology, default_topologies, load_factory, run_conformance

COLLECTIVE_TIMEOUT_S = 120
"""gloo waits this long for a peer before raising, so one stuck rank cannot hang the launch."""


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m harness.conformance.worker")
    parser.add_argument("--impl", action="append", required=True, help="module:factory[@TxG,...]")
    parser.add_argument("--topology", action="append", default=[], help="TxG for every --impl")
    parser.add_argument("--dispatch", choices=DISPATCH_CHOICES, default="auto")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--json", required=True, type=Path)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the kit on this rank; rank 0 writes the JSON results. Returns 0 once written."""
    args = _parse(argv)
    if not dist.is_initialized():
        backend = "gloo"
        if torch.cuda.is_available():  # GPU machines (and TE's dispatchers) want NCCL
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            backend = "nccl"
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        dist.init_process_group(backend, timeout=timeout)
    world = dist.get_world_size()
    dispatch = select_dispatch(args.dispatch)  # every rank loads and hash-checks TE's file
    results = []
    for item in args.impl:
        spec, _, topos = item.partition("@")
        chosen = [Topology.parse(t) for t in (topos.split(",") if topos else args.topology)]
        result = run_conformance(
            load_factory(spec),
            impl=spec,
            topologies=chosen or default_topologies(world),
            dispatch=dispatch,
            seed=args.seed,
        )
        results.append(result.to_json())
    if dist.get_rank() == 0:
        tmp = args.json.with_suffix(".partial")
        tmp.write_text(json.dumps(results, indent=1))
        os.replace(tmp, args.json)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
