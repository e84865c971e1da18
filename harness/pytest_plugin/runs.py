"""The ``gtp_parity`` plugin's work: session settings, running scenarios, the ``parity`` fixture.

:mod:`harness.pytest_plugin.plugin` registers the hooks; this module does what they ask.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from harness import scenario
from harness.scenario.planting import plant
from harness.pytest_plugin.options import resolve


class ParityState:
    """Per-session settings and caches."""

    def __init__(self, config):
        report = resolve(config, "parity_report")
        self.report = (report.base / report.value).resolve() if report.value else None
        self.matrix = None
        matrix = resolve(config, "parity_matrix")
        if matrix.value:
            self.matrix = (matrix.base / matrix.value).resolve()
            if not self.matrix.is_file():
                raise pytest.UsageError(f"{matrix.where}: {matrix.value}: no such file (looked at "
                                        f"{self.matrix})")
        timeout = resolve(config, "parity_dist_timeout")
        raw, where = timeout.value, timeout.where
        try:
            self.timeout_s = float(raw) if raw else 300.0
        except ValueError:
            self.timeout_s = -1.0
        if not self.timeout_s > 0:
            raise pytest.UsageError(f"{where}: {raw!r} is not a positive number of seconds")
        self.worker = hasattr(config, "workerinput")
        self.started = time.time()
        self.agreement = None
        self.matrix_runs: dict[str, dict] = {}

    @property
    def rank(self) -> int:
        return self.agreement.rank if self.agreement else 0


STATE = pytest.StashKey[ParityState]()
"""Where the plugin keeps the session's :class:`ParityState`."""


def load_scenarios(path: Path, inject=None, inject_side: str = "candidate") -> list:
    """Scenarios of a file, with faults planted as ``gtp-parity run --inject`` plants them."""
    return plant(scenario.load(path), inject, inject_side)


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")[:120] or "test"


def execute(state: ParityState, scenarios: list, out: Path, report_name: str, parallel: int = 1) -> dict:
    """Run scenarios (rank 0 only under torchrun: the others receive its summary)."""

    def produce() -> dict:
        from harness import session  # torch and the backends: only when a scenario runs

        session.run_scenarios(scenarios, out, parallel=parallel)
        summary = json.loads((out / "summary.json").read_text())
        if state.report is not None:
            from harness.report import write_index

            write_index(out, state.report / report_name)
        return {**summary, "run_dir": str(out)}

    if state.agreement is None:
        return produce()
    budget = state.timeout_s + 3 * sum(s.timeout_s for s in scenarios)
    return state.agreement.from_rank0(produce, budget)


class ParityFixture:
    """The ``parity`` fixture: runs scenario files into this test's own folders."""

    def __init__(self, request, tmp_path_factory):
        self.node, self.factory = request.node, tmp_path_factory
        self.state: ParityState = request.config.stash[STATE]
        self.calls = 0
        self.marked: dict | None = None

    def resolve(self, path) -> Path:
        p = Path(path)
        tried = (
            [p]
            if p.is_absolute()
            else [Path.cwd() / p, self.node.path.parent / p, self.node.config.rootpath / p]
        )
        for candidate in tried:
            if candidate.is_file():
                return candidate
        raise FileNotFoundError(f"scenario {path}: no such file (looked at {', '.join(map(str, tried))})")

    def __call__(self, path=None, inject=None, inject_side: str = "candidate") -> dict:
        if path is None:
            marker = self.node.get_closest_marker("parity")
            if marker is None:
                raise TypeError("parity() needs a scenario path, or a @pytest.mark.parity(path) on the test")
            if self.marked is None:
                self.marked = self(*marker.args, **{k: v for k, v in marker.kwargs.items()
                                                    if k in ("inject", "inject_side")})
            return self.marked
        scenarios = load_scenarios(self.resolve(path), inject, inject_side)
        name = safe_name(self.node.nodeid) + (f"-{self.calls}" if self.calls else "")
        self.calls += 1
        out = self.factory.mktemp(f"parity-{safe_name(self.node.name)[:40]}", numbered=True)
        return execute(self.state, scenarios, out, name)
