"""Where a ``git:`` tree spec's repository is on this machine: a name, a URL's clone, a folder.

A repository *name* (``git:megatron-lm@14346b65a``) is configured once per machine; the first
of these that names it wins:

1. the environment variable ``GTP_PARITY_REPO_<NAME>``: the name upper-cased, every character
   other than a letter or a digit an ``_`` (``GTP_PARITY_REPO_MEGATRON_LM``);
2. the user configuration file ``$XDG_CONFIG_HOME/gtp-parity/repos.toml`` (by default
   ``~/.config/gtp-parity/repos.toml``), one ``name = "folder or URL"`` line per name; a
   relative folder is read from the file's folder.

A name's value is a folder holding a git repository (a clone, bare or not, or a mirror) or a
git URL. A URL, named in a spec or configured for a name, is cloned bare into the cache
(``<cache>/gtp-parity/repos/``) on first use, and fetched again when the clone lacks the
revision asked for; git is never asked for a password (a URL that needs one fails).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import tomllib
from pathlib import Path

from harness.common.errors import BadInput
from harness.scenario.tree_specs import TreeSpec, is_url

ENV_PREFIX = "GTP_PARITY_REPO_"
UPSTREAM = {"megatron-lm": "https://github.com/NVIDIA/Megatron-LM.git",
            "megatron-bridge": "https://github.com/NVIDIA-NeMo/Megatron-Bridge.git"}
"""Only quoted in the message for an unconfigured name: where the shipped scenarios' trees come from."""
HOW = "docs/code-under-test.md, 'Repository names'"


def cache_home() -> Path:
    """The harness's cache folder (``$XDG_CACHE_HOME/gtp-parity``, by default ``~/.cache/...``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gtp-parity"


def config_file() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "gtp-parity" / "repos.toml"


def env_name(name: str) -> str:
    return ENV_PREFIX + re.sub(r"[^A-Z0-9]", "_", name.upper())


def git(repo: Path, *args: str, text: bool = True) -> subprocess.CompletedProcess:
    """``git -C repo ...``, never prompting. Under ``git bisect run`` git exports GIT_DIR and
    friends: they would point at the bisect's worktree, so none is passed on."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env["GIT_TERMINAL_PROMPT"] = "0"
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=text, env=env)


def configured(name: str) -> tuple[str, str] | None:
    """(folder or URL, what configured it) for a repository name, or None where none does."""
    variable = env_name(name)
    if value := os.environ.get(variable, "").strip():
        return (value if is_url(value) else os.path.expanduser(value)), variable
    path = config_file()
    if not path.is_file():
        return None
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise BadInput(str(path), f"not a TOML file: {e}") from None
    if name not in table:
        return None
    value = table[name]
    if not isinstance(value, str) or not value.strip():
        raise BadInput(f"{path}: {name}", "a repository's folder or git URL, as a string")
    return (value if is_url(value) else str(path.parent / Path(value).expanduser())), f"{path}: {name}"


def unconfigured(spec: TreeSpec, where: str) -> BadInput:
    example = UPSTREAM.get(spec.repo, "a git URL")
    return BadInput(where, f"{spec.text!r}: no repository is configured for the name {spec.repo!r} on "
                           f"this machine: set {env_name(spec.repo)} to its folder (a clone) or its URL "
                           f"({example}), or write {spec.repo} = \"<folder or URL>\" in {config_file()} "
                           f"(see {HOW})")


def repository(spec: TreeSpec, where: str) -> Path:
    """The git repository on this machine holding the revision a ``git:`` spec names (a URL
    cloned or fetched first); bad input naming the side where there is none."""
    location, origin = spec.repo, ""
    if spec.names == "name":
        found = configured(spec.repo)
        if found is None:
            raise unconfigured(spec, where)
        location, origin = found[0], f" (configured by {found[1]})"
    if is_url(location):
        return clone(location, spec.rev, where)
    repo = Path(location).expanduser().resolve()
    if not repo.is_dir():
        raise BadInput(where, f"{spec.text!r}: {repo} is not a folder{origin}")
    return repo


def _knows(repo: Path, rev: str) -> bool:
    return git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}").returncode == 0


def clone_folder(url: str) -> Path:
    """The cache folder of a URL's clone: its last path part, and a hash of the whole URL."""
    tail = re.sub(r"[^A-Za-z0-9._-]+", "-", url.rstrip("/").rsplit("/", 1)[-1].removesuffix(".git"))[:40]
    return cache_home() / "repos" / f"{tail or 'repo'}-{hashlib.sha256(url.encode()).hexdigest()[:12]}.git"


def clone(url: str, rev: str, where: str) -> Path:
    """A bare clone of ``url`` in the cache holding ``rev``: cloned on first use (into a
    temporary folder, then renamed, so a half-made clone never exists), and fetched again (its
    branches and tags, then ``rev`` itself, which reaches a commit id no branch holds) when it
    lacks ``rev``."""
    dest = clone_folder(url)
    if not (dest / "HEAD").is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name[:24]}-", dir=dest.parent))
        try:
            done = git(dest.parent, "clone", "--bare", "--quiet", url, str(tmp / "repo"))
            if done.returncode != 0:
                raise BadInput(where, f"git clone {url} failed: {_last_line(done.stderr)}")
            try:
                (tmp / "repo").rename(dest)
            except OSError:  # another process cloned it first
                if not (dest / "HEAD").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if not _knows(dest, rev):
        done = git(dest, "fetch", "--quiet", url, "+refs/heads/*:refs/heads/*", "+refs/tags/*:refs/tags/*")
        if done.returncode != 0:
            raise BadInput(where, f"git fetch {url} failed: {_last_line(done.stderr)}")
        if not _knows(dest, rev):
            git(dest, "fetch", "--quiet", url, rev)  # a commit id no branch holds; its failure is said below
    return dest


def _last_line(text: str) -> str:
    return (text.strip().splitlines() or ["(no message)"])[-1][-300:]
