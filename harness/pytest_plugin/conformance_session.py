"""The conformance session behind :mod:`harness.pytest_plugin.conformance`: items and the run.

Registered only when ``--distributed-weight-impl`` (or its ini twin) names an implementer.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch.distributed as dist

from harness.conformance.registry import CLAUSES
from harness.conformance.failures import failure_lines
from harness.conformance.kit import (
    ConformanceResult,
    Topology,
    default_topologies,
    run_conformance,
)

COLLECTIVE_TIMEOUT_S = 120


class ConformanceSession:
    """Adds the clause items and runs the kit once, lazily, on the first item."""

    def __init__(self, spec: str, factory, topologies: list[Topology]):
        self.spec, self.factory, self.topologies = spec, factory, topologies
        self._result: ConformanceResult | None = None
        self._error: str | None = None
        self._owns_group = False

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, session: pytest.Session, items: list) -> None:
        """Append one item per clause, before keyword selection sees the list."""
        parent = ConformanceCollector.from_parent(session, name="conformance", nodeid="conformance")
        items.extend(ClauseItem.from_parent(parent, name=clause, runner=self) for clause in CLAUSES)

    def pytest_unconfigure(self) -> None:
        """Tear down the process group if this plugin created it."""
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()

    def result(self) -> ConformanceResult:
        """Run the kit on first use (all ranks at once) and cache the gathered result."""
        if self._result is None and self._error is None:
            try:
                self._result = self._run()
            except Exception as exc:
                self._error = f"{type(exc).__name__}: {exc}"
        if self._error is not None:
            raise ConformanceRunError(self._error)
        return self._result

    def _run(self) -> ConformanceResult:
        if not dist.is_initialized():
            if int(os.environ.get("WORLD_SIZE", "1")) < 2:
                raise RuntimeError(
                    "the conformance kit needs at least 2 ranks: run pytest under "
                    "`torchrun --nproc-per-node N -m pytest ...`"
                )
            dist.init_process_group(
                "gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
            )
            self._owns_group = True
        world = dist.get_world_size()
        return run_conformance(
            self.factory, impl=self.spec, topologies=self.topologies or default_topologies(world)
        )


class ConformanceRunError(Exception):
    """The kit could not run at all (no process group, an exception outside the drive)."""


class ClauseFailed(Exception):
    """A clause failed or errored on some rank."""


class ConformanceCollector(pytest.Collector):
    """Parent node for the clause items; never collects from files."""

    def collect(self):
        return []


class ClauseItem(pytest.Item):
    """One clause, judged over every case, mode and rank."""

    def __init__(self, *, runner: ConformanceSession, **kwargs):
        super().__init__(**kwargs)
        self.runner = runner

    def runtest(self) -> None:
        """Pass, skip (not applicable anywhere) or fail with the clause's failure records."""
        result = self.runner.result()
        status = result.clause_status(self.name)
        records = [r for r in result.records if r.clause == self.name]
        if status == "skip":
            pytest.skip("; ".join(sorted({r.reason for r in records if r.reason})) or "no case ran")
        if status in ("fail", "error"):
            lines = [f"{self.name}: {CLAUSES[self.name]}"]
            lines += [
                f"error: {r.case} ({r.mode}): {r.reason}" for r in records if r.status == "error"
            ]
            lines += failure_lines(result.failures(self.name))
            raise ClauseFailed("\n".join(lines))

    def repr_failure(self, excinfo, style=None):
        """Show the failure records, not a traceback into the plugin."""
        if isinstance(excinfo.value, (ClauseFailed, ConformanceRunError)):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        return self.path, None, f"conformance::{self.name}"
