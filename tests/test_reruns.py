"""Reruns are trustworthy: a trace is reused only by a side of the same configuration and
code, a change of the code under test makes every side run again, and Ctrl-C ends a run
within seconds, leaving no process behind and its traces marked incomplete."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.run import provenance
from harness.run import plan as runner
from harness import scenario
from harness.capture import trace
from harness.common.jsonio import write_json
from harness.session import run_scenarios
from helpers import ASSETS, ROOT

HARMLESS = "# the code under test, unchanged\n"
# A planted change of megatron-core, as a developer's edit would be: GTP's wgrad pre-scale off.
EDITED = """\
from megatron.core.tensor_parallel import generalized_tensor_parallelism as _gtp
_gtp.GTPShardedParam._prescale_wgrads_for_mean_rs = lambda self, wgrads: None
"""


def test_identity_follows_the_content_of_the_code(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    pkg = tmp_path / "path"
    pkg.mkdir()
    (pkg / "sitecustomize.py").write_text(HARMLESS)
    env = {**os.environ, "PYTHONPATH": str(pkg)}
    first = provenance.code_identity(env)
    assert first == provenance.code_identity(env)  # stable, and served from the file-hash cache
    assert (tmp_path / "cache" / "gtp-parity" / "file-hashes.json").exists()
    (pkg / "sitecustomize.py").write_text(HARMLESS.replace("unchanged", "edited  "))  # same size
    second = provenance.code_identity(env)
    assert second["digest"] != first["digest"]
    assert any(d.startswith("code.site_customize") for d in provenance.differences(first, second))
    assert provenance.code_identity({**env, "NVTE_FP8_BLOCK_SCALING": "1"})["digest"] != second["digest"]
    assert provenance.differences(second, second) == []


def test_fresh_reruns_every_side_and_reuse_is_reported(tmp_path, monkeypatch):
    """Without a launch: complete traces are reused (and said so) unless ``fresh``."""
    scenarios = scenario.load(ASSETS / "tiny.toml")
    by = runner.plan(scenarios, tmp_path, provenance={"digest": "c0de" * 3})
    jobs = {j.key: j for roles in by.values() for j in roles.values()}
    for j in jobs.values():
        write_json(Path(j.trace_dir) / "manifest.json", {"complete": True})
    launched, said = [], []

    def fake_launch(jobs, **kw):
        launched.extend(j.key for j in jobs)
        return 0.0

    monkeypatch.setattr(runner, "launch", fake_launch)
    assert runner.execute(by, scenarios, tmp_path, progress=said.append) == {}
    assert launched == [] and sum("reused" in s for s in said) == len(jobs)
    runner.execute(by, scenarios, tmp_path, progress=said.append, fresh=True)
    assert sorted(launched) == sorted(jobs)


def test_ctrl_c_twice_still_waits_for_every_launch_to_end(tmp_path, monkeypatch):
    """Without a launch: Ctrl-C sets the launches' stop wherever the main thread is; a second
    Ctrl-C while they end their ranks does not cut the wait short (ranks would be left alive);
    no later launch starts, and the previous handler is back once the run has raised."""
    from harness.run.launch import Interrupted

    scenarios = scenario.load(ASSETS / "tiny.toml")
    by = runner.plan(scenarios, tmp_path, provenance={"digest": "c0de" * 3})
    started, ended = [], []

    def fake_launch(jobs, *, stop, name, **kw):
        started.append(name)
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.wait(10), "the first Ctrl-C did not reach the launch"
        os.kill(os.getpid(), signal.SIGINT)  # pressed again while the ranks end
        time.sleep(0.5)
        ended.append(name)
        raise Interrupted(f"{name} interrupted")

    monkeypatch.setattr(runner, "launch", fake_launch)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        runner.execute(by, scenarios, tmp_path, parallel=1, progress=lambda _: None)
    assert len(started) == 1 and ended == started  # one launch, ended before the run raised
    assert len(runner.launches(by, scenarios, runner.pending_jobs(by, progress=lambda _: None))) > 1
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.multirank
def test_rerun_after_editing_the_code_under_test_runs_again_and_fails(tmp_path, monkeypatch, capsys):
    """The same command into the same folder, before and after an edit of the code under test
    (a sitecustomize on PYTHONPATH that patches megatron-core): the second run launches and
    sees the fault; the first run's traces stay, and comparing across them warns."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    code_dir = tmp_path / "code"
    code_dir.mkdir()
    site = code_dir / "sitecustomize.py"
    site.write_text(HARMLESS)
    monkeypatch.setenv("PYTHONPATH", str(code_dir))
    out = tmp_path / "out"
    scenarios = scenario.load(ASSETS / "tiny.toml")
    assert run_scenarios(scenarios, out, parallel=1, verbose=True) == 0
    before = sorted((out / "traces").iterdir())
    assert "launch w2" in capsys.readouterr().out
    assert run_scenarios(scenarios, out, parallel=1, verbose=True) == 0
    assert "launch w" not in capsys.readouterr().out  # nothing ran again
    site.write_text(EDITED)
    assert run_scenarios(scenarios, out, parallel=1, verbose=True) == 1
    said = capsys.readouterr().out
    assert "reused" not in said and "launch w2" in said
    after = sorted(set((out / "traces").iterdir()) - set(before))
    assert len(after) == len(before) == 3
    summary = json.loads((out / "scenarios" / scenarios[0].name / "summary.json").read_text())
    assert summary["first_divergence"]["signature"] == "ratio-G"
    # The old reference against the new candidate: a comparison across code versions is allowed
    # and warned about.
    old_ref = next(p for p in before if "gtpoff-fp32" in p.name)
    new_cand = next(p for p in after if "gtp2-fp32" in p.name)
    from harness.cli import main

    main(["compare", str(old_ref), str(new_cand), "--out", str(tmp_path / "cmp")])
    assert "warning: candidate trace was made by other code than the reference" in capsys.readouterr().out
    assert "site_customize" in json.loads((tmp_path / "cmp" / "summary.json").read_text())["warnings"][0]


@pytest.mark.multirank
def test_ctrl_c_ends_every_launch_within_seconds(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen(
        # The candidate's rank 1 hangs at step 1: the interrupt lands in a launch whatever the machine's
        # load (a tiny run can otherwise finish between the first heartbeat and the signal).
        [sys.executable, "-m", "harness", "run", str(ASSETS / "tiny.toml"), "--out", str(out), "--jobs", "2",
         "--inject", "hang:1:1"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 240
    while not list(out.glob("traces/*/rank*/progress.json")):  # a rank is training
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    _, err = proc.communicate(timeout=60)
    # Each launch (two at a time, in their own threads) gets SIGTERM, then SIGKILL after 5 s,
    # then up to 5 s more for the kill to be reaped: 10 s, plus the launcher's 0.25 s poll and
    # the parent's exit on a loaded machine: well under the scenario's own 120 s timeout.
    assert time.monotonic() - sent < 30, err
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    left = subprocess.run(["pgrep", "-af", str(out)], capture_output=True, text=True).stdout
    assert left == "", f"processes left behind: {left}"
    started = [p for p in (out / "traces").iterdir() if list(p.glob("rank*"))]
    assert started
    for path in started:
        if trace.is_complete(path):
            continue  # a side that finished before the interrupt stays complete
        manifest = json.loads((path / "manifest.json").read_text())
        assert manifest["complete"] is False and manifest["interrupted"] is True
        trace.read(path, allow_incomplete=True)  # kept, and readable as incomplete
