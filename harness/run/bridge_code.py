"""The Megatron-Bridge a ``bridge`` side imports: the installed one, a checkout, or a git revision.

A side's ``bridge`` key names it as ``megatron_core`` names megatron-core's tree
(:mod:`harness.run.code`):

- ``"installed"``: the venv's ``megatron-bridge`` (the ``bridge`` extra);
- a folder: a Megatron-Bridge checkout (holding ``src/megatron/bridge``), or any folder
  holding ``megatron/bridge``;
- ``"git:<repo folder>@<rev>"``: that revision's ``src/megatron/bridge``, extracted once,
  read-only, into the tree cache keyed by the full commit id (``bridge-<commit>``).

The resolved tree's root (the folder holding ``megatron/bridge``) goes on the workers'
PYTHONPATH after megatron-core's: ``megatron`` is a namespace package in both, so
``megatron.core`` comes from the side's megatron-core and ``megatron.bridge`` from this tree.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from importlib.machinery import PathFinder
from pathlib import Path

from harness.common.errors import BadInput
from harness.run.code import (GIT_PREFIX, INSTALLED, CodeTree, cache_root, checkout_state, extract_once,
                              git_revision)  # fmt: skip
from harness.scenario import Scenario

SRC = "src/megatron/bridge"


def read_version(root: Path) -> str:
    """``MAJOR.MINOR.PATCH[PRE_RELEASE]`` from ``root/megatron/bridge/package_info.py`` (as text)."""
    text = (root / "megatron" / "bridge" / "package_info.py").read_text()
    found = {k: re.search(rf"^{k}\s*=\s*['\"]?([^'\"\s#]*)", text, re.M) for k in ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE")}
    parts = {k: m.group(1) if m else "" for k, m in found.items()}
    if not all(parts[k] for k in ("MAJOR", "MINOR", "PATCH")):
        return "unknown"
    return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}{parts['PRE_RELEASE']}"


def installed_root() -> Path | None:
    site = [p for p in sys.path if p and "site-packages" in p]
    spec = PathFinder.find_spec("megatron", site)
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(location) / "bridge" / "__init__.py").is_file():
            return Path(location).parent
    return None


def has_gtp(tree: CodeTree) -> bool:
    """Whether the tree wires GTP (the PR's ``megatron/bridge/training/gtp.py``)."""
    root = Path(tree.root) if tree.root else installed_root()
    return root is not None and (root / "megatron" / "bridge" / "training" / "gtp.py").is_file()


def materialize(repo: Path, commit: str, where: str) -> Path:
    """The commit's ``src/megatron/bridge`` as ``<cache>/bridge-<commit>/megatron/bridge``, read-only."""

    def arrange(tmp: Path) -> None:  # src/megatron/bridge -> megatron/bridge
        if (tmp / SRC).is_dir():
            (tmp / "megatron").mkdir()
            (tmp / SRC).rename(tmp / "megatron" / "bridge")
            shutil.rmtree(tmp / "src")

    return extract_once(repo, commit, SRC, cache_root() / f"bridge-{commit}", "megatron/bridge", where, arrange)


def resolve(spec: str, where: str) -> CodeTree:
    """The Megatron-Bridge tree ``spec`` names; ``where`` names the side in errors."""
    if spec == INSTALLED:
        root = installed_root()
        if root is None:
            raise BadInput(where, "no megatron-bridge is installed in this environment: install the `bridge` "
                                  "extra (scripts/setup.sh --bridge) or name a tree")  # fmt: skip
        return CodeTree(spec, "installed", "", read_version(root))
    if spec.startswith(GIT_PREFIX):
        repo, commit = git_revision(spec, where, SRC)
        root = materialize(repo, commit, where)
        return CodeTree(spec, "git", str(root), read_version(root), commit=commit, repo=str(repo))
    path = Path(spec).expanduser().resolve()
    if (path / SRC / "__init__.py").is_file():
        checkout, path = path, path / "src"
    else:
        checkout = path
    if not (path / "megatron" / "bridge" / "__init__.py").is_file():
        raise BadInput(where, f"{spec!r}: no megatron/bridge package under {path} "
                              f"(give 'installed', a Megatron-Bridge checkout, or git:<repo>@<rev>)")  # fmt: skip
    # A Bridge checkout's package is under src/: that is the folder whose changes make it dirty.
    commit, dirty = checkout_state(checkout, SRC if checkout != path else "megatron/bridge")
    return CodeTree(spec, "path", str(path), read_version(path), commit=commit, repo=str(checkout) if commit else "",
                    dirty=dirty)  # fmt: skip


def resolve_all(scenarios) -> dict[str, CodeTree]:
    """Spec -> tree for every bridge side's ``bridge`` key."""
    trees: dict[str, CodeTree] = {}
    for s in scenarios:
        for role, side in s.sides.items():
            if side.backend == "bridge" and side.bridge not in trees:
                trees[side.bridge] = resolve(side.bridge, f"{s.source}: [{role}].bridge")
    return trees


def check_trees(scenarios: list[Scenario], trees: dict) -> None:
    """Each bridge side's tree (spec -> :class:`~harness.run.code.CodeTree`) supports what the
    side asks: GTP > 1 needs a tree with Bridge's GTP wiring (no released Bridge has it)."""
    for s in scenarios:
        for role, side in s.sides.items():
            if side.backend == "bridge" and (side.gtp > 1 or side.expert_gtp > 1) and not has_gtp(trees[side.bridge]):
                tree = trees[side.bridge]
                raise BadInput(f"{s.source}: [{role}].gtp",
                               f"Megatron-Bridge {tree.version} ({side.bridge}) has no GTP wiring "
                               "(megatron/bridge/training/gtp.py): run GTP on a tree that has it, such as "
                               "the GTP wiring PR's head, or gtp = 1")  # fmt: skip


# Run in the workers' interpreter and environment: Bridge's import with the bridge backend's
# import stand-ins (harness/backends/bridge/compat.py), as a rank imports it.
_PROBE = ("from harness.backends.bridge import compat; b = compat.import_bridge(); import megatron.core as c; "
          "print(b.__file__); print(c.__file__)")  # fmt: skip


def check_imports(scenarios: list[Scenario], trees: dict, env_of) -> None:
    """Each bridge side's Megatron-Bridge other than the installed one imports over the side's
    megatron-core, in a fresh interpreter with the workers' environment (``env_of(root)``, the
    side's PYTHONPATH entries): bad input quoting the import error's last line otherwise."""
    from harness.run.code import resolve as resolve_mcore

    seen = set()
    for s in scenarios:
        for role, side in s.sides.items():
            if side.backend != "bridge" or trees[side.bridge].kind == "installed":
                continue
            mcore = resolve_mcore(side.megatron_core, f"{s.source}: [{role}].megatron_core").root
            root = os.pathsep.join(filter(None, [mcore, trees[side.bridge].root]))
            if root in seen:
                continue
            seen.add(root)
            done = subprocess.run([sys.executable, "-c", _PROBE], env=env_of(root), capture_output=True, text=True)
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
                raise BadInput(f"{s.source}: [{role}].bridge", f"{side.bridge!r} does not import over "
                                                               f"megatron-core {side.megatron_core!r}: {last}")  # fmt: skip
            found = Path(done.stdout.strip().splitlines()[-2]).resolve()
            if Path(trees[side.bridge].root).resolve() not in found.parents:
                raise BadInput(f"{s.source}: [{role}].bridge", f"the workers imported Megatron-Bridge from {found}")
