"""What the resolved trees must hold before anything launches: each imports in the workers'
environment, and a bridge side's Bridge tree has what the side asks (GTP needs Bridge's GTP
wiring). A failure is bad input naming the side, with the import error's last line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from harness.common.errors import BadInput
from harness.run.trees import BRIDGE, CodeTree, installed_root
from harness.scenario import Scenario

# Each probe prints the files it imported, last line last.
_MCORE_PROBE = ("import megatron.core, megatron.core.tensor_parallel.generalized_tensor_parallelism; "
                "print(megatron.core.__file__)")
# Bridge's import with the bridge backend's import stand-ins (harness/backends/bridge/compat.py),
# as a rank imports it.
_BRIDGE_PROBE = ("from harness.backends.bridge import compat; b = compat.import_bridge(); "
                 "import megatron.core as c; print(b.__file__); print(c.__file__)")


def _probe(code: str, env: dict[str, str], where: str, what: str) -> list[str]:
    """The probe's printed lines, run in a fresh interpreter with ``env``; bad input quoting
    the import error's last line where it fails."""
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise BadInput(where, f"{what} does not import: {last}")
    return done.stdout.strip().splitlines()


def check_imports(tree: CodeTree, where: str, env: dict[str, str]) -> None:
    """Import the tree's megatron-core and GTP in a fresh interpreter with the workers'
    environment, from the tree's own folder."""
    found = Path(_probe(_MCORE_PROBE, env, where, repr(tree.spec))[-1]).resolve()
    if tree.root and Path(tree.root).resolve() not in found.parents:
        raise BadInput(where, f"{tree.spec!r}: the workers imported megatron-core from {found}, "
                              f"not from {tree.root}")


def check_all_import(trees: dict[str, CodeTree], scenarios: list[Scenario], env_of) -> None:
    """Every megatron-core tree other than the installed one imports (``env_of(root)``: the
    workers' environment with the tree's root on its path)."""
    for spec, tree in trees.items():
        if tree.kind != "installed":
            sides = ((s, r) for s in scenarios for r, side in s.sides.items() if side.megatron_core == spec)
            where = next((f"{s.source}: [{r}].megatron_core" for s, r in sides), f"megatron_core {spec!r}")
            check_imports(tree, where, env_of(tree.root))


def has_gtp(tree: CodeTree) -> bool:
    """Whether a Bridge tree wires GTP (the PR's ``megatron/bridge/training/gtp.py``)."""
    root = Path(tree.root) if tree.root else installed_root(BRIDGE)
    return root is not None and (root / "megatron" / "bridge" / "training" / "gtp.py").is_file()


def check_bridge_trees(scenarios: list[Scenario], bridges: dict[str, CodeTree]) -> None:
    """Each bridge side's Bridge tree (spec -> tree) supports what the side asks: GTP > 1 needs a
    tree with Bridge's GTP wiring (no released Bridge has it)."""
    for s in scenarios:
        for role, side in s.sides.items():
            if side.backend != "bridge" or (side.gtp == 1 and side.expert_gtp == 1):
                continue
            if not has_gtp(tree := bridges[side.bridge]):
                raise BadInput(f"{s.source}: [{role}].gtp",
                               f"Megatron-Bridge {tree.version} ({side.bridge}) has no GTP wiring "
                               "(megatron/bridge/training/gtp.py): run GTP on a tree that has it, such as "
                               "the GTP wiring PR's head, or gtp = 1")


def check_bridge_imports(scenarios: list[Scenario], trees: dict[str, CodeTree], bridges: dict[str, CodeTree],
                         env_of) -> None:
    """Each bridge side's Bridge tree other than the installed one imports over the side's
    megatron-core (``trees``), in a fresh interpreter with the workers' environment
    (``env_of(root)``, the side's PYTHONPATH entries)."""
    seen = set()
    for s in scenarios:
        for role, side in s.sides.items():
            if side.backend != "bridge" or bridges[side.bridge].kind == "installed":
                continue
            bridge = bridges[side.bridge]
            root = os.pathsep.join(filter(None, [trees[side.megatron_core].root, bridge.root]))
            if root in seen:
                continue
            seen.add(root)
            where = f"{s.source}: [{role}].bridge"
            what = f"{side.bridge!r} over megatron-core {side.megatron_core!r}"
            found = Path(_probe(_BRIDGE_PROBE, env_of(root), where, what)[-2]).resolve()
            if Path(bridge.root).resolve() not in found.parents:
                raise BadInput(where, f"the workers imported Megatron-Bridge from {found}")
