"""``gtp-parity bisect``: the first commit between OLD and NEW whose verdict differs from OLD's.

Whether that commit broke parity or restored it, git finds it: ``git bisect run`` in a scratch
worktree (``--term-old=same --term-new=changed``), the harness as its test. Each step runs the
scenario on the commit's ``megatron/`` (``git:<repo>@<commit>``, materialized once per commit
in the tree cache) and exits 0 when the verdict is OLD's, 1 when it differs, 125 (skip) when
the tree is bad input or a run failed.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import scenario
from harness.common.errors import BadInput, HarnessError
from harness.scenario.tree_specs import GIT_PREFIX, with_code
from harness.session import run_scenarios

SKIP = 125


def _git(repo: Path, *args: str, check: bool = True) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise BadInput(f"git {' '.join(args[:2])}", done.stderr.strip()[-300:] or f"exit {done.returncode}")
    return done.stdout.strip()


def verdict_at(repo: Path, commit: str, scenario_file: str, out: Path) -> dict:
    """Run the (single) scenario on ``commit``'s tree; its summary as written. Every commit's
    run shares ``out``'s traces, so sides that do not import megatron-core (the golden) run once."""
    scenarios = scenario.load(scenario_file)
    if len(scenarios) != 1:
        raise BadInput(scenario_file, f"bisect runs one scenario, the file holds {len(scenarios)}")
    (s,) = with_code(scenarios, every=f"{GIT_PREFIX}{repo}@{commit}")
    s = dataclasses.replace(s, name=f"{s.name}@{commit[:12]}")
    run_scenarios([s], out)
    return json.loads((out / "scenarios" / s.name / "summary.json").read_text())


def step(repo: Path, old_verdict: str, scenario_file: str, out: Path) -> int:
    """One ``git bisect run`` step at the worktree's HEAD (the current folder)."""
    commit = _git(Path.cwd(), "rev-parse", "HEAD")
    try:
        got = verdict_at(repo, commit, scenario_file, out)["verdict"]
    except (HarnessError, OSError, KeyError, ValueError) as e:
        print(f"bisect step {commit[:10]}: skipped: {e}", file=sys.stderr)
        return SKIP
    if got == "error":
        return SKIP
    print(f"bisect step {commit[:10]}: {got} ({'same' if got == old_verdict else 'changed'})")
    return 0 if got == old_verdict else 1


def bisect(repo: Path, old: str, new: str, scenario_file: str, out: Path) -> int:
    """Find and print the first changed commit; 0 when found, 1 when OLD and NEW agree."""
    repo = repo.resolve()
    if _git(repo, "rev-parse", "--git-dir", check=False) == "":
        raise BadInput("--repo", f"{repo} is not a git repository")
    old_c, new_c = (_git(repo, "rev-parse", "--verify", f"{r}^{{commit}}") for r in (old, new))
    start = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    ends = {name: verdict_at(repo, c, scenario_file, out) for name, c in (("old", old_c), ("new", new_c))}
    if ends["old"]["verdict"] == ends["new"]["verdict"]:
        print(f"bisect: {old} and {new} give the same verdict ({ends['old']['verdict']}): nothing to bisect")
        return 1
    with tempfile.TemporaryDirectory(prefix="gtp-parity-bisect-") as tmp:
        wt = Path(tmp) / "worktree"
        _git(repo, "worktree", "add", "--detach", str(wt), old_c)
        try:
            _git(wt, "bisect", "start", "--term-old=same", "--term-new=changed", new_c, old_c)
            cmd = [sys.executable, "-m", "harness", "bisect-step", "--repo", str(repo), "--old-verdict",
                   ends["old"]["verdict"], "--out", str(out.resolve()), str(Path(scenario_file).resolve())]
            run = subprocess.run(["git", "-C", str(wt), "bisect", "run", *cmd], capture_output=True,
                                 text=True)
            found = re.search(r"^([0-9a-f]{40}) is the first changed commit", run.stdout, re.M)
        finally:
            subprocess.run(["git", "-C", str(wt), "bisect", "reset"], capture_output=True)
            _git(repo, "worktree", "remove", "--force", str(wt), check=False)
    if not found:
        raise HarnessError(f"git bisect ended without a first changed "
                           f"commit:\n{run.stdout[-2000:]}{run.stderr[-1000:]}")
    first = found.group(1)
    steps = re.findall(r"^bisect step .*$", run.stdout, re.M)
    print("\n".join(steps))
    subject = _git(repo, "log", "-1", "--format=%s", first)
    at = verdict_at(repo, first, scenario_file, out)  # cached: the step ran it
    failing = next((d for d in (ends["old"], at) if d.get("first_divergence")), None)
    print(f"\nfirst changed commit: {first[:10]} {subject}")
    print(f"verdict: {ends['old']['verdict']} at {old} -> {at['verdict']} at {first[:10]}")
    if failing is not None:
        fd = failing["first_divergence"]
        print(f"first divergence of the failing side: step {fd['step']} {fd['phase']} {fd['kind']} "
              f"{fd['tensor']} "
              f"({fd['signature']})")
    print(f"bisect took {time.monotonic() - start:.0f} s ({len(steps)} steps and the two ends)")
    return 0


