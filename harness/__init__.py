"""gtp-parity's implementation. A script of one's own imports the public API from ``gtp_parity``,
which holds still; the modules here move. An import of a module that moved fails naming where
it went (:data:`MOVED`)."""

import sys
from importlib.abc import MetaPathFinder

# Modules of the public API's past homes -> where they live now (the names stay in gtp_parity).
MOVED = {
    "harness.layout": "harness.common.layout",
    "harness.mesh": "harness.common.mesh",
    "harness.errors": "harness.common.errors",
    "harness.trace": "harness.capture.trace",
    "harness.fingerprint": "harness.capture.fingerprint",
    "harness.assemble": "harness.compare.assemble",
}


def moved_message(old: str) -> str:
    return (f"No module named {old!r}: it moved to {MOVED[old]}. Import the public API from gtp_parity "
            f"instead (e.g. `from gtp_parity import Capture, Layout, from_mcore_param, compare`), whose "
            f"names hold still: see docs/capture-api.md")


class _Moved(MetaPathFinder):
    """Last on the import path: asked only once no module of that name was found."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED:
            raise ModuleNotFoundError(moved_message(fullname), name=fullname)
        return None


def __getattr__(name: str):
    """``from harness import layout``: the statement reads the attribute once the import of the
    submodule failed, and would say only "cannot import name"."""
    if f"harness.{name}" in MOVED:
        raise ModuleNotFoundError(moved_message(f"harness.{name}"), name=f"harness.{name}")
    raise AttributeError(f"module 'harness' has no attribute {name!r}")


if not any(isinstance(f, _Moved) for f in sys.meta_path):
    sys.meta_path.append(_Moved())
