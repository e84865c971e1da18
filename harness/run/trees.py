"""The trees a side imports: megatron-core's and Megatron-Bridge's, resolved from their specs.

One resolver for either kind of tree (:class:`Package`: megatron-core's ``megatron/core``, kept
in a repository's ``megatron/``; Megatron-Bridge's ``megatron/bridge``, kept in ``src/``). A
spec (:mod:`harness.scenario.tree_specs`) names:

- ``"installed"``: whatever ``import megatron`` finds in the venv;
- a folder: a checkout, or any folder holding the package (or megatron-core's ``megatron/``
  folder itself);
- ``"git:<repository>@<rev>"``: that revision's package folder, materialized once, read-only,
  into the tree cache keyed by the full commit id (``git archive``, written to a temporary
  folder and renamed, so a half-written tree never exists); the repository is a configured
  name, a URL (cloned into the cache) or a folder (:mod:`harness.run.repos`).

The launcher puts megatron-core's tree first on the workers' PYTHONPATH and a bridge side's
Bridge tree after it (``megatron`` is a namespace package in both); nothing else about how a
side runs changes. A tree's version is read from *its own* ``package_info.py``, not from the
installed metadata. A spec that names no tree, a name configured nowhere, a revision git does
not know: bad input naming the side, before anything launches.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from importlib.machinery import PathFinder
from pathlib import Path

from harness.common.errors import BadInput
from harness.run.repos import cache_home, git, repository
from harness.scenario.rules import version_key
from harness.scenario.tree_specs import FORMS, INSTALLED, parse_spec


@dataclass(frozen=True)
class Package:
    """A kind of tree: what it holds, and where a repository keeps it."""

    title: str
    key: str
    """The side's key naming the tree."""
    package: str
    """The package's folder under the tree's root (the folder put on PYTHONPATH)."""
    folder: str
    """The folder a repository keeps the package in (what ``git archive`` extracts)."""
    under: str
    """The root's folder in a checkout ("": the checkout itself)."""
    cache: str
    """The prefix of its cache folders' names (``<prefix><commit>``)."""
    install: str
    """What to do where none is installed."""
    backends: tuple[str, ...] = ()
    """The backends whose sides import it (empty: every side names one)."""

    def uses(self, side) -> bool:
        return not self.backends or side.backend in self.backends


MEGATRON_CORE = Package("megatron-core", "megatron_core", "megatron/core", "megatron", "", "", "")
BRIDGE = Package("Megatron-Bridge", "bridge", "megatron/bridge", "src/megatron/bridge", "src", "bridge-",
                 ": install the `bridge` extra (scripts/setup.sh --bridge) or name a tree", ("bridge",))


@dataclass(frozen=True)
class CodeTree:
    """A resolved tree, as the side key and the trace manifest name it."""

    spec: str
    kind: str
    """installed, path or git."""
    root: str
    """The folder holding ``megatron/``, on the workers' PYTHONPATH ("" when installed)."""
    version: str
    """From the tree's own ``package_info.py``."""
    commit: str = ""
    """The full commit id (a git revision, or the HEAD of a checkout given as a folder)."""
    repo: str = ""
    dirty: bool = False
    """A checkout whose package folder differs from its HEAD."""

    def to_json(self) -> dict:
        return asdict(self)


def cache_root() -> Path:
    return cache_home() / "trees"


def read_version(root: Path, package: Package = MEGATRON_CORE) -> str:
    """``MAJOR.MINOR.PATCH[PRE_RELEASE]`` from ``root/<package>/package_info.py``, read as text:
    megatron-core's runs git when imported."""
    text = (root / package.package / "package_info.py").read_text()
    found = {}
    for key in ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE"):  # KEY = 20, KEY = 'rc1', a comment after
        m = re.search(rf"^{key}\s*=\s*(?:'([^'\n]*)'|\"([^\"\n]*)\"|([^#\s]+))", text, re.M)
        found[key] = next((g for g in m.groups() if g is not None), "") if m else None
    if not all(found[k] for k in ("MAJOR", "MINOR", "PATCH")):
        return "unknown"
    return f"{found['MAJOR']}.{found['MINOR']}.{found['PATCH']}{found['PRE_RELEASE'] or ''}"


def installed_root(package: Package = MEGATRON_CORE) -> Path | None:
    """The site folder the venv's package lives in (PYTHONPATH aside), or None."""
    site = [p for p in sys.path if p and "site-packages" in p]
    spec = PathFinder.find_spec("megatron", site)
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(location).parent / package.package / "__init__.py").is_file():
            return Path(location).parent
    return None


def _commit_of(repo: Path, rev: str, where: str) -> str:
    if git(repo, "rev-parse", "--git-dir").returncode != 0:
        raise BadInput(where, f"{repo} is not a git repository")
    found = git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    if found.returncode != 0:
        raise BadInput(where, f"git does not know the revision {rev!r} in {repo}")
    return found.stdout.strip()


def _dirty(repo: Path, folder: str) -> bool:
    """Whether the work tree's ``folder`` differs from HEAD (a bare repository is clean)."""
    if git(repo, "rev-parse", "--is-bare-repository").stdout.strip() == "true":
        return False
    return bool(git(repo, "status", "--porcelain", "--", folder).stdout.strip())


def git_revision(repo: Path, spec: str, rev: str, where: str, folder: str) -> str:
    """The full commit id of ``rev`` in ``repo``. A revision that is the checkout's HEAD while
    its ``folder`` has uncommitted changes is refused: the revision does not hold what the
    folder shows."""
    commit = _commit_of(repo, rev, where)
    head = git(repo, "rev-parse", "--verify", "--quiet", "HEAD").stdout.strip()
    if commit == head and _dirty(repo, folder):
        raise BadInput(where, f"{spec!r}: {repo}'s {folder}/ has uncommitted changes, which a revision does "
                              "not hold; commit them, or give the folder itself as the spec")
    return commit


def checkout_state(checkout: Path, folder: str) -> tuple[str, bool]:
    """(HEAD commit, whether ``folder`` differs from it) when ``checkout`` is a repository's top
    folder; ("", False) otherwise."""
    if git(checkout, "rev-parse", "--show-toplevel").stdout.strip() != str(checkout):
        return "", False
    return git(checkout, "rev-parse", "--verify", "--quiet", "HEAD").stdout.strip(), _dirty(checkout, folder)


def extract_once(repo: Path, commit: str, package: Package, where: str) -> Path:
    """``git archive`` of the package's folder at ``commit`` into the cache, read-only, once.

    Written to a temporary folder and renamed, so a half-written tree never exists; the package
    folder marks a complete one. A checkout's ``under`` folder is lifted: its content is the root."""
    dest = cache_root() / f"{package.cache}{commit}"
    if (dest / package.package).is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name[:24]}-", dir=dest.parent))
    try:
        archive = git(repo, "archive", "--format=tar", commit, package.folder, text=False)
        if archive.returncode != 0:
            why = archive.stderr.decode().strip()[-200:]
            raise BadInput(where, f"{commit[:10]} has no {package.folder}/ folder: {why}")
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive.stdout, check=True)
        if package.under and (tmp / package.under).is_dir():  # src/megatron/bridge -> megatron/bridge
            for child in list((tmp / package.under).iterdir()):
                child.rename(tmp / child.name)
            (tmp / package.under).rmdir()
        if not (tmp / package.package).is_dir():
            raise BadInput(where, f"{commit[:10]}'s {package.folder}/ holds no {package.package} package")
        for p in tmp.rglob("*"):  # read-only: a cached tree is never edited in place
            if p.is_file():
                p.chmod(0o444)
        try:
            tmp.rename(dest)
        except OSError:  # another process materialized it first: theirs is the same commit
            if not (dest / package.package).is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _folder(spec: str, where: str, package: Package) -> CodeTree:
    path = Path(spec).expanduser().resolve()
    top, inner = package.package.split("/", 1)
    if path.name == top and (path / inner).is_dir():  # the megatron/ folder itself
        path = path.parent
    checkout = path
    if package.under and (path / package.under / package.package / "__init__.py").is_file():
        path = path / package.under
    if not (path / package.package / "__init__.py").is_file():
        raise BadInput(where, f"{spec!r}: no {package.package} package under {path} (give {FORMS})")
    # A checkout's changes that matter are its package folder's: src/megatron/bridge in Bridge's.
    folder = package.folder if checkout != path else package.folder.removeprefix(package.under).lstrip("/")
    commit, dirty = checkout_state(checkout, folder)
    return CodeTree(spec, "path", str(path), read_version(path, package), commit=commit,
                    repo=str(checkout) if commit else "", dirty=dirty)


def resolve(spec: str, where: str, package: Package = MEGATRON_CORE) -> CodeTree:
    """The tree ``spec`` names (see the module docstring); ``where`` names the side in errors."""
    try:
        parsed = parse_spec(spec)
    except ValueError as e:
        raise BadInput(where, str(e)) from None
    if parsed.kind == INSTALLED:
        root = installed_root(package)
        if root is None:
            raise BadInput(where, f"no {package.title} is installed in this environment{package.install}")
        return CodeTree(spec, "installed", "", read_version(root, package))
    if parsed.kind == "path":
        return _folder(spec, where, package)
    repo = repository(parsed, where)
    commit = git_revision(repo, spec, parsed.rev, where, package.folder)
    root = extract_once(repo, commit, package, where)
    return CodeTree(spec, "git", str(root), read_version(root, package), commit=commit, repo=str(repo))


def resolve_all(scenarios, package: Package = MEGATRON_CORE) -> dict[str, CodeTree]:
    """Spec -> tree for every side that imports the package, the saving side of a checkpoint
    included (each spec resolved once, errors naming the first side that gives it)."""
    trees: dict[str, CodeTree] = {}
    for s in scenarios:
        sides = {**s.sides, **({"saver": s.saver} if s.saver is not None else {})}
        for role, side in sides.items():
            spec = getattr(side, package.key)
            if package.uses(side) and spec not in trees:
                trees[spec] = resolve(spec, f"{s.source}: [{role}].{package.key}", package)
    return trees


def is_ancestor(tree: CodeTree, commit: str) -> bool | None:
    """Whether ``commit`` is in the tree's history (True/False), or None when the tree has no
    commit or the commit is not in its repository."""
    if not tree.commit or not tree.repo:
        return None
    repo = Path(tree.repo)
    if git(repo, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}").returncode != 0:
        return None
    return git(repo, "merge-base", "--is-ancestor", commit, tree.commit).returncode == 0


def holds(tree: CodeTree, commit: str, version: str) -> bool:
    """Whether ``tree`` holds an upstream change: ``commit`` in its history, or, for a tree
    without one (the installed wheel), a version of ``version`` or later."""
    found = is_ancestor(tree, commit)
    if found is not None:
        return found
    mine = version_key(tree.version)
    return mine is not None and mine >= version_key(version)
