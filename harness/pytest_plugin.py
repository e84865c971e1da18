"""pytest plugin ``gtp_parity``: parity scenarios as tests.

- ``@pytest.mark.parity("scenario.toml", inject=[...], expect="pass", signature=None)``:
  run the scenario (or matrix) before the test body; the test fails with the first divergence
  unless every scenario's verdict is ``expect`` (and, for ``expect="fail"``, the signature).
- fixture ``parity``: ``parity(path=None, inject=None, inject_side="candidate") -> dict`` runs
  a scenario or matrix file into the test's own folder and returns the run summary (``scenarios``,
  ``verdict``, ``run_dir``); without a path, the marker's run.
- ``--parity-report DIR``: also write each run's HTML report under ``DIR/<test id>/``, indexed
  at ``DIR/index.html``.
- ``--parity-matrix FILE``: collect each scenario of a matrix file as a test item that fails
  with the first divergence (alone when no test path is given).

Under torchrun (``torchrun --nproc-per-node=N -m pytest``) every rank runs every test, and
:class:`RankAgreement` makes a failure on any rank fail the test on every rank; only rank 0
launches scenarios and writes reports, and it sends each run summary to the other ranks.
"""

from __future__ import annotations

import json
import os
import re
import time
import zlib
from datetime import timedelta
from pathlib import Path

import pytest

OPTIONS = {
    "parity_report": ("DIR", "write the HTML report of every parity run under DIR (index: DIR/index.html)"),
    "parity_matrix": ("FILE", "collect each scenario of this matrix TOML file as a test item"),
    "parity_dist_timeout": ("SECONDS", "under torchrun: seconds the ranks wait for each other to agree on "
                                       "a test outcome before failing it (default 300)"),
}  # fmt: skip
MARKER_KWARGS = ("inject", "inject_side", "expect", "signature")
_STATE = pytest.StashKey["ParityState"]()
_RUNNER = pytest.StashKey["ParityRunner"]()


def pytest_addoption(parser):
    group = parser.getgroup("gtp-parity", "tensor-level parity scenarios")
    for name, (metavar, help_text) in OPTIONS.items():
        group.addoption(
            "--" + name.replace("_", "-"), dest=name, metavar=metavar, default=None, help=help_text
        )
        parser.addini(name, help_text, default=None)


def option(config, name: str) -> tuple[str | None, str, Path]:
    """(value, where it came from, the folder a relative path is relative to)."""
    value = config.getoption(name)
    if value is not None:
        return value, "--" + name.replace("_", "-"), Path(config.invocation_params.dir)
    value = config.getini(name)
    where = f"ini option {name} in {config.inipath}"
    return (value or None), where, Path(config.inipath).parent if config.inipath else Path(config.rootpath)


class ParityState:
    """Per-session settings and caches."""

    def __init__(self, config):
        report, _, base = option(config, "parity_report")
        self.report = (base / report).resolve() if report else None
        self.matrix = None
        matrix, where, base = option(config, "parity_matrix")
        if matrix:
            self.matrix = (base / matrix).resolve()
            if not self.matrix.is_file():
                raise pytest.UsageError(f"{where}: {matrix}: no such file (looked at {self.matrix})")
        raw, where, _ = option(config, "parity_dist_timeout")
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


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    config.addinivalue_line("markers", "parity(path, inject=None, inject_side='candidate', expect='pass', "
                            "signature=None): run a gtp-parity scenario, expect its verdict")  # fmt: skip
    config.addinivalue_line("markers", "parity_matrix: a scenario collected from --parity-matrix")
    _register_conformance(config.pluginmanager)
    state = ParityState(config)
    config.stash[_STATE] = state
    if state.matrix is not None:
        args = [Path(config.invocation_params.dir, a.split("::")[0]).resolve() for a in config.args]
        if config.args_source != pytest.Config.ArgsSource.ARGS:
            config.args[:] = [str(state.matrix)]
        elif not any(a == state.matrix or a in state.matrix.parents for a in args):
            config.args.append(str(state.matrix))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and "RANK" in os.environ and not state.worker and not config.getoption("numprocesses", None):
        state.agreement = RankAgreement.start(int(os.environ["RANK"]), world, state.timeout_s)
        config.pluginmanager.register(state.agreement, "gtp_parity_rank_agreement")
        if state.rank != 0 and getattr(config.option, "xmlpath", None):
            config.option.xmlpath = None  # one JUnit file: rank 0 writes it


def _register_conformance(pm) -> None:
    """The conformance kit's plugin, unless already loaded (its own entry point, or -p)."""
    if (Path(__file__).parent / "conformance" / "pytest_plugin.py").exists():
        import harness.conformance.pytest_plugin as kit

        if not pm.is_registered(kit) and not pm.is_blocked("gtp_parity_conformance"):
            pm.register(kit, "gtp_parity_conformance")


def pytest_sessionfinish(session):
    state = session.config.stash.get(_STATE, None)
    if state and state.report and not state.worker and state.rank == 0 and state.report.is_dir():
        from harness.report.index import write_combined_index

        write_combined_index(state.report, "gtp-parity pytest session", since=state.started)


# --- running scenarios --------------------------------------------------------------------


def load_scenarios(path: Path, inject=None, inject_side: str = "candidate") -> list:
    """Scenarios of a file, with faults planted as ``gtp-parity run --inject`` plants them."""
    import dataclasses

    from harness import scenario
    from harness.errors import BadInput
    from harness.faults import check_name

    scenarios = scenario.load(path)
    if not inject:
        return scenarios
    if inject_side not in ("reference", "candidate"):
        raise BadInput("inject_side", f"{inject_side!r}: reference or candidate")
    for name in inject:
        if (problem := check_name(name)) is not None:
            raise BadInput("inject", problem)
    planted = {s.name: dataclasses.replace(s.sides[inject_side], inject=tuple(inject)) for s in scenarios}
    return [dataclasses.replace(s, **{inject_side: planted[s.name]}) for s in scenarios]


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")[:120] or "test"


def execute(state: ParityState, scenarios: list, out: Path, report_name: str, parallel: int = 1) -> dict:
    """Run scenarios (rank 0 only under torchrun: the others receive its summary)."""

    def produce() -> dict:
        from harness import session

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


class ParityRunner:
    """The ``parity`` fixture: runs scenario files into this test's own folders."""

    def __init__(self, request, tmp_path_factory):
        self.node, self.factory = request.node, tmp_path_factory
        self.state: ParityState = request.config.stash[_STATE]
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
                                                    if k in ("inject", "inject_side")})  # fmt: skip
            return self.marked
        scenarios = load_scenarios(self.resolve(path), inject, inject_side)
        name = _safe(self.node.nodeid) + (f"-{self.calls}" if self.calls else "")
        self.calls += 1
        out = self.factory.mktemp(f"parity-{_safe(self.node.name)[:40]}", numbered=True)
        return execute(self.state, scenarios, out, name)


@pytest.fixture
def parity(request, tmp_path_factory) -> ParityRunner:
    """Run a gtp-parity scenario or matrix: ``parity(path, inject=None) -> run summary``."""
    return ParityRunner(request, tmp_path_factory)


@pytest.fixture(autouse=True)
def _parity_marker(request):
    if isinstance(request.node, pytest.Function) and request.node.get_closest_marker("parity"):
        request.node.stash[_RUNNER] = request.getfixturevalue("parity")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    if (marker := item.get_closest_marker("parity")) is None or _RUNNER not in item.stash:
        return
    expect = marker.kwargs.get("expect", "pass")
    if not marker.args or expect not in ("pass", "fail") or set(marker.kwargs) - set(MARKER_KWARGS):
        pytest.fail("@pytest.mark.parity(path, inject=None, expect='pass'|'fail', signature=None): "
                    f"got args {marker.args} kwargs {marker.kwargs}", pytrace=False)  # fmt: skip
    from harness.report.model import expectation_failures

    summary = item.stash[_RUNNER]()
    if problems := expectation_failures(summary, expect, marker.kwargs.get("signature")):
        pytest.fail("\n".join(problems), pytrace=False)


# --- --parity-matrix -------------------------------------------------------------------------


def pytest_collect_file(file_path, parent):
    state = parent.config.stash.get(_STATE, None)
    if state is not None and state.matrix is not None and Path(file_path).resolve() == state.matrix:
        return MatrixFile.from_parent(parent, path=Path(file_path))


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
    from harness.report.model import expectation_failures

    state: ParityState = request.config.stash[_STATE]
    item = request.node
    if item.name not in state.matrix_runs:
        scenarios = {s.name: s for s in load_scenarios(item.path)}
        # One run shares launches between the scenarios this process will run; an xdist worker
        # runs only its own (the others may go to other workers).
        mine = [i.name for i in item.session.items if isinstance(i, ScenarioCase) and i.path == item.path]
        wanted = [item.name] if state.worker else mine
        todo = [scenarios[n] for n in wanted if n not in state.matrix_runs]
        out = tmp_path_factory.mktemp("parity-matrix", numbered=True)
        report = "matrix-" + _safe(item.path.stem) + (f"-{_safe(item.name)}" if state.worker else "")
        summary = execute(state, todo, out, report, parallel=1 if state.worker else 2)
        for s in summary["scenarios"]:
            state.matrix_runs[s["scenario"]] = s
    if problems := expectation_failures({"scenarios": [state.matrix_runs[item.name]]}):
        pytest.fail("\n".join(problems), pytrace=False)


# --- torchrun: every rank agrees on every outcome -------------------------------------------


class RankAgreement:
    """Registered only under torchrun: the ranks agree on each test phase's outcome.

    After every setup, call and teardown the ranks all-reduce their outcome over gloo. If they
    differ, each rank that did not fail reports the phase failed, naming the ranks that did, so
    all ranks go on to the same next phase. A rank that hangs or dies fails the waiting ranks'
    test after the timeout, and the ranks then stop waiting for each other.
    """

    def __init__(self, rank: int, world: int, timeout_s: float, owned: bool, group=None):
        self.rank, self.world, self.timeout_s, self.owned, self.group = rank, world, timeout_s, owned, group
        self.broken: str | None = None

    @staticmethod
    def start(rank: int, world: int, timeout_s: float) -> RankAgreement:
        import torch.distributed as dist

        owned = not dist.is_initialized()
        if owned:
            dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))  # whatever the default
        return RankAgreement(dist.get_rank(), dist.get_world_size(), timeout_s, owned, group)

    def _gather(self, mine: int) -> list[int]:
        """Every rank's value (each rank fills its own slot of a summed vector)."""
        import torch
        import torch.distributed as dist

        t = torch.zeros(self.world, dtype=torch.int64)
        t[self.rank] = mine
        dist.all_reduce(t, group=self.group)
        return t.tolist()

    @pytest.hookimpl(wrapper=True)
    def pytest_collection_modifyitems(self, items):
        result = yield
        if len(set(self._gather(zlib.crc32("\n".join(i.nodeid for i in items).encode())))) != 1:
            raise pytest.UsageError(f"the ranks collected different tests (rank {self.rank}: {len(items)} "
                                    "items); run the same pytest command on every rank")  # fmt: skip
        return result

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = yield
        if self.broken is None:
            self.agree(report)
        return report

    def agree(self, report) -> None:
        code = 2 if report.failed else 1 if report.skipped else 0
        try:
            codes = self._gather(code)
        except Exception as e:  # a rank hung past the timeout or died
            self.broken = f"{type(e).__name__}: {e}"
            report.outcome = "failed"
            report.longrepr = (f"rank {self.rank}: the other ranks did not report the {report.when} outcome "
                               f"within {self.timeout_s:g} s (a rank hung, crashed or ran other tests): "
                               f"{self.broken}")  # fmt: skip
            return
        if len(set(codes)) == 1:
            return
        failed = [r for r, c in enumerate(codes) if c == 2]
        skipped = [r for r, c in enumerate(codes) if c == 1]
        if report.failed:
            report.sections.append(("gtp-parity ranks", f"failed on ranks {failed} of {self.world}"))
            return
        if hasattr(report, "wasxfail"):
            del report.wasxfail
        report.outcome = "failed"
        here = "was skipped" if code == 1 else "passed"
        report.longrepr = (f"{report.when} failed on rank(s) {failed} of {self.world} (this is rank "
                           f"{self.rank}, where it {here}); see the failing rank's output" if failed else
                           f"{report.when} skipped on rank(s) {skipped} only (this is rank {self.rank}): "
                           "the ranks must take the same path")  # fmt: skip

    def from_rank0(self, produce, budget_s: float) -> dict:
        """Rank 0 calls ``produce``; every rank returns its result (JSON over gloo, no pickle)."""
        import torch
        import torch.distributed as dist

        if self.broken is not None:
            raise RuntimeError(f"the ranks lost contact earlier ({self.broken}); not running here")
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=budget_s))
        failure = None
        try:
            data = b""
            if self.rank == 0:
                try:
                    doc = {"ok": produce()}
                except Exception as e:
                    failure, doc = e, {"error": f"{type(e).__name__}: {e}"}
                data = json.dumps(doc).encode()
            size = torch.tensor([len(data)], dtype=torch.int64)
            dist.broadcast(size, src=0, group=group)
            buf = torch.frombuffer(bytearray(data or b" " * int(size)), dtype=torch.uint8)
            dist.broadcast(buf, src=0, group=group)
            doc = json.loads(bytes(buf.tolist()).decode())
        finally:
            dist.destroy_process_group(group)
        if failure is not None:
            raise failure
        if "error" in doc:
            raise RuntimeError(f"rank 0 failed to run the scenario: {doc['error']}")
        return doc["ok"]

    def pytest_unconfigure(self, config):
        """Leave together: torchrun stops every rank as soon as one exits with an error."""
        import torch.distributed as dist

        if self.broken is None:
            dist.barrier(group=self.group)
        if self.owned and dist.is_initialized():
            dist.destroy_process_group()
