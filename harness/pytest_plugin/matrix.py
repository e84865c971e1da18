"""``--parity-matrix FILE``: each scenario of a matrix file collected as a test item."""

from __future__ import annotations

import pytest

from harness.compare.summary import Verdict
from harness.pytest_plugin.runs import STATE, ParityState, safe_name, execute, load_scenarios


class MatrixFile(pytest.File):
    def collect(self):
        for s in load_scenarios(self.path):
            item = ScenarioCase.from_parent(self, name=s.name, callobj=_run_matrix_scenario)
            item.add_marker("parity_matrix")
            yield item


class ScenarioCase(pytest.Function):
    """One scenario of the matrix; reported at the matrix file."""

    def reportinfo(self):
        return self.path, None, self.name


def _run_matrix_scenario(request, tmp_path_factory):
    from harness.report.model import divergence_line, expectation_failures

    state: ParityState = request.config.stash[STATE]
    item = request.node
    if item.name not in state.matrix_runs:
        scenarios = {s.name: s for s in load_scenarios(item.path)}
        # One run shares launches between the scenarios this process will run; an xdist worker
        # runs only its own (the others may go to other workers).
        mine = [i.name for i in item.session.items if isinstance(i, ScenarioCase) and i.path == item.path]
        wanted = [item.name] if state.worker else mine
        todo = [scenarios[n] for n in wanted if n not in state.matrix_runs]
        out = tmp_path_factory.mktemp("parity-matrix", numbered=True)
        report = "matrix-" + safe_name(item.path.stem) + (f"-{safe_name(item.name)}" if state.worker else "")
        summary = execute(state, todo, out, report, parallel=1 if state.worker else 2)
        for s in summary["scenarios"]:
            state.matrix_runs[s["scenario"]] = s
    doc = state.matrix_runs[item.name]
    if doc.get("verdict") == Verdict.KNOWN_DIVERGENCE:  # diverged exactly as recorded: an expected failure
        pytest.xfail(divergence_line(doc))
    if doc.get("verdict") == Verdict.SKIP:
        pytest.skip(doc.get("reason") or "skipped")
    if problems := expectation_failures({"scenarios": [doc]}):
        pytest.fail("\n".join(problems), pytrace=False)
