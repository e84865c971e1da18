"""The megatron-core a side imports: the installed wheel, a checkout, or a git revision.

A side's ``megatron_core`` names its tree (:func:`resolve`):

- ``"installed"``: whatever ``import megatron`` finds in the venv (the pinned wheel);
- a folder: a Megatron-LM checkout, or any folder holding ``megatron/core``;
- ``"git:<repo folder>@<rev>"``: that revision's ``megatron/`` folder, materialized once,
  read-only, into a cache folder keyed by the full commit id (``git archive``, written to a
  temporary folder and renamed, so a half-written tree never exists).

The launcher puts the tree first on the workers' PYTHONPATH; nothing else about how a side
runs changes. Its version is read from *that tree's* ``megatron/core/package_info.py``, not
from the installed wheel's metadata. A spec that names no megatron-core, a revision git does
not know, a tree that does not import: bad input naming the side, before anything launches.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from importlib.machinery import PathFinder
from pathlib import Path

from harness.common.errors import BadInput
from harness.scenario.rules import version_key

INSTALLED = "installed"
GIT_PREFIX = "git:"


@dataclass(frozen=True)
class CodeTree:
    """A resolved megatron-core tree, as the side key and the trace manifest name it."""

    spec: str
    kind: str
    """installed, path or git."""
    root: str
    """The folder holding ``megatron/``, first on the workers' PYTHONPATH ("" when installed)."""
    version: str
    """From the tree's own ``megatron/core/package_info.py``."""
    commit: str = ""
    """The full commit id (a git revision, or the HEAD of a checkout given as a folder)."""
    repo: str = ""
    dirty: bool = False
    """A checkout whose ``megatron/`` differs from its HEAD."""

    def to_json(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        where = {"installed": "installed", "path": self.root, "git": f"{self.repo}@{self.commit[:10]}"}[self.kind]
        commit = f" at {self.commit[:10]}" + (" (dirty)" if self.dirty else "") if self.kind == "path" and self.commit else ""
        return f"megatron-core {self.version} ({where}{commit})"


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gtp-parity" / "trees"


def read_version(root: Path) -> str:
    """``MAJOR.MINOR.PATCH[PRE_RELEASE]`` from ``root/megatron/core/package_info.py``, read as
    text: the file runs git when imported."""
    text = (root / "megatron" / "core" / "package_info.py").read_text()
    found = {}
    for key in ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE"):  # KEY = 20, KEY = 'rc1', a comment after
        m = re.search(rf"^{key}\s*=\s*(?:'([^'\n]*)'|\"([^\"\n]*)\"|([^#\s]+))", text, re.M)
        found[key] = next((g for g in m.groups() if g is not None), "") if m else None
    if not all(found[k] for k in ("MAJOR", "MINOR", "PATCH")):
        return "unknown"
    return f"{found['MAJOR']}.{found['MINOR']}.{found['PATCH']}{found['PRE_RELEASE'] or ''}"


def installed_root() -> Path | None:
    """The site folder the venv's ``megatron`` package lives in (PYTHONPATH aside)."""
    site = [p for p in sys.path if p and "site-packages" in p]
    spec = PathFinder.find_spec("megatron", site)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).parent


def _git(repo: Path, *args: str, text: bool = True) -> subprocess.CompletedProcess:
    # Under `git bisect run` git exports GIT_DIR and friends: they would point at the bisect's worktree.
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=text, env=env)


def _commit_of(repo: Path, rev: str, where: str) -> str:
    if _git(repo, "rev-parse", "--git-dir").returncode != 0:
        raise BadInput(where, f"{repo} is not a git repository")
    found = _git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    if found.returncode != 0:
        raise BadInput(where, f"git does not know the revision {rev!r} in {repo}")
    return found.stdout.strip()


def _dirty(repo: Path, folder: str) -> bool:
    """Whether the work tree's ``folder`` differs from HEAD (a bare repository is clean)."""
    if _git(repo, "rev-parse", "--is-bare-repository").stdout.strip() == "true":
        return False
    return bool(_git(repo, "status", "--porcelain", "--", folder).stdout.strip())


def git_revision(spec: str, where: str, folder: str) -> tuple[Path, str]:
    """``git:<repo>@<rev>`` (``@HEAD`` when no ``@``) as (repository, full commit id). A revision
    that is the checkout's HEAD while its ``folder`` has uncommitted changes is refused: the
    revision does not hold what the folder shows."""
    repo_text, at, rev = spec[len(GIT_PREFIX):].rpartition("@")
    if not at:
        repo_text, rev = rev, "HEAD"
    repo = Path(repo_text).expanduser().resolve()
    if not repo.is_dir():
        raise BadInput(where, f"{spec!r}: {repo} is not a folder")
    commit = _commit_of(repo, rev, where)
    head = _git(repo, "rev-parse", "--verify", "--quiet", "HEAD").stdout.strip()
    if commit == head and _dirty(repo, folder):
        raise BadInput(where, f"{spec!r}: {repo}'s {folder}/ has uncommitted changes, which a revision "
                              "does not hold; commit them, or give the folder itself as the spec")  # fmt: skip
    return repo, commit


def checkout_state(checkout: Path, folder: str) -> tuple[str, bool]:
    """(HEAD commit, whether ``folder`` differs from it) when ``checkout`` is a repository's top
    folder; ("", False) otherwise."""
    if _git(checkout, "rev-parse", "--show-toplevel").stdout.strip() != str(checkout):
        return "", False
    return _git(checkout, "rev-parse", "--verify", "--quiet", "HEAD").stdout.strip(), _dirty(checkout, folder)


def extract_once(repo: Path, commit: str, what: str, dest: Path, package: str, where: str, arrange=None) -> Path:
    """``git archive`` of the folder ``what`` at ``commit`` into ``dest``, read-only, once.

    Written to a temporary folder and renamed, so a half-written tree never exists;
    ``dest/package`` marks a complete one; ``arrange(tmp)`` lays the extracted files out first."""
    if (dest / package).is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name[:24]}-", dir=dest.parent))
    try:
        archive = _git(repo, "archive", "--format=tar", commit, what, text=False)
        if archive.returncode != 0:
            raise BadInput(where, f"{commit[:10]} has no {what}/ folder: {archive.stderr.decode().strip()[-200:]}")
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive.stdout, check=True)
        if arrange is not None:
            arrange(tmp)
        if not (tmp / package).is_dir():
            raise BadInput(where, f"{commit[:10]}'s {what}/ holds no {package} package")
        for p in tmp.rglob("*"):  # read-only: a cached tree is never edited in place
            if p.is_file():
                p.chmod(0o444)
        try:
            tmp.rename(dest)
        except OSError:  # another process materialized it first: theirs is the same commit
            if not (dest / package).is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def materialize(repo: Path, commit: str, where: str) -> Path:
    """The commit's ``megatron/`` under the cache, read-only; extracted once per commit."""
    return extract_once(repo, commit, "megatron", cache_root() / commit, "megatron/core", where)


def resolve(spec: str, where: str) -> CodeTree:
    """The tree ``spec`` names (see the module docstring); ``where`` names the side in errors."""
    if spec == INSTALLED:
        root = installed_root()
        if root is None:
            raise BadInput(where, "no megatron-core is installed in this environment")
        return CodeTree(spec, "installed", "", read_version(root))
    if spec.startswith(GIT_PREFIX):
        repo, commit = git_revision(spec, where, "megatron")
        root = materialize(repo, commit, where)
        return CodeTree(spec, "git", str(root), read_version(root), commit=commit, repo=str(repo))
    path = Path(spec).expanduser().resolve()
    if path.name == "megatron" and (path / "core").is_dir():
        path = path.parent
    if not (path / "megatron" / "core" / "__init__.py").is_file():
        raise BadInput(where, f"{spec!r}: no megatron/core package under {path} "
                              f"(give 'installed', a folder holding megatron/, or git:<repo>@<rev>)")  # fmt: skip
    commit, dirty = checkout_state(path, "megatron")
    return CodeTree(spec, "path", str(path), read_version(path), commit=commit, repo=str(path) if commit else "",
                    dirty=dirty)  # fmt: skip


def check_imports(tree: CodeTree, where: str, env: dict[str, str]) -> None:
    """Import the tree's megatron-core and GTP in a fresh interpreter with the workers'
    environment; a failure is bad input quoting the import error's last line."""
    probe = ("import megatron.core, megatron.core.tensor_parallel.generalized_tensor_parallelism; "
             "print(megatron.core.__file__)")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise BadInput(where, f"{tree.spec!r} does not import: {last}")
    found = Path(done.stdout.strip().splitlines()[-1]).resolve()
    if tree.root and Path(tree.root).resolve() not in found.parents:
        raise BadInput(where, f"{tree.spec!r}: the workers imported megatron-core from {found}, not from {tree.root}")


def is_ancestor(tree: CodeTree, commit: str) -> bool | None:
    """Whether ``commit`` is in the tree's history (True/False), or None when the tree has no
    commit or the commit is not in its repository."""
    if not tree.commit or not tree.repo:
        return None
    repo = Path(tree.repo)
    if _git(repo, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}").returncode != 0:
        return None
    return _git(repo, "merge-base", "--is-ancestor", commit, tree.commit).returncode == 0


def holds(tree: CodeTree, commit: str, version: str) -> bool:
    """Whether ``tree`` holds an upstream change: ``commit`` in its history, or, for a tree
    without one (the installed wheel), a version of ``version`` or later."""
    found = is_ancestor(tree, commit)
    if found is not None:
        return found
    mine = version_key(tree.version)
    return mine is not None and mine >= version_key(version)


def resolve_all(scenarios) -> dict[str, CodeTree]:
    """Spec -> tree for every side's ``megatron_core`` (each spec resolved once, errors
    naming the first side that gives it)."""
    trees: dict[str, CodeTree] = {}
    for s in scenarios:
        sides = {**s.sides, **({"saver": s.saver} if s.saver is not None else {})}
        for role, side in sides.items():
            if side.megatron_core not in trees:
                trees[side.megatron_core] = resolve(side.megatron_core, f"{s.source}: [{role}].megatron_core")
    return trees
