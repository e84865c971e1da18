"""Turn scenarios into launches: dedupe sides, group them by world size, run the groups.

Every side becomes a :class:`~harness.run.job.Job` whose trace folder is named by what the
side computes: its configuration (:meth:`Side.key`), its capture policy and the code that runs
it (:func:`harness.run.provenance.code_identity`). A side shared by several scenarios of a matrix
(the GTP-off reference, the golden) runs once, and a complete trace is reused by a later run
only when all three are equal: editing megatron-core makes every side run again. Jobs of one world size share
one launch; launches of different world sizes run concurrently, up to ``parallel`` at a time, to keep the
cores busy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import json
import shutil
import signal
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness.capture import trace
from harness.run.job import Job
from harness.scenario.checkpoint import saver_side
from harness.common.errors import RunFailed
from harness.common.jsonio import write_json
from harness.run.trees import BRIDGE, CodeTree, resolve_all
from harness.run.launch import Interrupted, describe_pending, launch, raised_record, worker_env, write_plan
from harness.run.provenance import code_identity
from harness.run.warm import WarmPool
from harness.scenario import COMPARED_ROLES, Role, Scenario

# Sides per launch: more share the start-up cost, fewer keep the cores busy in parallel.
MAX_JOBS_PER_LAUNCH = 12


def job_for(s: Scenario, role: str, traces: Path, provenance: dict, checkpoint_dir: str = "",
            megatron_root: str = "") -> Job:
    side = s.sides[role] if role in s.sides else saver_side(s)  # Role.SAVER
    key = side.key(s.model, s.data)
    policy = hashlib.sha256(json.dumps(dataclasses.asdict(s.capture),
                                       sort_keys=True).encode()).hexdigest()[:6]
    code = provenance["digest"][:6]
    return Job(
        key=f"{key}-{policy}-{code}",
        model=s.model,
        data=s.data,
        side=side,
        capture=s.capture,
        trace_dir=str(traces / f"{side.label()}-{key}-{policy}-{code}"),
        provenance=provenance,
        checkpoint_dir=checkpoint_dir,
        megatron_root=megatron_root,
    )


def plan(scenarios: list[Scenario], out: Path, provenance: dict | None = None,
         trees: dict[str, CodeTree] | None = None,
         bridges: dict[str, CodeTree] | None = None) -> dict[str, dict[str, Job]]:
    """Scenario name -> role -> job (jobs shared between scenarios are the same object).

    ``trees``: spec -> resolved megatron-core tree (:func:`harness.run.trees.resolve_all`),
    ``bridges`` the same for Megatron-Bridge (both resolved here where not given); each tree's
    sides are keyed by the identity of the code they import. ``provenance`` overrides the
    installed tree's identity."""
    traces = out / "traces"
    trees = resolve_all(scenarios) if trees is None else trees
    identities: dict[str, dict] = {} if provenance is None else {"": provenance}
    bridges = resolve_all(scenarios, BRIDGE) if bridges is None else bridges

    def code_of(s: Scenario, role: str) -> tuple[dict, str]:
        side = s.sides[role] if role in s.sides else s.saver
        tree = trees.get(side.megatron_core)
        root = tree.root if tree is not None else ""
        if side.backend == "bridge" and side.bridge != "installed":  # Bridge's tree after megatron-core's
            root = os.pathsep.join(filter(None, [root, bridges[side.bridge].root]))
        if root not in identities:
            identities[root] = code_identity(worker_env(root), tree)
        return identities[root], root

    jobs: dict[str, Job] = {}
    by_scenario = {}
    for s in scenarios:
        roles, ckpt = {}, ""
        if s.saver is not None:  # the checkpoint lives beside the saving side's trace
            identity, root = code_of(s, Role.SAVER)  # the saver imports its own tree, as the sides do
            job = job_for(s, Role.SAVER, traces, identity, megatron_root=root)
            ckpt = str(Path(job.trace_dir) / "checkpoint")
            roles[Role.SAVER] = jobs.setdefault(job.key, dataclasses.replace(job, checkpoint_dir=ckpt))
        for role in COMPARED_ROLES:
            identity, root = code_of(s, role)
            job = job_for(s, role, traces, identity, ckpt if role == "candidate" else "", root)
            roles[role] = jobs.setdefault(job.key, job)
        by_scenario[s.name] = roles
    return by_scenario


@dataclasses.dataclass(frozen=True)
class Launch:
    """Jobs of one world size that run in one torchrun launch (or one launch over nodes)."""

    name: str
    world: int
    phase: int
    """0: it saves checkpoints, and runs before every phase-1 launch (which may load them)."""
    jobs: list[Job]
    timeout_s: dict[str, float]


def pending_jobs(by_scenario: dict[str, dict[str, Job]], fresh: bool = False,
                 progress=print) -> dict[str, Job]:
    """Key -> job of every job whose trace is not complete (every job if ``fresh``)."""
    pending = {}
    for roles in by_scenario.values():
        for job in roles.values():
            if job.key in pending:
                continue
            if not fresh and trace.is_complete(job.trace_dir):
                progress(f"  reused {job.side.label()}: {job.trace_dir} (same configuration and code)")
                continue
            pending[job.key] = job
    return pending


def launches(by_scenario: dict[str, dict[str, Job]], scenarios: list[Scenario],
             pending: dict[str, Job]) -> list[Launch]:
    """The pending jobs grouped into launches, in the order they must run (savers first). A
    candidate its scenario expects to raise (``[expect] raises``) runs in a launch of its own:
    a failing job ends its launch, and no other side goes with it."""
    timeout = {}
    for s in scenarios:
        for job in by_scenario[s.name].values():
            timeout[job.key] = max(timeout.get(job.key, 0.0), s.timeout_s)
    alone = sorted({by_scenario[s.name][Role.CANDIDATE].key for s in scenarios if s.expect
                    and s.expect.raises})
    groups = defaultdict(list)
    for job in pending.values():  # checkpoints are saved (phase 0) before sides load them
        own = alone.index(job.key) + 1 if job.key in alone else 0
        groups[(0 if job.side.save_step else 1, job.side.world_size, job.megatron_root, own)].append(job)
    out = []
    trees = sorted({root for (_, _, root, _) in groups})  # a launch imports one megatron-core
    for (phase, world, root, own), jobs in sorted(groups.items()):
        for i in range(0, len(jobs), MAX_JOBS_PER_LAUNCH):
            code = f"-code{trees.index(root)}" if root else ""
            tag = f"w{world}{code}-{i // MAX_JOBS_PER_LAUNCH}" + ("-save" if phase == 0 else "")
            tag += f"-alone{own}" if own else ""
            batch = jobs[i : i + MAX_JOBS_PER_LAUNCH]
            out.append(Launch(tag, world, phase, batch, {j.key: timeout[j.key] for j in batch}))
    return out


def after_raise(b: Launch) -> Launch | None:
    """Where the code under test raised in one of a launch's sides (a parity verdict, not a
    failed run), the launch of the sides it took with it, that never ran or never finished; None
    where none raised so, or none is left. Their partial traces are removed first."""
    raised = {j.key for j in b.jobs if not trace.is_complete(j.trace_dir) and raised_record(j, b.world)}
    rest = [j for j in b.jobs if not trace.is_complete(j.trace_dir) and j.key not in raised]
    if not raised or not rest:
        return None
    clear_incomplete(rest)
    timeout_s = {j.key: b.timeout_s[j.key] for j in rest}
    return Launch(f"{b.name}-after{len(raised)}", b.world, b.phase, rest, timeout_s)


def clear_incomplete(jobs) -> None:
    """An incomplete trace left by an earlier failed run is not resumed: remove it."""
    for job in jobs:
        shutil.rmtree(job.trace_dir, ignore_errors=True)


def write_plans(batches: list[Launch], out: Path) -> list[Path]:
    """Write every launch's plan under ``out/launches`` (read by every rank of every node), and
    ``out/launches/plans.json`` listing them in the order they run; return the plans' paths."""
    paths = [write_plan(out / "launches" / f"plan-{b.name}.json", b.jobs, world=b.world, name=b.name,
                        timeout_s=b.timeout_s) for b in batches]
    write_json(out / "launches" / "plans.json", {"launches": [
        {"name": b.name, "world": b.world, "phase": b.phase, "plan": str(p),
         "sides": [{"side": j.side.label(), "key": j.key, "trace_dir": j.trace_dir} for j in b.jobs]}
        for b, p in zip(batches, paths)]})
    return paths


def execute(
    by_scenario: dict[str, dict[str, Job]],
    scenarios: list[Scenario],
    out: Path,
    parallel: int = 2,
    progress=print,
    fresh: bool = False,
    collect: bool = False,
    pool: WarmPool | None = None,
) -> dict[str, str]:
    """Run every job whose trace is not complete (every job if ``fresh``). Return job key ->
    error message for failed ones. ``collect``: launch nothing; every job without a complete
    trace fails, its message saying why (not run, or how far its ranks got). ``pool``: launches
    go to its warm workers (:mod:`harness.run.warm`) instead of processes of their own."""
    pending = pending_jobs(by_scenario, fresh=fresh and not collect, progress=progress)
    if collect:
        return {key: describe_pending(job, job.side.world_size) for key, job in pending.items()}
    clear_incomplete(pending.values())
    phases = defaultdict(list)
    for b in launches(by_scenario, scenarios, pending):
        phases[b.phase].append(b)
    failures: dict[str, str] = {}

    stop = threading.Event()

    def one(b: Launch):
        if stop.is_set():
            return
        try:
            run = launch if pool is None else pool.launch
            wall = run(b.jobs, world=b.world, timeout_s=b.timeout_s, workdir=out / "launches", name=b.name,
                       stop=stop)
            progress(f"  launch {b.name}: {len(b.jobs)} side(s) on {b.world} rank(s) in {wall:.1f} s")
        except Interrupted:
            pass
        except RunFailed as e:
            progress(f"  launch {b.name} FAILED: {e}")
            for j in b.jobs:
                if not trace.is_complete(j.trace_dir):
                    failures[j.key] = str(e)
            if (after := after_raise(b)) is not None:
                for j in after.jobs:
                    failures.pop(j.key, None)
                one(after)

    threads = ThreadPoolExecutor(max_workers=max(1, parallel))
    with _interrupt_sets(stop) as interrupted:
        try:
            for phase in sorted(phases):
                if stop.is_set():
                    break
                for f in [threads.submit(one, b) for b in phases[phase]]:
                    f.result()
        except BaseException:
            stop.set()  # tell every launch to end its ranks now
            raise
        finally:
            threads.shutdown(wait=True)
    if interrupted:
        raise KeyboardInterrupt
    return failures


@contextlib.contextmanager
def _interrupt_sets(stop: threading.Event):
    """Ctrl-C (and SIGTERM where the caller treats it alike, as the CLI does) sets ``stop``
    instead of raising wherever the main thread is: a KeyboardInterrupt landing inside the
    executor's own locking (a submit, a shutdown) could leave a lock held and the run hung. The
    launches see ``stop`` and end their ranks; the caller raises KeyboardInterrupt once they have."""
    interrupted: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield interrupted
        return

    def on_signal(signum, frame):
        interrupted.append(signum)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
                if signal.getsignal(sig) is signal.default_int_handler}
    try:
        yield interrupted
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
