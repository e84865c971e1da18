"""Warm workers: launches that reuse processes already started, one pool per campaign.

A launch's cost on small sides is mostly starting torchrun and importing torch and megatron-core
on every rank. A :class:`WarmPool` keeps a worker (``python -m harness.backends.serve``) alive per
world size and megatron-core tree, and hands it plan after plan; :meth:`WarmPool.launch` takes the
arguments of :func:`harness.run.launch.launch` and behaves as it does: the same per-side timeouts,
counted from the side's first heartbeat (start-up has its own budget), the same messages naming
rank and step when a rank raises, exits or hangs, Ctrl-C ending the launch at once and marking its
unfinished traces incomplete. A worker whose plan failed in any way is killed (its whole process
session) and the next plan of its kind starts a fresh one; a worker is only reused after a plan
that finished. :meth:`WarmPool.close` ends every worker; nothing outlives the pool.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness.common.errors import RunFailed
from harness.run.job import Job
from harness.run.launch import _kill, _watch, describe_failure, worker_env, write_plan

IDLE_S = 3600.0
"""Seconds a worker waits for its next plan before it ends itself: a backstop (a worker also ends
when its pool's process is gone); a loaded machine's batch and shrink can take many minutes."""
REUSE_S = IDLE_S / 2
"""A worker idle this long is replaced, not given a plan it might stop waiting for."""
MAX_PLANS = 200
"""A worker is replaced after this many plans (a bound on what a long campaign's process holds)."""


def plan_path(folder: Path, n: int) -> Path:
    """A warm worker's ``n``-th plan (written atomically: every rank reads it whole or not at all)."""
    return folder / f"plan-{n:04d}.json"


def done_path(folder: Path, n: int) -> Path:
    """Written by rank 0 once plan ``n`` is done: ``{"plan", "pid", "name", "seconds", "jobs", "threads",
    "process_groups"}`` (each job's seconds; the threads and process groups the process holds after it)."""
    return folder / f"done-{n:04d}.json"


def serve_command(folder: Path, world: int, idle_s: float) -> list[str]:
    serve = ["-m", "harness.backends.serve", str(folder), "--owner", str(os.getpid()), "--idle", str(idle_s),
             "--world", str(world)]
    if world == 1:
        return [sys.executable, *serve]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
            "--max-restarts=0", *serve]


@dataclass
class Worker:
    """One warm worker: its process session, its folder of plans, how many it was given."""

    world: int
    root: str
    folder: Path
    proc: subprocess.Popen
    code: str = ""
    """The digest of the code it imported (the jobs' provenance): an edit makes it of no use."""
    plans: int = 0
    idle_since: float = field(default_factory=time.monotonic)

    def ask_to_stop(self) -> None:
        (self.folder / "stop").touch()

    @property
    def log(self) -> Path:
        return self.folder / "worker.log"

    def run(self, jobs: list[Job], timeout_s: dict[str, float], name: str,
            stop: threading.Event | None) -> None:
        """Run one plan as a launch would; raise RunFailed (the worker is then of no further use)."""
        self.plans += 1
        n = self.plans
        what = f"launch {name} (world {self.world}, warm worker {self.folder.name} plan {n})"
        write_plan(plan_path(self.folder, n), jobs, world=self.world, name=name, timeout_s=timeout_s)
        done = done_path(self.folder, n)
        # Ctrl-C (``stop``) and timeouts raise here, the process session killed, as a launch's do.
        rc = _watch(self.proc, jobs, self.world, timeout_s, what, stop, self.log, done=done)
        if not done.exists():  # it exited: a rank raised, or exited hard
            raise RunFailed(f"{what} failed (exit {rc}); " + describe_failure(jobs, self.world)
                            + f"; log: {self.log}")
        self.idle_since = time.monotonic()

    def end(self, polite: bool = True) -> None:
        """Ask the worker to stop (``polite``: a failed one is not asked), then end its whole
        process session whatever it does."""
        if polite:
            self.ask_to_stop()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        _kill(self.proc)


class WarmPool:
    """Warm workers by (world size, megatron-core tree), started on first use; use as a context
    manager, or call :meth:`close`. Safe to call from the launch threads of
    :func:`harness.run.plan.execute` (two launches of one kind at once get two workers)."""

    def __init__(self, folder: Path, idle_s: float = IDLE_S):
        self.folder, self.idle_s = folder, idle_s
        self._free: dict[tuple[int, str], list[Worker]] = {}
        self._all: list[Worker] = []
        self._lock = threading.Lock()
        self.started = 0

    def __enter__(self) -> WarmPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _take(self, world: int, root: str, code: str = "") -> Worker:
        with self._lock:
            free = self._free.setdefault((world, root), [])
            while free:
                w = free.pop()
                fit = time.monotonic() - w.idle_since < REUSE_S and w.plans < MAX_PLANS and w.code == code
                if w.proc.poll() is None and fit:
                    return w
                self._drop(w)
            self.started += 1
            folder = self.folder / f"w{world}-{self.started:03d}"
            shutil.rmtree(folder, ignore_errors=True)  # a resumed campaign's: its plans are not this one's
            folder.mkdir(parents=True)
            env = worker_env(root)
            if world == 1:
                env.update(RANK="0", WORLD_SIZE="1")
            with open(folder / "worker.log", "wb") as log:
                proc = subprocess.Popen(serve_command(folder, world, self.idle_s), stdout=log,
                                        stderr=subprocess.STDOUT, env=env, start_new_session=True)
            w = Worker(world, root, folder, proc, code=code)
            self._all.append(w)
            return w

    def _drop(self, w: Worker, polite: bool = True) -> None:
        w.end(polite)
        if w in self._all:
            self._all.remove(w)

    def launch(self, jobs: list[Job], *, world: int, timeout_s: dict[str, float], workdir: Path, name: str,
               stop: threading.Event | None = None) -> float:
        """:func:`harness.run.launch.launch` on a warm worker (``workdir`` is not used: the plan and
        the log live in the worker's folder); return wall seconds. Raise RunFailed."""
        roots = {j.megatron_root for j in jobs}
        if len(roots) != 1:  # one interpreter imports one megatron-core
            raise ValueError(f"launch {name}: jobs of several megatron-core trees {sorted(roots)}")
        start = time.monotonic()
        # A worker imported the code once: one whose tree (or harness) was edited since is replaced.
        codes = {j.provenance.get("digest", "") for j in jobs}
        w = self._take(world, roots.pop(), codes.pop() if len(codes) == 1 else "")
        try:
            w.run(jobs, timeout_s, name, stop)
        except BaseException:
            with self._lock:
                self._drop(w, polite=False)
            raise
        with self._lock:
            self._free[(world, w.root)].append(w)
        return time.monotonic() - start

    def pids(self) -> list[int]:
        """The process of each live worker (torchrun's, or the rank's at world 1)."""
        return [w.proc.pid for w in self._all if w.proc.poll() is None]

    def close(self) -> None:
        """End every worker (each asked to stop, then its process session killed)."""
        with self._lock:
            for w in self._all:
                w.ask_to_stop()
            for w in list(self._all):
                self._drop(w)
            self._free.clear()
