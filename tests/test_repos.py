"""Scenarios that run anywhere: a tree spec names its repository by a name configured once per
machine, or by a git URL cloned into the cache; ``validate`` reads the spec's form only, and a
run whose repository is not here stops before any launch, saying what to configure.

The repositories are built here (no network): a few commits of a package folder laid out as
megatron-core's (``megatron/core``) or Megatron-Bridge's (``src/megatron/bridge``), reached by
folder, by name and by ``file://`` URL.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness import cli
from harness.common.errors import BadInput
from harness.run import repos
from harness.run.trees import BRIDGE, MEGATRON_CORE, resolve
from harness.scenario.tree_specs import parse_spec, spec_problem

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_TREES = ["scenarios/bridge_vs_mlm_seed.toml", "scenarios/bridge_gtp.toml"]


def _git(repo: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t")
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env=env).stdout.strip()


def _commit(repo: Path, package, minor: int) -> str:
    """A commit whose package says version 0.<minor>.0; its full id."""
    folder = repo / package.folder
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "__init__.py").write_text("")
    if package is MEGATRON_CORE:
        folder = folder / "core"
        folder.mkdir(exist_ok=True)
        (folder / "__init__.py").write_text("")
    (folder / "package_info.py").write_text(f"MAJOR = 0\nMINOR = {minor}\nPATCH = 0\nPRE_RELEASE = ''\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", f"0.{minor}.0")
    return _git(repo, "rev-parse", "HEAD")


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A machine with nothing configured: empty cache and configuration folders, no name set."""
    for k in [k for k in os.environ if k.startswith(repos.ENV_PREFIX)]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path


@pytest.fixture(params=[MEGATRON_CORE, BRIDGE], ids=["megatron-core", "bridge"])
def origin(request, machine) -> tuple[Path, object, list[str]]:
    """A repository of two commits of the package (0.1.0, 0.2.0)."""
    repo = machine / "origin"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    return repo, request.param, [_commit(repo, request.param, m) for m in (1, 2)]


@pytest.mark.parametrize(("spec", "kind", "names", "repo", "rev"), [
    ("installed", "installed", "", "", "HEAD"),
    ("../Megatron-LM", "path", "", "../Megatron-LM", "HEAD"),
    ("git:megatron-lm@14346b65a", "git", "name", "megatron-lm", "14346b65a"),
    ("git:megatron-lm", "git", "name", "megatron-lm", "HEAD"),
    ("git:https://github.com/NVIDIA/Megatron-LM@d98e8a64dd", "git", "url", "https://github.com/NVIDIA/Megatron-LM",
     "d98e8a64dd"),
    ("git:ssh://git@example.org/a/b.git@origin/main", "git", "url", "ssh://git@example.org/a/b.git",
     "origin/main"),
    ("git:file:///srv/git/Megatron-LM.git@main", "git", "url", "file:///srv/git/Megatron-LM.git", "main"),
    ("git:~/Megatron-LM@main", "git", "folder", "~/Megatron-LM", "main"),
    ("git:./Megatron-LM@main", "git", "folder", "./Megatron-LM", "main"),
])
def test_a_spec_reads_as_installed_a_folder_a_name_a_url_or_a_repository_folder(spec, kind, names, repo, rev):
    got = parse_spec(spec)
    assert (got.kind, got.names, got.repo, got.rev) == (kind, names, repo, rev)


@pytest.mark.parametrize(("spec", "message"), [
    ("", "an empty spec"),
    ("git:@main", "names no repository"),
    ("git:megatron-lm@", "names no revision"),
    ("git:https://github.com/NVIDIA/Megatron-LM", "a URL names its revision"),
    ("git:https://github.com@main", "a URL names its revision"),
    ("git:Megatron-LM@main", "neither a repository name"),
])
def test_a_malformed_spec_is_named_with_what_is_wrong(spec, message):
    assert message in (spec_problem(spec) or "")


def test_validate_needs_no_repository_on_a_bare_machine(tmp_path):
    """The shipped scenarios validate with an empty home, cache and configuration, and no name set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(repos.ENV_PREFIX)}
    env.update(HOME=str(tmp_path), XDG_CACHE_HOME=str(tmp_path / "cache"),
               XDG_CONFIG_HOME=str(tmp_path / "config"), PYTHONPATH=str(ROOT))
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "scenarios").glob("*.toml"))
    assert set(SHIPPED_TREES) <= set(files)
    done = subprocess.run([sys.executable, "-m", "harness", "validate", *files], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "bridge-gtp2-vs-off-bf16" in done.stdout
    assert not list(tmp_path.iterdir())  # nothing cloned or cached


@pytest.mark.parametrize("path", SHIPPED_TREES)
def test_a_run_whose_repository_is_not_configured_stops_before_launch(machine, capsys, path):
    out = machine / "run"
    assert cli.main(["run", str(ROOT / path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "'git:megatron-lm@14346b65a': no repository is configured for the name 'megatron-lm'" in err
    assert "GTP_PARITY_REPO_MEGATRON_LM" in err
    assert str(machine / "config" / "gtp-parity" / "repos.toml") in err
    assert "https://github.com/NVIDIA/Megatron-LM.git" in err
    assert not (out / "traces").exists() and not (machine / "cache").exists()


def test_a_name_is_configured_by_the_environment_before_the_configuration_file(origin, monkeypatch):
    repo, package, commits = origin
    config = repos.config_file()
    config.parent.mkdir(parents=True)
    (config.parent / "clones").mkdir()
    (config.parent / "clones" / "mlm").symlink_to(repo)
    config.write_text('mlm = "clones/mlm"\n')  # relative to the file's folder
    tree = resolve("git:mlm@main~1", "t", package)
    assert (tree.kind, tree.commit, tree.version) == ("git", commits[0], "0.1.0")
    assert tree.repo == str(repo.resolve())
    assert (Path(tree.root) / package.package / "__init__.py").is_file()
    monkeypatch.setenv("GTP_PARITY_REPO_MLM", str(repo.parent / "elsewhere"))
    with pytest.raises(BadInput, match=r"elsewhere is not a folder \(configured by GTP_PARITY_REPO_MLM\)"):
        resolve("git:mlm@main", "s.toml: [candidate].megatron_core", package)


@pytest.mark.parametrize(("text", "message"), [('mlm = "', "not a TOML file"), ("mlm = 3", "as a string")])
def test_a_bad_configuration_file_is_bad_input_naming_it(machine, text, message):
    config = repos.config_file()
    config.parent.mkdir(parents=True)
    config.write_text(text)
    with pytest.raises(BadInput, match=message) as e:
        resolve("git:mlm@main", "t")
    assert str(config) in str(e.value) and e.value.exit_code == 2


def test_a_url_is_cloned_once_and_fetched_again_for_a_revision_it_lacks(origin, monkeypatch):
    repo, package, commits = origin
    url = f"file://{repo}"
    first = resolve(f"git:{url}@{commits[0][:10]}", "t", package)
    clone = repos.clone_folder(url)
    assert first.repo == str(clone) and clone.parent == repos.cache_home() / "repos"
    assert _git(clone, "rev-parse", "--is-bare-repository") == "true" and first.version == "0.1.0"
    assert resolve(f"git:{url}@main", "t", package).commit == commits[1]
    calls = []
    real = repos.git
    monkeypatch.setattr(repos, "git", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    new = _commit(repo, package, 3)
    assert resolve(f"git:{url}@{commits[1]}", "t", package).commit == commits[1]
    assert "clone" not in calls and "fetch" not in calls  # the clone holds it: nothing fetched
    third = resolve(f"git:{url}@{new[:12]}", "t", package)
    assert (third.commit, third.version, third.repo) == (new, "0.3.0", str(clone))
    assert "fetch" in calls and "clone" not in calls
    with pytest.raises(BadInput, match="git does not know the revision 'no-such-branch'"):
        resolve(f"git:{url}@no-such-branch", "t", package)


def test_a_name_may_be_configured_as_a_url(origin, monkeypatch):
    repo, package, commits = origin
    monkeypatch.setenv("GTP_PARITY_REPO_UPSTREAM", f"file://{repo}")
    tree = resolve("git:upstream@main", "t", package)
    assert tree.commit == commits[1] and tree.repo == str(repos.clone_folder(f"file://{repo}"))


def test_a_url_that_cannot_be_cloned_is_bad_input(machine):
    with pytest.raises(BadInput, match=r"\[reference\]\.megatron_core: git clone file://.* failed"):
        resolve(f"git:file://{machine}/absent@main", "s.toml: [reference].megatron_core")


# --- no shipped file names a folder of one machine ------------------------------------------

SCANNED = ["scenarios", "docs", "README.md", "tests", "benchmarks", "repro", "harness"]
SUFFIXES = (".py", ".md", ".toml", ".sh", ".txt")
# Folders that exist on one machine only, and tree specs naming an absolute folder (a repository
# is named by a name or a URL; $HOME and ~ in a shell example are anyone's).
_MACHINE = re.compile(r"(?<![\w.$~-])/(?:work|root|mnt|scratch|lustre)/|(?<![\w.$~-])/(?:home|Users)/(?!<)\w"
                      r"|\.mirror/")
_FLAGS = "megatron-core|bridge|reference-code|candidate-code|base|head|repo|megatron"
_ABSOLUTE_SPEC = re.compile(rf"git:/(?!/)|\b(?:megatron_core|bridge)\s*=\s*[\"']/|--(?:{_FLAGS})[ =]/")


def machine_paths(text: str) -> list[tuple[int, str]]:
    """(line number, line) of each line naming a folder of one machine."""
    return [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1)
            if _MACHINE.search(line) or _ABSOLUTE_SPEC.search(line)]


def _shipped_files() -> list[Path]:
    out = []
    for name in SCANNED:
        path = ROOT / name
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        out += [p for p in files if p.suffix in SUFFIXES and p != Path(__file__)]
    return out


def test_no_shipped_scenario_doc_or_test_names_a_folder_of_one_machine():
    found = [f"{p.relative_to(ROOT)}:{n}: {line}" for p in _shipped_files() for n, line in
             machine_paths(p.read_text(encoding="utf-8", errors="replace"))]
    assert not found, "name the repository (git:<name>@<rev>) or a URL instead:\n" + "\n".join(found)


@pytest.mark.parametrize("line", [
    'megatron_core = "git:/work/.mirror/NVIDIA+Megatron-LM/repo@14346b65a"',
    'bridge = "/home/someone/Megatron-Bridge"',
    "gtp-parity run s.toml --megatron-core /tmp/Megatron-LM",
    'MAIN = "git:/srv/Megatron-LM@main"',
    "PYTHONPATH=/root/.cache/gtp-parity/trees/abc",
])
def test_the_scan_finds_a_folder_of_one_machine(line):
    assert machine_paths(f"ok\n{line}\n") == [(2, line)]


@pytest.mark.parametrize("line", [
    'megatron_core = "git:megatron-lm@14346b65a"',
    "gtp-parity canary --megatron-core git:$HOME/Megatron-LM@main",
    "gtp-parity run tests/assets/tiny.toml --out /tmp/docs-example",
    "--megatron-core git:https://github.com/NVIDIA/Megatron-LM@d98e8a64dd",
    "GTP_PARITY_REPO_MEGATRON_LM=~/src/Megatron-LM",
    "a URL (`https://`, `git://`, `file://`)",
])
def test_the_scan_lets_portable_lines_through(line):
    assert machine_paths(line) == []
