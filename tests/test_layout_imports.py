"""Data flows one way: a stage package imports only the stages before it.

The order is the pipeline's: scenario -> capture (the trace format every later stage reads)
-> run (plan, launch) -> backends (what a rank runs) -> compare -> report; then the session
that chains them, the tools built on it, the pytest plugins and the command line; last the
public API, ``gtp_parity``, a facade over the stages that nothing of the harness imports. Every
import statement counts, inside functions too (:func:`tests.test_imports.imports_of`), so a
call from an earlier stage into a later one can only be a callback it was handed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from test_imports import ROOT, import_graph

# One row per level; the packages of a row are peers that may not import each other.
STAGES: list[tuple[str, ...]] = [
    ("harness.common", "harness.quant"),  # shared vocabulary; FP8/FP4 emulation
    ("harness.scenario",),
    ("harness.capture",),
    ("harness.run",),
    ("harness.backends",),
    ("harness.compare",),
    ("harness.report",),
    ("harness.session",),
    ("harness.conformance", "harness.mutation", "harness.codecheck", "harness.fuzz"),  # tools on the pipeline
    ("harness.pytest_plugin",),
    ("harness.cli",),
    ("harness.__main__",),
    ("gtp_parity",),  # the public API: re-exports capture, common, scenario and compare
]
PACKAGES = (ROOT / "harness", ROOT / "gtp_parity")


def stage_of(module: str, stages=STAGES) -> tuple[int, str] | None:
    """(level, package) of a module, or None for the root package ``harness`` itself."""
    for level, row in enumerate(stages):
        for pkg in row:
            if module == pkg or module.startswith(pkg + "."):
                return level, pkg
    return None


def violations(graph: dict[str, set[str]], stages=STAGES) -> list[str]:
    """Every import from a stage to a later stage or a peer, as 'a (stage) imports b (stage)'."""
    out = []
    for module, imported in sorted(graph.items()):
        here = stage_of(module, stages)
        for other in sorted(imported):
            there = stage_of(other, stages)
            if here is None or there is None or there[1] == here[1]:
                continue
            if there[0] >= here[0]:
                kind = "a peer" if there[0] == here[0] else "a later stage"
                out.append(f"{module} ({here[1]}) imports {other}, {kind} ({there[1]})")
    return out


def test_every_module_belongs_to_a_stage():
    graph = import_graph(*PACKAGES)
    homeless = [m for m in graph if m != "harness" and stage_of(m) is None]
    assert not homeless, f"modules in no stage of STAGES (add them to a stage package): {homeless}"


def test_no_import_runs_to_a_later_stage():
    graph = import_graph(*PACKAGES)
    assert "harness.run.provenance" in graph["harness.compare.outcome"]  # the walk sees cross-stage edges
    assert "harness.capture.api" in graph["gtp_parity"]  # and the facade's edges into the harness
    bad = violations(graph)
    assert not bad, "imports against the stage order:\n  " + "\n  ".join(bad)


def test_a_backward_import_is_reported(tmp_path: Path):
    pkg = tmp_path / "pkg"
    for sub in ("early", "late"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "late" / "b.py").write_text("from pkg.early import a\n")
    (pkg / "early" / "a.py").write_text("def f():\n    from pkg.late import b\n")
    stages = [("pkg.early",), ("pkg.late",)]
    assert violations(import_graph(pkg),
                      stages) == ["pkg.early.a (pkg.early) imports pkg.late.b, a later stage (pkg.late)"]
    (pkg / "early" / "a.py").write_text("x = 1\n")
    assert violations(import_graph(pkg), stages) == []


@pytest.mark.parametrize("package", [p for row in STAGES for p in row if not p.endswith("__main__")])
def test_each_stage_package_exists(package):
    path = ROOT / Path(*package.split("."))
    assert (path.is_dir()
            or path.with_suffix(".py").is_file()), f"{package}: listed in STAGES but not in harness/"
