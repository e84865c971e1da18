"""The code under test as an axis: megatron-core trees per side, code against code, bisect.

The tests build their own trees (no network): a copy of the installed ``megatron`` package,
and a throwaway git repository of four commits of it (good, GTP's 1/G pre-scale removed, an
unrelated edit, the pre-scale restored).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest

from harness import cli, scenario
from harness.common.errors import BadInput
from harness.compare.outcome import holds_fix, judge_known_divergence
from harness.compare.summary import ScenarioSummary, Verdict
from harness.run import trees
from harness.run.tree_checks import check_imports
from harness.run.launch import worker_env
from harness.run.plan import plan
from harness.scenario.tree_specs import is_code_comparison, with_code
from helpers import ASSETS

GTP_FILE = "megatron/core/tensor_parallel/generalized_tensor_parallelism.py"
PRESCALE = "torch._foreach_mul_(list(wgrads), 1.0 / gtp_remat_size)"


def _git(repo: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env=env).stdout.strip()


def _copy_installed(dest: Path) -> Path:
    shutil.copytree(trees.installed_root() / "megatron", dest / "megatron",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return dest


@pytest.fixture(scope="module")
def cache(tmp_path_factory, monkeypatch_module):
    root = tmp_path_factory.mktemp("xdg")
    monkeypatch_module.setenv("XDG_CACHE_HOME", str(root))
    return root


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def repo(tmp_path_factory, cache) -> tuple[Path, list[str]]:
    """good, bad (no 1/G pre-scale), unrelated, good again: the four commit ids."""
    path = _copy_installed(tmp_path_factory.mktemp("mlm"))
    _git(path, "init", "-q", "-b", "main")
    commits = []
    for i, edit in enumerate(["", None, "# an unrelated edit\n", "restore"]):
        gtp = path / GTP_FILE
        text = gtp.read_text()
        if edit == "restore":
            text, edit = text.replace("pass  # planted: the 1/G pre-scale removed", PRESCALE), ""
        elif edit is None:
            assert text.count(PRESCALE) == 1, "megatron-core's pre-scale line moved: re-read the planted edit"
            text = text.replace(PRESCALE, "pass  # planted: the 1/G pre-scale removed")
        gtp.write_text(text + edit if edit else text)
        _git(path, "add", "-A")
        _git(path, "commit", "-q", "--allow-empty", "-m", f"commit {i}")
        commits.append(_git(path, "rev-parse", "HEAD"))
    return path, commits


def test_installed_tree_reads_its_own_version():
    tree = trees.resolve("installed", "t")
    assert tree.kind == "installed" and tree.root == ""
    assert tree.version == trees.read_version(trees.installed_root())
    assert tree.version.count(".") == 2


def test_a_folder_tree_names_its_version_from_package_info(tmp_path):
    root = _copy_installed(tmp_path)
    info = root / "megatron" / "core" / "package_info.py"
    info.write_text(info.read_text().replace("MINOR = ", "MINOR = 7  # was ", 1))
    tree = trees.resolve(str(root), "t")
    assert tree.kind == "path" and tree.version.startswith("0.7.")
    assert trees.resolve(str(root / "megatron"), "t").root == str(root)  # the megatron/ folder itself


def test_a_revision_is_materialized_once_read_only_by_commit(repo, cache):
    path, commits = repo
    tree = trees.resolve(f"git:{path}@{commits[1][:10]}", "t")
    assert tree.commit == commits[1] and Path(tree.root) == cache / "gtp-parity" / "trees" / commits[1]
    gtp = Path(tree.root) / GTP_FILE
    assert "planted" in gtp.read_text() and not gtp.stat().st_mode & 0o222
    before = gtp.stat().st_mtime_ns
    assert trees.resolve(f"git:{path}@{commits[1]}", "t").root == tree.root
    assert gtp.stat().st_mtime_ns == before  # not extracted again
    assert not [p for p in Path(tree.root).parent.iterdir() if p.name.startswith(".")]  # no half-written tree


@pytest.mark.parametrize(("spec", "message"), [
    ("{tmp}", "no megatron/core package"),
    ("git:{tmp}@HEAD", "is not a git repository"),
    ("git:{repo}@0123456789abcdef", "does not know the revision"),
    ("git:{repo}/missing@HEAD", "is not a folder"),
])
def test_bad_specs_are_bad_input_naming_side_and_spec(spec, message, tmp_path, repo):
    spec = spec.format(tmp=tmp_path, repo=repo[0])
    with pytest.raises(BadInput) as e:
        trees.resolve(spec, "s.toml: [candidate].megatron_core")
    assert message in str(e.value) and "[candidate].megatron_core" in str(e.value)
    assert e.value.exit_code == 2


def test_a_dirty_worktree_given_as_a_revision_is_refused(repo):
    path, _ = repo
    gtp = path / GTP_FILE
    text = gtp.read_text()
    gtp.write_text(text + "# uncommitted\n")
    try:
        with pytest.raises(BadInput, match="uncommitted changes"):
            trees.resolve(f"git:{path}@HEAD", "t")
        assert trees.resolve(str(path), "t").dirty  # as a folder it runs, and says it is dirty
    finally:
        gtp.write_text(text)


def test_a_tree_that_does_not_import_quotes_the_error(tmp_path):
    root = _copy_installed(tmp_path)
    init = root / "megatron" / "core" / "__init__.py"
    init.write_text("raise ImportError('planted: this tree is broken')\n" + init.read_text())
    tree = trees.resolve(str(root), "t")
    with pytest.raises(BadInput, match="does not import: ImportError: planted: this tree is broken"):
        check_imports(tree, "s.toml: [reference].megatron_core", worker_env(tree.root))


def test_the_cli_refuses_a_bad_spec_before_anything_launches(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["run", str(ASSETS / "tiny.toml"), "--out", str(out), "--candidate-code",
                     str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "[candidate].megatron_core" in err and "no megatron/core package" in err
    assert not (out / "traces").exists()


def test_code_options_make_a_code_comparison_judged_exact():
    (s,) = scenario.load(ASSETS / "tiny.toml")
    (c,) = with_code([s], reference="installed", candidate="/tree")
    assert c.reference.gtp == c.candidate.gtp == s.candidate.gtp  # the candidate on both trees
    assert (c.reference.megatron_core, c.candidate.megatron_core) == ("installed", "/tree")
    assert c.compare.policy == "exact" and is_code_comparison(c.reference, c.candidate)
    (e,) = with_code([s], every="/tree")
    assert e.reference.megatron_core == e.candidate.megatron_core == "/tree"
    assert e.golden.megatron_core == "installed"  # the torch golden imports no megatron-core
    assert not is_code_comparison(s.reference, s.candidate)


def test_a_scenario_file_differing_only_in_code_defaults_to_exact(tmp_path):
    # a name: its form only is read
    code_only = '[candidate]\ngtp = 1\nmegatron_core = "git:megatron-lm@main"'
    text = (ASSETS / "tiny.toml").read_text().replace("[candidate]\ngtp = 2", code_only)
    (tmp_path / "c.toml").write_text(text)
    (s,) = scenario.load(tmp_path / "c.toml")
    assert s.compare.policy == "exact"
    (tmp_path / "d.toml").write_text(text + '\n[compare]\npolicy = "noise-floor"\n')
    assert scenario.load(tmp_path / "d.toml")[0].compare.policy == "noise-floor"  # what the file says wins


@pytest.mark.slow
def test_a_commit_changes_the_side_key(repo):
    path, commits = repo
    (s,) = scenario.load(ASSETS / "tiny.toml")
    keys = []
    for c in commits[:2]:
        (t,) = with_code([s], every=f"git:{path}@{c}")
        jobs = plan([t], Path("/nonexistent"))[t.name]
        assert jobs["candidate"].megatron_root.endswith(c)
        assert jobs["candidate"].provenance["megatron_core"]["commit"] == c
        keys.append(jobs["candidate"].key)
    assert keys[0] != keys[1]
    installed = plan([s], Path("/nonexistent"))[s.name]
    assert (installed["candidate"].megatron_root == ""
            and "megatron_core" not in installed["candidate"].provenance)


@pytest.mark.slow
def test_a_checkpoints_saving_side_imports_the_scenarios_tree(repo):
    """--megatron-core names the tree of every side, the saving side of a checkpoint included:
    its launch puts that tree first on the path, as its trace's provenance says."""
    path, commits = repo
    (s, *_) = scenario.load(ASSETS / "checkpoint_fast.toml")
    (t,) = with_code([s], every=f"git:{path}@{commits[0]}")
    jobs = plan([t], Path("/nonexistent"))[t.name]
    saver, candidate = jobs["saver"], jobs["candidate"]
    assert saver.megatron_root == candidate.megatron_root and saver.megatron_root.endswith(commits[0])
    assert saver.provenance["megatron_core"]["commit"] == commits[0]
    assert candidate.checkpoint_dir == saver.checkpoint_dir == str(Path(saver.trace_dir) / "checkpoint")


def test_fixed_in_is_checked_against_the_candidates_history(repo):
    path, commits = repo
    tree = trees.resolve(f"git:{path}@{commits[1]}", "t").to_json()
    fix_old = scenario.KnownDivergence(reason="r", fixed_in=commits[0][:10])
    fix_new = scenario.KnownDivergence(reason="r", fixed_in=commits[3][:10])
    assert holds_fix(fix_old, tree, "0.19.2") and not holds_fix(fix_new, tree, "0.19.2")
    assert not holds_fix(fix_old, None, "0.19.2")  # the installed wheel has no history to read
    assert holds_fix(scenario.KnownDivergence(reason="r", fixed_in_version="0.19.0"), None, "0.19.2")
    assert not holds_fix(scenario.KnownDivergence(reason="r", fixed_in_version="0.20.0"), None, "0.19.2")


def test_a_fixed_divergence_reads_fixed_and_one_still_there_fails():
    exp = scenario.KnownDivergence(reason="file:function:line", signature="ratio-G", fixed_in="c2fd8275d9")
    passed = ScenarioSummary.of(scenario="s", verdict=Verdict.PASS, first_divergence=None,
                                checked={"param": 1})
    fixed = judge_known_divergence(passed, exp, fixed=True)
    assert (fixed.verdict == Verdict.FIXED and fixed.verdict.passes_gate
            and "fixed in c2fd8275d9" in fixed.expectation)
    # gone where the fix is not
    assert judge_known_divergence(passed, exp, fixed=False).verdict == Verdict.FAIL
    failed = passed.with_(verdict=Verdict.FAIL)
    still = judge_known_divergence(failed, exp, fixed=True)
    assert still.verdict == Verdict.FAIL and "still diverges" in still.expectation


def test_the_compat_layer_guards_each_stand_in_and_warns_on_an_unknown_version(monkeypatch):
    from harness.backends.megatron import compat

    monkeypatch.setattr(compat, "_applied", [])
    monkeypatch.setattr(compat, "_missing", [])
    holder = type("Holder", (), {"present": 1})
    compat._replace(holder, "present", 2, "holder.present")
    compat._replace(holder, "absent", 2, "holder.absent")
    assert holder.present == 2 and not hasattr(holder, "absent")
    assert compat._applied == ["holder.present"] and compat._missing == ["holder.absent"]
    monkeypatch.setattr(compat, "tree_version", lambda: "9.9.9")
    with pytest.warns(UserWarning, match=r"this tree is 9\.9\.9.*not found: holder\.absent"):
        compat.check_version()
    monkeypatch.setattr(compat, "tree_version", lambda: "0.19.2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compat.check_version() == "0.19.2"


@pytest.mark.multirank
def test_code_against_code_localizes_the_planted_edit(repo, tmp_path):
    """The installed tree against the commit without GTP's 1/G pre-scale: the same GTP 2 side
    on both trees, judged exact, fails at the first tensor the edit changes."""
    path, commits = repo
    out = tmp_path / "run"
    argv = ["run", str(ASSETS / "tiny.toml"), "--out", str(out), "--reference-code",
            f"git:{path}@{commits[0]}",
            "--candidate-code", f"git:{path}@{commits[1]}"]
    assert cli.main(argv) == 1
    doc = json.loads((out / "scenarios" / "tiny-tp1-gtp2-fp32-sgd" / "summary.json").read_text())
    fd = doc["first_divergence"]
    assert doc["policy"]["name"] == "exact"
    assert (fd["step"], fd["kind"], fd["signature"]) == (1, "main_grad", "ratio-G")
    assert set(doc["config"]["code"]) == {"reference", "candidate"}


@pytest.mark.multirank
@pytest.mark.slow
def test_bisect_names_the_commit_that_broke_parity_and_the_one_that_restored_it(repo, tmp_path, capsys):
    """good, bad, unrelated, good again; GTP on vs off on ``tiny``: from the first to the third
    commit bisect names the second (parity broken), from the second to the fourth the fourth
    (parity restored, past the unrelated commit), each with both verdicts and the failing side's
    divergence. The second bisect's old end and step were run by the first: four commits run."""
    path, commits = repo
    for old, new, first, verdicts in ((0, 2, 1, ("pass", "fail")), (1, 3, 3, ("fail", "pass"))):
        argv = ["bisect", str(ASSETS / "tiny.toml"), "--repo", str(path), "--old", commits[old],
                "--new", commits[new], "--out", str(tmp_path / "bisect")]
        assert cli.main(argv) == 0
        printed = capsys.readouterr().out
        assert f"first changed commit: {commits[first][:10]} commit {first}" in printed
        changed = f"verdict: {verdicts[0]} at {commits[old]} -> {verdicts[1]} at {commits[first][:10]}"
        assert changed in printed
        assert "first divergence of the failing side: step 1 backward main_grad" in printed


def test_the_bisect_scenario_is_the_matrix_entry_without_its_expectation():
    (alone,) = scenario.load(Path(__file__).parents[1] / "scenarios" / "bisect_shared_buffer.toml")
    entry = next(s for s in scenario.load(Path(__file__).parents[1] / "scenarios" / "gtp_paths.toml")
                 if s.name == alone.name)
    assert entry.expect is not None and entry.expect.fixed_in and alone.expect is None
    assert dataclasses.replace(entry, expect=None, source=alone.source, axes={}, description="") == alone
