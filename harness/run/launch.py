"""Launch: run a plan of same-world-size jobs under torchrun, with a timeout.

One launch runs every job of its world size in sequence (see harness.backends.worker): a torchrun
launch that only imports megatron-core costs about as much as a small training run. The
launch runs in its own process session, so a timeout kills every rank and nothing is left
behind. A failure is turned into one message naming the rank, the job and the last step,
read from the ranks' error files and heartbeats; traces already written are kept and,
lacking a manifest, read as incomplete. A node's share of a launch over several machines
(:class:`harness.run.nodes.Nodes`) is watched the same way, its messages naming node and rank,
and its unfinished traces get a manifest marking them incomplete.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

from harness.run.job import Job
from harness.run.nodes import NODE_ENV, Nodes
from harness.common.errors import RunFailed
from harness.capture.trace import FORMAT, FORMAT_VERSION, is_complete
from harness.common.jsonio import write_json


STARTUP_S = 180.0
"""Seconds a launch may take to start a side (process start, imports) beyond its own timeout."""


def _any_heartbeat(job: Job, world: int) -> bool:
    return any((Path(job.trace_dir) / f"rank{r}" / "progress.json").exists() for r in range(world))


def worker_env(megatron_root: str = "") -> dict[str, str]:
    """The environment every rank runs in (the side key's provenance is computed from it);
    ``megatron_root``: a megatron-core tree put on the path after the harness (a bridge side's:
    then its Megatron-Bridge tree, ``os.pathsep``-separated)."""
    # PYTHONSAFEPATH: the current folder is not put first on the ranks' path, so a run started
    # inside a Megatron-LM checkout imports the side's megatron-core, not the checkout's.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "PYTHONSAFEPATH": "1"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), megatron_root, env.get("PYTHONPATH")]))
    return env


def command(plan_path: Path, world: int) -> list[str]:
    if world == 1:
        return [sys.executable, "-m", "harness.backends.worker", str(plan_path)]
    # --standalone: the rendezvous store binds port 0 and the ranks share it, so launches
    # running side by side never race for a port picked in advance.
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
        "--max-restarts=0", "-m", "harness.backends.worker", str(plan_path),
    ]


def write_plan(path: Path, jobs: list[Job], *, world: int, name: str, timeout_s: dict[str, float]) -> Path:
    """The launch plan every rank reads (``python -m harness.backends.worker PLAN``)."""
    write_json(path,
               {"name": name, "world": world, "timeout_s": {j.key: timeout_s.get(j.key, 600.0) for j in jobs},
                      "jobs": [j.to_json() for j in jobs]})
    return path


def launch(jobs: list[Job], *, world: int, timeout_s: dict[str, float], workdir: Path, name: str,
           stop: threading.Event | None = None, nodes: Nodes | None = None,
               plan: Path | None = None) -> float:
    """Run ``jobs`` (all of world size ``world``); return wall seconds. Raise RunFailed.

    ``timeout_s`` maps a job key to its budget, counted from when that job starts (the
    previous job's manifest appears), so a hang ends within the hung side's own timeout.
    When ``stop`` is set (Ctrl-C) the launch is killed at once, its unfinished traces are
    marked incomplete, and :class:`Interrupted` is raised. With ``nodes`` this is one node's
    share of the launch (``gtp-parity launch``): ``plan``, written by ``gtp-parity plan``, is
    every node's and is read, not written; a failure names the node and rank and marks the
    unfinished traces incomplete.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    plan_path = plan or workdir / f"plan-{name}.json"
    roots = {j.megatron_root for j in jobs}
    if len(roots) != 1:  # one interpreter imports one megatron-core
        raise ValueError(f"launch {name}: jobs of several megatron-core trees {sorted(roots)}")
    env = worker_env(roots.pop())
    if plan is None:
        write_plan(plan_path, jobs, world=world, name=name, timeout_s=timeout_s)
    node = f"-node{nodes.node_rank}" if nodes is not None and nodes.nnodes > 1 else ""
    log_path = workdir / f"launch-{name}{node}.log"
    if nodes is not None and nodes.endpoint:
        env[NODE_ENV] = str(nodes.node_rank)
        argv = nodes.torchrun(plan_path, world, name, join_timeout_s=STARTUP_S)
    else:
        argv = command(plan_path, world)
    if world == 1:
        env.update(RANK="0", WORLD_SIZE="1")
    start = time.monotonic()
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
            try:
                rc = _watch(proc, jobs, world, timeout_s, f"launch {name} (world {world}{_on(nodes)})",
                            stop, log_path)
            finally:
                _kill(proc)
        if rc != 0:
            raise RunFailed(f"launch {name} (world {world}{_on(nodes)}) failed (exit {rc}); "
                            + describe_failure(jobs, world) + f"; log: {log_path}")
    except RunFailed as e:
        if nodes is not None and not isinstance(e, Interrupted):  # the other nodes' supervisors too
            mark_incomplete(jobs, world, failed=str(e))
        raise
    return time.monotonic() - start


def _on(nodes: Nodes | None) -> str:
    return f", node {nodes.node_rank} of {nodes.nnodes}" if nodes is not None and nodes.nnodes > 1 else ""


def _watch(proc: subprocess.Popen, jobs: list[Job], world: int, timeout_s: dict[str, float], what: str,
           stop: threading.Event | None, log_path: Path, done: Path | None = None) -> int:
    """Wait for the launch to end; its exit code. Raise on a timeout or an interruption.
    ``done``: a file whose appearance ends the wait with 0 (a warm worker's plan done while it
    lives on: :mod:`harness.run.warm`)."""
    current, became, since = None, time.monotonic(), None
    while (rc := proc.poll()) is None:
        if done is not None and done.exists():
            return 0
        if stop is not None and stop.is_set():
            _kill(proc)
            mark_interrupted(jobs, world)
            raise Interrupted(f"{what} interrupted; " + describe_progress(jobs, world))
        job = _current_job(jobs)
        if job is not current:
            current, became, since = job, time.monotonic(), None
        if since is None and current is not None and _any_heartbeat(current, world):
            since = time.monotonic()
        budget = timeout_s.get(current.key, 600.0) if current else 60.0
        # A side's clock starts at its first heartbeat; before that, start-up (torchrun,
        # imports: tens of seconds on a loaded machine) has a budget of its own.
        waited = time.monotonic() - (since if since is not None else became)
        if waited > budget + (0 if since is not None else STARTUP_S):
            raise RunFailed(f"{what} timed out after {waited:.0f} s; " + describe_progress(jobs, world)
                            + f"; log: {log_path}")
        time.sleep(0.25 if done is None else 0.05)
    return rc


class Interrupted(RunFailed):
    """The user interrupted the run (Ctrl-C); every launch has been ended."""


def mark_interrupted(jobs: list[Job], world: int) -> None:
    """Give each started, unfinished trace a manifest saying it is incomplete, so that it is
    kept for reading (``allow_incomplete``) and never reused as complete."""
    mark_incomplete(jobs, world, interrupted=True)


def mark_incomplete(jobs: list[Job], world: int, **why) -> None:
    """Give each started, unfinished trace a manifest with ``complete: false`` and ``why``
    (``interrupted: true``, or ``failed``: the launch's message)."""
    for job in jobs:
        path = Path(job.trace_dir)
        if path.is_dir() and not is_complete(path):
            write_json(path / "manifest.json", {
                "format": FORMAT, "version": FORMAT_VERSION, "complete": False, **why,
                "world_size": world, "coords": {}, "key": job.key, "side": job.side.label(),
            })


def _kill(proc: subprocess.Popen) -> None:
    """End the launch's whole process session: torchrun and every rank."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            continue
    # A rank may outlive torchrun in the session; SIGKILL above reached it too.


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _current_job(jobs: list[Job]) -> Job | None:
    for job in jobs:
        if not is_complete(job.trace_dir):
            return job
    return None


def _beats(job: Job, world: int, name: str = "progress.json") -> dict[int, dict]:
    return {r: b for r in range(world)
            if isinstance(b := _read(Path(job.trace_dir) / f"rank{r}" / name), dict)}


def _namer(*records: dict[int, dict]):
    """How a message names rank r: "rank r", or "node n rank r" once the ranks' records show
    more than one node (a launch over several machines)."""
    node_of = {r: rec["node"] for recs in records for r, rec in recs.items()
               if isinstance(rec.get("node"), int)}
    if len(set(node_of.values())) < 2:
        return lambda r: f"rank {r}"
    return lambda r: f"node {node_of[r]} rank {r}" if r in node_of else f"rank {r} (node unknown)"


def describe_progress(jobs: list[Job], world: int, among: list[int] | None = None) -> str:
    """Name the job and, per rank, the last step and phase reached; the laggard first
    (chosen ``among`` the given ranks, when given). Ranks are named with their node when the
    launch spans several."""
    job = _current_job(jobs)
    if job is None:
        return "every job had finished"
    seen = _beats(job, world)
    if not seen:
        return f"side {job.side.label()}: no rank reached step 0"
    who = _namer(seen, _beats(job, world, "error.json"))

    phases = ["begin", "forward_backward", "optimizer", "end"]

    def order(b):
        phase = b.get("phase")
        return (b.get("step") or 0, phases.index(phase) if phase in phases else 0)

    pool = [r for r in seen if among is None or r in among] or list(seen)
    laggard = min(pool, key=lambda r: order(seen[r]))
    ranks = ", ".join(f"{who(r)} at step {b.get('step')} ({b.get('phase')})" for r, b in sorted(seen.items()))
    silent = [r for r in range(world) if r not in seen]
    extra = f"; no heartbeat from rank(s) {silent}" if silent else ""
    return (
        f"side {job.side.label()}: {who(laggard)} stopped at step {seen[laggard].get('step')} "
        f"({seen[laggard].get('phase')}) [{ranks}]{extra}"
    )


_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "remote worker", "Broken pipe")


def describe_failure(jobs: list[Job], world: int) -> str:
    """Name the rank that failed first: a rank's own error beats a peer's lost connection,
    and a rank that left no report (a hard exit, or a lost node) beats ranks that only lost it."""
    job = _current_job(jobs)
    if job is None:
        return "every job had finished"
    errors = _beats(job, world, "error.json")
    who = _namer(_beats(job, world), errors)
    own = {r: e for r, e in errors.items() if not any(p in e.get("error", "") for p in _PEER_LOST)}
    for r, err in sorted(own.items()):
        return f"side {job.side.label()}: {who(r)} raised at step {err.get('step')}: {err.get('error')}"
    silent = [r for r in range(world) if r not in errors]
    if silent:
        by_node = defaultdict(list)
        for r in silent:
            by_node[who(r).rpartition(" rank ")[0]].append(r)
        if list(by_node) == [""]:
            ranks, how = f"rank(s) {silent}", "a hard exit"
        else:
            ranks = ", ".join(f"{node or 'node unknown'} rank(s) {rs}" for node, rs in by_node.items())
            how = "a hard exit, or the node was lost"
        return f"{ranks} exited without an error report ({how}); " + describe_progress(jobs, world,
            among=silent)
    return f"side {job.side.label()}: every rank lost its peers; " + describe_progress(jobs, world)


def raised_record(job: Job, world: int) -> dict | None:
    """Where the code under test raised in ``job`` (its ranks' error files, written by the
    worker): the exception's type and message, its innermost frame in that code, the tree, the
    step and phase, and the ranks that raised it; None where no rank's error is the code under
    test's (the harness's own failure, a hard exit, a timeout)."""
    errors = _beats(job, world, "error.json")
    own = {r: e for r, e in errors.items() if isinstance(e.get("raised"), dict)}
    if not own:
        return None
    # A rank whose peer crashed raises in its next collective; the peer's exception names the cause.
    causes = {r: e for r, e in own.items() if not any(m in str(e["raised"].get("message", ""))
                                                       for m in PEER_GONE)} or own
    first = causes[min(causes)]
    return {**first["raised"], "step": first.get("step"), "phase": first.get("phase"),
            "ranks": sorted(causes), "side": job.side.label()}


# What gloo raises on a rank whose peer went away (its transport's messages).
PEER_GONE = ("Connection closed by peer", "Connection reset by peer")


def describe_pending(job: Job, world: int) -> str:
    """Why a planned side has no complete trace (``collect``: nothing is launched)."""
    path = Path(job.trace_dir)
    manifest = _read(path / "manifest.json") or {}
    if not path.is_dir():
        return f"side {job.side.label()}: not run (no trace at {path})"
    if manifest.get("failed") or manifest.get("interrupted"):
        why = manifest.get("failed") or "interrupted"
        return f"side {job.side.label()}: trace marked incomplete ({why}); {path}"
    state = describe_failure([job], world) if _beats(job, world, "error.json") else describe_progress([job],
        world)
    return f"incomplete trace (still running, or its launch was lost): {state}; {path}"
