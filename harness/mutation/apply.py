"""Apply a mutant in a worker process, at run time: installed files are never edited.

The mutated module source is compiled from the installed file with the one span replaced,
and the mutated function's code object takes the place of the clean one's (``__code__``),
through :mod:`harness.patching`, so :func:`harness.patching.undo_all` restores it when the side
ends. Every reference to the function (``from x import f`` copies, bound methods, the class
attribute) sees the mutant, and the next side of the same launch runs clean code or its own
mutant: many mutants share one launch.
"""

from __future__ import annotations

import importlib
import inspect

from harness.mutation.generate import Mutant, find, function_code, mutated_source
from harness.patching import patch


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
    raise LookupError(f"{module.__name__}.{qualname} is not a plain function: a mutant cannot replace its code")


def apply(mutant: Mutant | str) -> Mutant:
    """Install ``mutant`` (or the mutant of that id) in this process until ``undo_all``."""
    m = find(mutant) if isinstance(mutant, str) else mutant
    module = importlib.import_module(m.module)
    code = function_code(compile(mutated_source(m), m.file, "exec"), m.function)
    if code is None:
        raise LookupError(f"mutant {m.id}: {m.function} not found in the mutated source")
    patch(_function(module, m.function), "__code__", code)
    return m
