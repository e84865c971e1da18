"""A rank that crashes or hangs ends the run within its timeout, naming the rank and step."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

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


# --- warm workers (harness.run.warm): the fuzzer's launches --------------------------------------


def _sides(tmp_path, name: str, fault: str | None, timeout_s: int = 120) -> dict:
    """tiny.toml's jobs (role -> job) with Adam, the distributed optimizer and an evaluation each
    step (a side whose model outlived it: ``teardown.release_model``), planned under
    ``tmp_path/name``, ``fault`` in the candidate."""
    from harness.run.plan import plan
    from harness.scenario import load

    path = Path(scenario_with(tmp_path, fault, timeout_s) if fault else ASSETS / "tiny.toml")
    evaluated = tmp_path / f"{name}.toml"
    text = path.read_text().replace('optimizer = "sgd"', 'optimizer = "adam"')
    text = text.replace("steps = 2\n", "steps = 2\neval_interval = 1\ndistributed_optimizer = true\n")
    evaluated.write_text(text)
    (s,) = load(evaluated)
    return plan([s], tmp_path / name)[s.name]


def _files(trace_dir) -> dict:
    from pathlib import Path

    root = Path(trace_dir)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_warm_worker_is_replaced_once_the_code_it_imported_changed(tmp_path, monkeypatch):
    """A worker imports megatron-core and the harness once: jobs of another code digest (an edit
    in the middle of a campaign) get a fresh worker, and the stale one ends."""
    from harness.run import warm

    def serve(folder, world, idle_s):  # a worker that only waits for its stop file
        return ["sh", "-c", f"while [ ! -e '{folder}/stop' ]; do sleep 0.05; done"]

    monkeypatch.setattr(warm, "serve_command", serve)
    with warm.WarmPool(tmp_path / "pool") as pool:
        first = pool._take(2, "", "digest-a")
        pool._free[(2, "")].append(first)
        assert pool._take(2, "", "digest-a") is first  # the same code: reused
        pool._free[(2, "")].append(first)
        second = pool._take(2, "", "digest-b")
        assert second is not first and second.code == "digest-b"
        assert first.proc.poll() is not None and pool.pids() == [second.proc.pid]


def test_a_warm_worker_serves_plan_after_plan_as_a_cold_launch_would(tmp_path):
    from harness.common.errors import RunFailed
    from harness.run.launch import launch
    from harness.run.warm import WarmPool, done_path

    cold = _sides(tmp_path, "cold", None)["candidate"]  # GTP 2
    launch([cold], world=2, timeout_s={cold.key: 120}, workdir=tmp_path / "cold", name="cold")
    faulty = _sides(tmp_path, "warm1", "gtp-rs-no-prescale")["candidate"]
    clean = _sides(tmp_path, "warm2", None)
    pool = WarmPool(tmp_path / "pool")
    try:
        # plan 1: the GTP side with a fault patched into megatron-core's GTP reduce-scatter; plan 2:
        # the same side without it, in the same process: its trace is the cold launch's to the
        # byte (the fault did not leak into it; the determinism the comparisons rely on)
        for n, job in enumerate([faulty, clean["candidate"]]):
            pool.launch([job], world=2, timeout_s={job.key: 120}, workdir=tmp_path, name=f"p{n}")
        (worker,) = sorted((tmp_path / "pool").iterdir())
        done = [json.loads(done_path(worker, n).read_text()) for n in (1, 2)]
        assert done[0]["pid"] == done[1]["pid"]
        # a side leaves nothing behind: megatron-core's groups destroyed (WORLD alone is left), its
        # model freed with their threads (each side made about 20 groups, three gloo threads each)
        assert done[0]["process_groups"] == done[1]["process_groups"] == 1
        assert done[1]["threads"] == done[0]["threads"]
        assert _files(clean["candidate"].trace_dir) == _files(cold.trace_dir)
        differs = {k for k, v in _files(faulty.trace_dir).items() if _files(cold.trace_dir).get(k) != v}
        assert any(not k.endswith("manifest.json") for k in differs)  # the fault acted where it ran
        # a side that raises ends its worker, reported as a launch reports it
        bad = _sides(tmp_path, "warm2b", "raise:1:2")["candidate"]
        with pytest.raises(RunFailed, match="rank 1 raised at step 2"):
            pool.launch([bad], world=2, timeout_s={bad.key: 120}, workdir=tmp_path, name="raise")
        assert not pool.pids() and not leftover_ranks(worker)
        # the next plan starts a fresh worker; a hang there ends within the side's own timeout,
        # counted from its first heartbeat (start-up has its budget apart, as in a launch)
        hung = _sides(tmp_path, "warm3", "hang:1:1", timeout_s=10)["candidate"]
        with pytest.raises(RunFailed, match=r"timed out after \d+ s.*rank 1 stopped at step 1") as e:
            pool.launch([hung], world=2, timeout_s={hung.key: 10}, workdir=tmp_path, name="hang")
        waited = int(re.search(r"timed out after (\d+) s", str(e.value)).group(1))
        assert 10 <= waited <= 12  # checked every 0.05 s; a loaded machine may delay a check
        fresh = sorted((tmp_path / "pool").iterdir())[-1]
        assert fresh != worker and (fresh / "plan-0001.json").exists()  # its first plan
        assert not pool.pids()
    finally:
        pool.close()
    assert not leftover_ranks(tmp_path / "pool")


def test_a_side_forgets_the_loggers_megatron_core_sizes_by_its_first_model():
    """A warm worker's next side may have more layers than the first that logged MoE metrics (its
    last pipeline stage raised IndexError recording layer 2 into a buffer of 1)."""
    import torch
    from megatron.core.transformer.moe import moe_logging

    from harness.backends.megatron import teardown

    one = torch.ones(())
    moe_logging.get_moe_metrics_tracker().record("load_balancing_loss", one, layer_number=1, num_layers=1)
    teardown.forget_trackers()
    moe_logging.get_moe_metrics_tracker().record("load_balancing_loss", one, layer_number=2, num_layers=2)
    assert moe_logging.get_moe_metrics_tracker().metrics["load_balancing_loss"].values.tolist() == [0.0, 1.0]
    teardown.forget_trackers()
