"""Turn scenarios into launches: dedupe sides, group them by world size, run the groups.

Every side becomes a :class:`~harness.backends.Job` whose trace folder is named by what the
side computes (:meth:`Side.key`), so a side shared by several scenarios of a matrix (the
GTP-off reference, the golden) runs once. Jobs of one world size share one launch; launches
of different world sizes run concurrently, up to ``parallel`` at a time, to keep the cores busy.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness.backends import Job
from harness.errors import RunFailed
from harness.launch import launch
from harness.scenario import Scenario

# Sides per launch: more share the start-up cost, fewer keep the cores busy in parallel.
MAX_JOBS_PER_LAUNCH = 12


def job_for(s: Scenario, role: str, traces: Path) -> Job:
    side = s.sides[role]
    key = side.key(s.model, s.data)
    policy = hashlib.sha256(json.dumps(dataclasses.asdict(s.capture), sort_keys=True).encode()).hexdigest()[:6]
    return Job(
        key=f"{key}-{policy}",
        model=s.model,
        data=s.data,
        side=side,
        capture=s.capture,
        trace_dir=str(traces / f"{side.label()}-{key}-{policy}"),
    )


def plan(scenarios: list[Scenario], out: Path) -> dict[str, dict[str, Job]]:
    """Scenario name -> role -> job (jobs shared between scenarios are the same object)."""
    traces = out / "traces"
    jobs: dict[str, Job] = {}
    by_scenario = {}
    for s in scenarios:
        roles = {}
        for role in ("reference", "candidate", "golden"):
            job = job_for(s, role, traces)
            roles[role] = jobs.setdefault(job.key, job)
        by_scenario[s.name] = roles
    return by_scenario


def execute(
    by_scenario: dict[str, dict[str, Job]],
    scenarios: list[Scenario],
    out: Path,
    parallel: int = 2,
    progress=print,
) -> dict[str, str]:
    """Run every job not already complete. Return job key -> error message for failed ones."""
    timeout = {}
    for s in scenarios:
        for job in by_scenario[s.name].values():
            timeout[job.key] = max(timeout.get(job.key, 0.0), s.timeout_s)
    pending = {}
    for roles in by_scenario.values():
        for job in roles.values():
            if not (Path(job.trace_dir) / "manifest.json").exists():
                # An incomplete trace left by an earlier failed run is not resumed.
                shutil.rmtree(job.trace_dir, ignore_errors=True)
                pending[job.key] = job
    groups = defaultdict(list)
    for job in pending.values():
        groups[job.side.world_size].append(job)
    batches = []
    for world, jobs in sorted(groups.items()):
        for i in range(0, len(jobs), MAX_JOBS_PER_LAUNCH):
            batches.append((world, jobs[i : i + MAX_JOBS_PER_LAUNCH], f"w{world}-{i // MAX_JOBS_PER_LAUNCH}"))
    failures: dict[str, str] = {}

    def one(batch):
        world, jobs, name = batch
        try:
            wall = launch(jobs, world=world, timeout_s={j.key: timeout[j.key] for j in jobs},
                          workdir=out / "launches", name=name)
            progress(f"  launch {name}: {len(jobs)} side(s) on {world} rank(s) in {wall:.1f} s")
        except RunFailed as e:
            progress(f"  launch {name} FAILED: {e}")
            for j in jobs:
                if not (Path(j.trace_dir) / "manifest.json").exists():
                    failures[j.key] = str(e)

    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        list(pool.map(one, batches))
    return failures
