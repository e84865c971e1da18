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
:class:`harness.pytest_plugin.ranks.RankAgreement` makes a failure on any rank fail the test on every rank;
only rank 0 launches scenarios and writes reports, and it sends each run summary to the other ranks.

This module registers options, markers, fixtures and hooks; :mod:`harness.pytest_plugin.runs` runs
scenarios, :mod:`harness.pytest_plugin.matrix` collects matrix files, :mod:`harness.pytest_plugin.ranks`
(imported only under torchrun) makes the ranks agree.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness.pytest_plugin.matrix import MatrixFile
from harness.pytest_plugin.runs import STATE, ParityFixture, ParityState

OPTIONS = {
    "parity_report": ("DIR", "write the HTML report of every parity run under DIR (index: DIR/index.html)"),
    "parity_matrix": ("FILE", "collect each scenario of this matrix TOML file as a test item"),
    "parity_dist_timeout": ("SECONDS", "under torchrun: seconds the ranks wait for each other to agree on "
                                       "a test outcome before failing it (default 300)"),
}
MARKER_KWARGS = ("inject", "inject_side", "expect", "signature")
_FIXTURE = pytest.StashKey[ParityFixture]()


def pytest_addoption(parser):
    group = parser.getgroup("gtp-parity", "tensor-level parity scenarios")
    for name, (metavar, help_text) in OPTIONS.items():
        group.addoption(
            "--" + name.replace("_", "-"), dest=name, metavar=metavar, default=None, help=help_text
        )
        parser.addini(name, help_text, default=None)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    config.addinivalue_line("markers", "parity(path, inject=None, inject_side='candidate', expect='pass', "
                            "signature=None): run a gtp-parity scenario, expect its verdict")
    config.addinivalue_line("markers", "parity_matrix: a scenario collected from --parity-matrix")
    _register_conformance(config.pluginmanager)
    state = ParityState(config)
    config.stash[STATE] = state
    if state.matrix is not None:
        args = [Path(config.invocation_params.dir, a.split("::")[0]).resolve() for a in config.args]
        if config.args_source != pytest.Config.ArgsSource.ARGS:
            config.args[:] = [str(state.matrix)]
        elif not any(a == state.matrix or a in state.matrix.parents for a in args):
            config.args.append(str(state.matrix))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and "RANK" in os.environ and not state.worker and not config.getoption("numprocesses", None):
        from harness.pytest_plugin.ranks import RankAgreement  # torch: only under torchrun

        state.agreement = RankAgreement.start(int(os.environ["RANK"]), world, state.timeout_s)
        config.pluginmanager.register(state.agreement, "gtp_parity_rank_agreement")
        if state.rank != 0 and getattr(config.option, "xmlpath", None):
            config.option.xmlpath = None  # one JUnit file: rank 0 writes it


def _register_conformance(pm) -> None:
    """The conformance kit's plugin, unless already loaded (its own entry point, or -p)."""
    import harness.pytest_plugin.conformance as kit

    if not pm.is_registered(kit) and not pm.is_blocked("gtp_parity_conformance"):
        pm.register(kit, "gtp_parity_conformance")


def pytest_sessionfinish(session):
    state = session.config.stash.get(STATE, None)
    if state and state.report and not state.worker and state.rank == 0 and state.report.is_dir():
        from harness.report.index import write_combined_index

        write_combined_index(state.report, "gtp-parity pytest session", since=state.started)


@pytest.fixture
def parity(request, tmp_path_factory) -> ParityFixture:
    """Run a gtp-parity scenario or matrix: ``parity(path, inject=None) -> run summary``."""
    return ParityFixture(request, tmp_path_factory)


@pytest.fixture(autouse=True)
def _parity_marker(request):
    if isinstance(request.node, pytest.Function) and request.node.get_closest_marker("parity"):
        request.node.stash[_FIXTURE] = request.getfixturevalue("parity")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    if (marker := item.get_closest_marker("parity")) is None or _FIXTURE not in item.stash:
        return
    expect = marker.kwargs.get("expect", "pass")
    if not marker.args or expect not in ("pass", "fail") or set(marker.kwargs) - set(MARKER_KWARGS):
        pytest.fail("@pytest.mark.parity(path, inject=None, expect='pass'|'fail', signature=None): "
                    f"got args {marker.args} kwargs {marker.kwargs}", pytrace=False)
    from harness.report.model import expectation_failures

    summary = item.stash[_FIXTURE]()
    if problems := expectation_failures(summary, expect, marker.kwargs.get("signature")):
        pytest.fail("\n".join(problems), pytrace=False)


def pytest_collect_file(file_path, parent):
    state = parent.config.stash.get(STATE, None)
    if state is not None and state.matrix is not None and Path(file_path).resolve() == state.matrix:
        return MatrixFile.from_parent(parent, path=Path(file_path))
