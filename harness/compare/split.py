"""A compare's tasks split over compare processes (``--jobs N``) or torchrun ranks.

Compare processes are fresh interpreters (``python -m harness.compare``, one torch thread
each) that read the traces themselves (files are shared through the page cache), measure
their share of :func:`harness.compare.tasks.partition` and write it as JSON; the parent reads the
JSON back. Under torchrun each rank measures its share and the shares travel as JSON bytes
in ``all_gather`` over gloo. Nothing pickled crosses a process boundary either way.

A bad input met by any process (a corrupt shard, a missing tensor) is raised by the parent,
or by every rank, with its message and exit code; no rank waits on one that gave up.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from harness.common.errors import HarnessError, RunFailed
from harness.compare.tasks import Part

PROCESS = "harness.compare"


def _error(doc: dict) -> HarnessError:
    """A compare process's error, raised here with its message and exit code."""
    err = HarnessError(doc["message"])
    err.exit_code = int(doc["code"])
    return err


def _encode(work: Callable[[], Part]) -> dict:
    try:
        return {"part": work().to_json()}
    except HarnessError as e:
        return {"error": {"message": str(e), "code": e.exit_code}}


def _decode(docs: list[dict]) -> list[Part]:
    for doc in docs:
        if "error" in doc:
            raise _error(doc["error"])
    return [Part.from_json(doc["part"]) for doc in docs]


def over_processes(traces: dict, policy, jobs: int) -> list[Part]:
    """Every part of a compare, measured by ``jobs`` compare processes at once."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="gtp-parity-compare-") as tmp:
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps({
            "traces": {role: str(t.path) for role, t in traces.items()},
            "verify": all(t.verify for t in traces.values()),
            "policy": dataclasses.asdict(policy), "parts": jobs,
        }))
        results = [Path(tmp) / f"part{i}.json" for i in range(jobs)]
        # Each compare process in its own session, as torchrun starts its ranks: under Linux's autogroup
        # scheduling a session's processes share one session's CPU time, so on a busy machine
        # processes left in the caller's session would split one share instead of adding theirs.
        procs = [subprocess.Popen([sys.executable, "-m", PROCESS, str(spec), str(i), str(results[i])],
                                  env=env,
                                  stderr=subprocess.PIPE, text=True, start_new_session=True)
                 for i in range(jobs)]
        try:
            errors = [p.communicate()[1] for p in procs]
        finally:
            for p in procs:  # an interrupted parent ends the processes it started
                if p.poll() is None:
                    p.kill()
                    p.wait()
        docs = []
        for i, (p, path) in enumerate(zip(procs, results)):
            if not path.exists():
                raise RunFailed(f"compare process {i} exited {p.returncode} without a result: "
                                f"{(errors[i] or '').strip()[-500:]}")
            docs.append(json.loads(path.read_text()))
    return _decode(docs)


def run_process(argv: list[str], part_of) -> int:
    """A compare process's body: ``argv`` = spec file, part index, result file; ``part_of(traces,
    policy, part, parts)`` measures the share."""
    from harness.capture import trace
    from harness.scenario.schema import ComparePolicy

    torch.set_num_threads(1)
    spec_path, part, out = argv
    spec = json.loads(Path(spec_path).read_text())

    def work() -> Part:
        traces = {role: trace.read(p, verify=spec["verify"]) for role, p in spec["traces"].items()}
        return part_of(traces, ComparePolicy(**spec["policy"]), int(part), int(spec["parts"]))

    doc = _encode(work)
    tmp = Path(out).with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, out)
    return 0


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


@contextmanager
def rank_group():
    """A gloo process group over torchrun's ranks for the duration; yields whether it opened
    one (not outside torchrun, nor inside a program that has its own group: the pytest
    plugin under torchrun runs a compare on one rank only)."""
    if not launched_by_torchrun() or dist.is_initialized():
        yield False
        return
    dist.init_process_group("gloo")
    try:
        yield True
    finally:
        dist.destroy_process_group()


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def over_ranks(work: Callable[[], Part]) -> list[Part] | None:
    """Every rank's part on rank 0 (None on the others), after each rank ran ``work``."""
    payload = torch.frombuffer(bytearray(json.dumps(_encode(work)).encode()), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world())]
    dist.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64))
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(world())]
    dist.all_gather(gathered, padded)
    docs = [json.loads(g[: int(n.item())].numpy().tobytes()) for g, n in zip(gathered, sizes)]
    parts = _decode(docs)  # every rank raises the same error, if any
    return parts if rank() == 0 else None


def share_exit_code(code: int) -> int:
    """Rank 0's exit code on every rank (each rank exits as the compare did)."""
    if world() <= 1:
        return code
    t = torch.tensor([code], dtype=torch.int64)
    dist.broadcast(t, src=0)
    return int(t.item())
