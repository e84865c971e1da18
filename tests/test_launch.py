"""A rank that crashes or hangs ends the run within its timeout, naming the rank and step."""

import subprocess
import sys
import time

import pytest

from harness.capture import trace
from tests.helpers import ASSETS, ROOT

pytestmark = pytest.mark.multirank


def scenario_with(tmp_path, fault: str, timeout_s: int) -> str:
    text = (ASSETS / "tiny.toml").read_text().replace("timeout_s = 120", f"timeout_s = {timeout_s}")
    text = text.replace("[candidate]\ngtp = 2", f'[candidate]\ngtp = 2\ninject = ["{fault}"]')
    path = tmp_path / "s.toml"
    path.write_text(text)
    return str(path)


def run_cli(path, out):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "harness", "run", path, "--out", str(out), "--jobs", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    return proc, time.monotonic() - start


def leftover_ranks(out) -> str:
    ps = subprocess.run(["pgrep", "-af", f"{out}"], capture_output=True, text=True)
    return ps.stdout.strip()


@pytest.mark.parametrize("fault, says", [
    ("exit:1:2", "rank 1 stopped at step 2"),
    ("raise:1:2", "rank 1 raised at step 2"),
])
def test_crashing_rank_is_named_with_its_step(tmp_path, fault, says):
    out = tmp_path / "out"
    proc, _ = run_cli(scenario_with(tmp_path, fault, 120), out)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert says in proc.stdout, proc.stdout
    assert not leftover_ranks(out)
    (sdir,) = (out / "scenarios").iterdir()
    assert '"verdict": "error"' in (sdir / "summary.json").read_text()
    cand = next((out / "traces").glob("megatron-w2-tp1-gtp2-*"))
    t = trace.read(cand, allow_incomplete=True)  # kept, and marked incomplete
    assert not t.complete and any(e.step == 1 for e in t.entries)
    ref = next((out / "traces").glob("megatron-w2-tp1-gtpoff-*"))
    assert trace.read(ref).complete  # the side that ran before the crash is kept whole


def test_hanging_rank_ends_within_the_timeout(tmp_path):
    out = tmp_path / "out"
    proc, wall = run_cli(scenario_with(tmp_path, "hang:1:1", 25), out)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "timed out" in proc.stdout and "rank 1 stopped at step 1" in proc.stdout, proc.stdout
    # the hung side's own 25 s, plus start-up, the reference side and the golden launch
    assert wall < 25 + 120
    assert not leftover_ranks(out)
