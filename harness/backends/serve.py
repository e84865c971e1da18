"""A warm worker: ``python -m harness.backends.serve DIR --owner PID --idle S`` under torchrun (or
alone, world 1) runs plan after plan in one process, so a launch's start-up (process start,
importing torch and megatron-core on every rank) is paid once per world size and tree, not once
per batch (:class:`harness.run.warm.WarmPool` feeds it).

Every rank polls ``DIR`` for the next numbered plan, ``plan-0001.json``, ``plan-0002.json``, ...
(written atomically by the pool), reads it itself (JSON: nothing pickled crosses the process
boundary) and runs its jobs exactly as a launch's worker does (:func:`harness.backends.worker.run_job`:
every side's patches, planted faults and mutants undone, megatron-core's state reset after it);
then rank 0 writes ``done-0001.json`` with the process id that served it. A job that raises ends
the worker as it ends a launch (its ranks' error files name rank and step), and the pool starts a
fresh one for the next plan. A ``DIR/stop`` file, ``S`` seconds without a plan, or the owner
process gone end the loop cleanly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

from harness.backends.patching import undo_all
from harness.backends.worker import init_group, rank_process, run_job
from harness.capture.trace import is_complete
from harness.common.jsonio import write_json
from harness.run.job import Job
from harness.run.nodes import RankEnv, rank_env
from harness.run.warm import done_path, plan_path

POLL_S = 0.05


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _threads() -> int:
    """This process's threads, C++ ones too where /proc tells (gloo's: a process group keeps three)."""
    task = Path("/proc/self/task")
    return len(os.listdir(task)) if task.is_dir() else threading.active_count()


def _next_plan(folder: Path, n: int, owner: int, idle_s: float) -> dict | None:
    """Plan ``n`` once it is there; None when the loop ends (stop file, idle, owner gone)."""
    since = time.monotonic()
    while True:
        path = plan_path(folder, n)
        if path.exists():
            return json.loads(path.read_text())
        if (folder / "stop").exists() or time.monotonic() - since > idle_s or not _alive(owner):
            return None
        time.sleep(POLL_S)


def serve(folder: Path, who: RankEnv, owner: int, idle_s: float) -> None:
    n = 1
    while (plan := _next_plan(folder, n, owner, idle_s)) is not None:
        jobs = [Job.from_json(j) for j in plan["jobs"]]
        wrong = [j.key for j in jobs if j.side.world_size != who.world]
        if wrong:
            raise ValueError(f"plan {n}: job {wrong[0]} is not of this worker's world size {who.world}")
        if not dist.is_initialized():  # world 1: only the megatron backends need a group
            init_group(who, jobs, 600.0)
        undo_all()  # nothing is left patched between plans (each side undoes its own already)
        start, seconds = time.monotonic(), {}
        for job in jobs:
            if not is_complete(job.trace_dir):
                t0 = time.monotonic()
                run_job(job, who.rank, who.world, who.node)
                seconds[job.key] = round(time.monotonic() - t0, 3)
        if who.rank == 0:  # where a plan's time went, and what the process holds after it
            write_json(done_path(folder, n), {
                "plan": n, "pid": os.getpid(), "name": plan.get("name"),
                "seconds": round(time.monotonic() - start, 3), "jobs": seconds, "threads": _threads(),
                "process_groups": len(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else 0})
        n += 1


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.backends.serve")
    p.add_argument("folder", type=Path)
    p.add_argument("--owner", type=int, required=True, help="the pool's process: the loop ends with it")
    p.add_argument("--idle", type=float, default=600.0, help="seconds without a plan that end the loop")
    p.add_argument("--world", type=int, default=1)
    args = p.parse_args(argv)
    try:
        who = rank_env(dict(os.environ), args.world)
    except ValueError as e:
        print(f"harness.backends.serve: {e}", file=sys.stderr)
        return 2
    with rank_process(who, [], 600.0, group=who.world > 1):  # world 1: only the megatron backends need one
        serve(args.folder, who, args.owner, args.idle)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
