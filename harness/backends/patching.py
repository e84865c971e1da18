"""Run-time patches of library attributes, undone together when a side finishes.

One stack for the whole worker process: planted faults and the megatron backend's capture
hooks both wrap megatron-core functions in place (installed files are never edited), and
:func:`undo_all` puts every attribute back, newest first.
"""

from __future__ import annotations

from typing import Any, Callable

_UNDO: list[Callable[[], None]] = []


def patch(obj: Any, attr: str, value: Any) -> Any:
    """Set ``obj.attr = value`` until :func:`undo_all`; returns the attribute replaced."""
    # A class's own attribute is kept as stored (a classmethod or staticmethod descriptor, not
    # the function it binds to), so the undo puts back exactly what was there.
    old = vars(obj)[attr] if isinstance(obj, type) and attr in vars(obj) else getattr(obj, attr)
    setattr(obj, attr, value)
    _UNDO.append(lambda: setattr(obj, attr, old))
    return old


def on_undo(undo: Callable[[], None]) -> None:
    """Run ``undo`` with the patches' undo (a hook handle's ``remove``, say), in stack order."""
    _UNDO.append(undo)


def undo_all() -> None:
    while _UNDO:
        _UNDO.pop()()
