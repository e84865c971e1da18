"""The per-rank entry point: ``python -m harness.backends.worker PLAN`` under torchrun, under
SLURM's ``srun`` (rank, world size and local rank from SLURM's variables, the store at
``MASTER_ADDR:MASTER_PORT``: :func:`harness.run.nodes.rank_env`), or alone (world 1).

A plan is a JSON list of jobs of one world size. The worker runs them in sequence in this
one process (launch cost dominates small runs), resetting megatron-core's state between
them. A job whose trace is already complete is skipped, so equal sides are run once.

On an exception the rank writes ``rank{r}/error.json`` (rank, node, step, traceback) in the
job's trace before exiting non-zero; the launcher turns it into a message. On a machine with
CUDA each rank binds ``cuda:<local rank>`` and the process group sends CUDA tensors over NCCL
(CPU tensors over gloo); on CPU it is gloo alone, as it always was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from harness import backends
from harness.backends import data as data_mod
from harness.run.job import Job
from harness.run.nodes import RankEnv, rank_env
from harness.capture.api import Capture
from harness.common import mtp
from harness.common.mesh import Mesh
from harness.capture.trace import is_complete
from harness.common.jsonio import write_json


def run_job(job: Job, rank: int, world: int, node: int = 0) -> None:
    trace_dir = Path(job.trace_dir)
    side = job.side
    coord = data_mod.coord(rank, side)
    mesh = Mesh.of_side(side).sizes()  # with the pipeline axis where there is one
    cap = Capture(trace_dir, rank=rank, world_size=world, coord=coord, mesh=mesh, policy=job.capture,
                  node=node)
    before = set(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else set()
    try:
        backends.run(job, cap)
    except BaseException as e:
        doc = {"rank": rank, "node": node, "step": cap.step, "phase": getattr(cap, "phase", None),
               "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        if isinstance(e, Exception) and (raised := raised_by_code_under_test(e)) is not None:
            doc["raised"] = raised
        write_json(trace_dir / f"rank{rank}" / "error.json", doc)
        raise
    cap.close()
    if world > 1:
        dist.barrier()
    if dist.is_initialized():
        destroy_job_groups(before)
    if rank == 0:
        Capture.finalize(
            trace_dir,
            world_size=world,
            coords={r: data_mod.coord(r, side) for r in range(world)},
            mesh=mesh,
            meta={"side": side.label(), "key": job.key, "backend": side.backend,
                  "precision": side.precision, "recipe": side.recipe, "steps": side.steps,
                  "provenance": job.provenance, "mutant": side.mutant or None, **_stand_ins(),
                  # what the update judgement names terms by (harness.compare.updates)
                  "train": {"optimizer": side.optimizer, "lr": side.lr, "weight_decay": side.weight_decay},
                  # what the comparison derives each tensor's expectation from (harness.compare.expectations)
                  "config": {**dataclasses.asdict(side), "micro_batches": side.num_microbatches(job.data),
                             **mtp.manifest_config(job.model)}},
        )


def destroy_job_groups(before: set) -> None:
    """Destroy the process groups a job made (those not in ``before``), but the torch backend's,
    kept per mesh. megatron-core makes its groups anew for every side and ``destroy_model_parallel``
    only drops its references: each gloo group keeps a transport thread that wakes every few
    milliseconds, and a warm worker that had run a few hundred sides spent its cores on them."""
    from harness.backends.torch.comm import kept_groups

    keep = before | kept_groups()
    made = [g for g in dist.distributed_c10d._world.pg_map if g not in keep]
    while made:
        dist.destroy_process_group(made.pop())
    gc.collect()  # what held them in cycles (the optimizer, the capture's hooks) goes with them


_CODE_UNDER_TEST = ("megatron",)  # megatron-core, Megatron-LM's training loop, Megatron-Bridge
_PATCHES = (Path(__file__).resolve().parent / "faults",)  # planted faults and mutants stand in for that code


_DIST = Path(dist.__file__).resolve().parent  # torch.distributed's Python


def raised_by_code_under_test(e: Exception) -> dict | None:
    """Where the code under test raised ``e``: its type, message and innermost frame in that code
    (file relative to the tree, function, line) and the tree; None where the harness raised it.
    Walking out from the innermost frame, the first frame of the code under test (or of a fault
    planted in it) decides for it, the first other frame of the harness against it; library frames
    (torch, the standard library) are passed through. A RuntimeError raised inside
    torch.distributed is a collective's failure (a peer that stopped, a broken transport), not
    the code's own raise, whoever called the collective."""
    roots = [Path(p).resolve() for name in _CODE_UNDER_TEST if (m := sys.modules.get(name)) is not None
             for p in getattr(m, "__path__", [])]
    harness_root = Path(__file__).resolve().parents[1]
    frames = traceback.extract_tb(e.__traceback__)
    if frames and isinstance(e, RuntimeError) and Path(frames[-1].filename).resolve().is_relative_to(_DIST):
        return None  # a collective failed (a peer stopped, the transport broke): the launch names who
    decided = False
    for f in reversed(frames):
        path = Path(f.filename).resolve()
        tree = next((r for r in roots if path.is_relative_to(r)), None)
        if tree is not None or any(path.is_relative_to(p) for p in _PATCHES):
            decided = True
            if tree is not None:
                frame = {"file": str(path.relative_to(tree.parent)), "function": f.name, "line": f.lineno}
                return {"type": type(e).__name__, "message": str(e), "tree": str(tree.parent), "frame": frame}
        elif path.is_relative_to(harness_root) and not decided:
            return None
    return None


def _stand_ins() -> dict:
    """The CPU layer's stand-ins this process applied (where the megatron backends ran)."""
    compat = sys.modules.get("harness.backends.megatron.compat")
    return {"stand_ins": found} if compat is not None and (found := compat.applied()) else {}


def process_group_backend(local_rank: int) -> str:
    """gloo on CPU; where CUDA is usable, bind ``cuda:<local rank>`` and route CUDA tensors
    over NCCL (the backends' CPU tensors, the golden's, still go over gloo)."""
    if not torch.cuda.is_available():
        return "gloo"
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    return "cpu:gloo,cuda:nccl"


def init_group(who: RankEnv, jobs: list[Job], timeout_s: float) -> None:
    backend = process_group_backend(who.local_rank)
    if who.world > 1 and who.launcher == "slurm":
        # srun started the ranks: rank 0 hosts the store at MASTER_ADDR:MASTER_PORT (env://),
        # and a rank that never comes ends the wait after the plan's longest budget.
        dist.init_process_group(backend, rank=who.rank, world_size=who.world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    elif who.world > 1:
        dist.init_process_group(backend, rank=who.rank, world_size=who.world)  # torchrun's store
    elif any(j.side.backend in ("megatron", "mlm", "bridge") for j in jobs):
        # One rank needs no rendezvous: an in-process store, no port to collide on.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def main(argv: list[str]) -> int:
    plan = json.loads(Path(argv[0]).read_text())
    jobs = [Job.from_json(j) for j in plan["jobs"]]
    try:
        who = rank_env(dict(os.environ), plan.get("world", jobs[0].side.world_size))
        for job in jobs:
            if job.side.world_size != who.world:
                raise ValueError(f"job {job.key} needs world size {job.side.world_size}, launched with "
                                 f"{who.world}")
    except ValueError as e:
        print(f"harness.backends.worker: {e}", file=sys.stderr)
        return 2
    with rank_process(who, jobs, max(plan.get("timeout_s", {}).values(), default=600.0) + 180.0):
        for job in jobs:
            if is_complete(job.trace_dir):
                continue
            run_job(job, who.rank, who.world, who.node)
    return 0


@contextlib.contextmanager
def rank_process(who: RankEnv, jobs: list[Job], timeout_s: float, group: bool = True):
    """A rank's process as a launch's and a warm worker's ranks run: one thread, deterministic
    kernels, its process group (``group``: now, else left to the first plan) destroyed on the way out."""
    torch.set_num_threads(1)  # ranks share the cores; one thread keeps CPU GEMMs deterministic
    torch.use_deterministic_algorithms(True)
    if group:
        init_group(who, jobs, timeout_s)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
