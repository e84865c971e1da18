"""Apply a mutant in a worker process, at run time: installed files are never edited.

The mutated module source is compiled from the installed file with the one span replaced,
and the mutated function's code object takes the place of the clean one's (``__code__``),
through :mod:`harness.backends.patching`, so :func:`harness.backends.patching.undo_all` restores it when the
side ends. Every reference to the function (``from x import f`` copies, bound methods, the class
attribute) sees the mutant, and the next side of the same launch runs clean code or its own
mutant: many mutants share one launch.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from pathlib import Path

from harness.scenario.mutants import Mutant, find, function_code, mutated_source
from harness.backends.patching import patch
from harness.common.jsonio import write_json


def _function(module, qualname: str):
    """The function object whose code is ``qualname`` (unwrapping static/class methods,
    properties and decorators)."""
    obj = module
    for part in qualname.split("."):
        holder = obj
        obj = inspect.getattr_static(holder, part)
    for _ in range(16):
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        elif isinstance(obj, property):
            obj = obj.fget
        elif getattr(getattr(obj, "__code__", None), "co_qualname", None) == qualname:
            return obj
        elif hasattr(obj, "__wrapped__"):
            obj = obj.__wrapped__
        else:
            break
    raise LookupError(f"{module.__name__}.{qualname} is not a plain function: a mutant cannot replace its "
                      f"code")


class Reach:
    """Whether the mutated lines ran: Python's low-overhead monitoring (PEP 669) of LINE
    events on the mutated function's code alone. A survivor whose lines never ran is
    unreachable by the matrix, not missed by the checks."""

    TOOL = sys.monitoring.COVERAGE_ID
    FILE = "mutant.json"

    def __init__(self, m: Mutant, code):
        self.mutant, self.reached = m, False
        # The mutated span's lines in the mutated code (a multi-line span replaced by one
        # line shifts the lines after it).
        self.lines = (m.line, m.line + m.replacement.count("\n"))
        mon = sys.monitoring
        if mon.get_tool(self.TOOL) is not None:
            self.active = False  # another coverage tool holds the id: reachability unknown
            self.reached = None
            return
        self.active = True
        mon.use_tool_id(self.TOOL, "gtp-parity mutate")
        mon.register_callback(self.TOOL, mon.events.LINE, self._line)
        for c in _codes(code):
            mon.set_local_events(self.TOOL, c, mon.events.LINE)

    def _line(self, code, line):
        if self.lines[0] <= line <= self.lines[1]:
            self.reached = True
        return sys.monitoring.DISABLE  # each location once: the rest of the run costs nothing

    def close(self, path: Path | None = None) -> None:
        if self.active:
            sys.monitoring.register_callback(self.TOOL, sys.monitoring.events.LINE, None)
            sys.monitoring.free_tool_id(self.TOOL)
            self.active = False
        if path is not None:
            write_json(path, {"mutant": self.mutant.id, "reached": self.reached})


class Lines:
    """The lines of ``modules`` a clean side ran (PEP 669 LINE events, each location once).

    Runs are deterministic, so a mutant whose span holds none of these lines cannot make that
    side compute anything else: the mutation campaign skips it there (``mutation.campaign``)."""

    TOOL, FILE = Reach.TOOL, "lines.json"

    def __init__(self, modules: tuple[str, ...]):
        self.seen: dict[str, set[int]] | None = None
        mon = sys.monitoring
        if mon.get_tool(self.TOOL) is not None:  # another coverage tool holds the id: unknown
            self.active = False
            return
        self.files: dict[str, str] = {}
        for name in modules:
            path = importlib.import_module(name).__file__
            self.files[path] = self.files[os.path.realpath(path)] = name
        self.seen, self.active = {name: set() for name in modules}, True
        mon.use_tool_id(self.TOOL, "gtp-parity mutate lines")
        mon.register_callback(self.TOOL, mon.events.LINE, self._line)
        mon.set_events(self.TOOL, mon.events.LINE)

    def _line(self, code, line):
        if (name := self.files.get(code.co_filename)) is not None:
            self.seen[name].add(line)
        return sys.monitoring.DISABLE

    def close(self, path: Path) -> None:
        if self.active:
            mon = sys.monitoring
            mon.set_events(self.TOOL, mon.events.NO_EVENTS)
            mon.register_callback(self.TOOL, mon.events.LINE, None)
            mon.free_tool_id(self.TOOL)
            self.active = False
            mon.restart_events()  # the locations disabled above fire again for the next tool
        lines = None if self.seen is None else {k: sorted(v) for k, v in self.seen.items()}
        write_json(path, {"lines": lines})


def _codes(code):
    yield code
    for c in code.co_consts:
        if hasattr(c, "co_code"):
            yield from _codes(c)


def apply(mutant: Mutant | str, watch: bool = False):
    """Install ``mutant`` (or the mutant of that id) in this process until ``undo_all``.
    Returns the mutant, or with ``watch`` a :class:`Reach` telling whether its lines ran."""
    m = find(mutant) if isinstance(mutant, str) else mutant
    module = importlib.import_module(m.module)
    code = function_code(compile(mutated_source(m), m.file, "exec"), m.function)
    if code is None:
        raise LookupError(f"mutant {m.id}: {m.function} not found in the mutated source")
    patch(_function(module, m.function), "__code__", code)
    return Reach(m, code) if watch else m


def watch(mutant: str, lines: tuple[str, ...]) -> Reach | Lines:
    """A mutation campaign's side: a mutant side installs its mutant and records whether its lines
    ran; a clean side records which lines of ``lines`` ran. Either is closed into the rank's
    folder (``.close(rank_dir / .FILE)``)."""
    return apply(mutant, watch=True) if mutant else Lines(lines)
