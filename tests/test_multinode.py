"""A world-4 side spread over two "nodes" on loopback (127.0.0.1 only), or started by a
simulated SLURM, gives the one-node run's summaries byte for byte; a node killed mid-run is
named by node, rank and step, within the side's timeout, its traces kept and marked incomplete.

Each run happens in its own folder under the same relative name (``run``, the command's working
directory differing), so the summaries, which record the trace paths as given, are compared
byte for byte with no path rewritten.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.capture import trace
from helpers import ASSETS, ROOT

pytestmark = pytest.mark.multirank

W4 = ASSETS / "tiny_w4.toml"
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def free_port() -> int:
    """A port free on 127.0.0.1 now (bound to 0, read, closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict[str, str]:
    """The worktree's harness first, gloo on the loopback interface, no launcher variables."""
    e = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("SLURM_")}
    return {**e, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), e.get("PYTHONPATH")])),
            "GLOO_SOCKET_IFNAME": "lo"}


def cli(cwd: Path, *args: str, timeout: float = 420) -> subprocess.CompletedProcess:
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=cwd, env=env(), capture_output=True,
                          text=True, timeout=timeout)


def spawn(cwd: Path, argv: list[str], log: str, extra: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(argv, cwd=cwd, env={**env(), **(extra or {})}, stdout=open(cwd / log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def wait_all(procs: list[subprocess.Popen], cwd: Path, timeout: float) -> list[int]:
    """Exit codes; on a timeout every process is killed and the test fails with the logs."""
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        raise AssertionError("timed out; logs:\n" + logs(cwd)) from None
    finally:
        for p in procs:
            kill_tree(p)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a process and its children (torchrun's workers run in sessions of their own)."""
    if proc.poll() is not None:
        return
    kids = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    for pid in [int(k) for k in kids] + [proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


def logs(cwd: Path) -> str:
    return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(cwd.rglob("*.log")))


def plan(cwd: Path, *flags: str) -> dict:
    proc = cli(cwd, "plan", str(W4), "--out", "run", *flags)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {b["name"]: b
            for b in json.loads((cwd / "run" / "launches" / "plans.json").read_text())["launches"]}


def outputs(run: Path) -> dict[str, bytes]:
    """Every summary and table a run wrote (the run's summary.json, each scenario's files)."""
    files = [run / "summary.json", *sorted((run / "scenarios").rglob("*"))]
    return {str(p.relative_to(run)): p.read_bytes() for p in files if p.is_file()}


def nodes_of(run: Path, side: str) -> dict[int, int]:
    beats = [json.loads(p.read_text()) for p in (run / "traces").glob(f"{side}-*/rank*/progress.json")]
    return {b["rank"]: b["node"] for b in beats}


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> Path:
    """The scenario run the ordinary way: ``gtp-parity run``, four ranks on one node."""
    cwd = tmp_path_factory.mktemp("one-node")
    proc = cli(cwd, "run", str(W4), "--out", "run", "--jobs", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return cwd / "run"


def test_two_nodes_of_two_ranks_equal_one_node_byte_for_byte(tmp_path, one_node):
    endpoint = f"127.0.0.1:{free_port()}"
    launches = plan(tmp_path, "--nnodes", "2", "--rdzv-endpoint", endpoint)
    py = [sys.executable, "-m", "harness", "launch"]
    procs = [spawn(tmp_path, [*py, launches["w1-0"]["plan"]], "golden.log")]  # world 1: one node
    for r in (0, 1):
        procs.append(spawn(tmp_path, [*py, launches["w4-0"]["plan"], "--nnodes", "2", "--node-rank", str(r),
                                      "--rdzv-endpoint", endpoint], f"node{r}.log"))
    assert wait_all(procs, tmp_path, timeout=600) == [0, 0, 0], logs(tmp_path)
    assert set(nodes_of(tmp_path / "run", "megatron-w4-tp1-gtp2-fp32").values()) == {0, 1}  # two nodes ran it
    proc = cli(tmp_path, "collect", str(W4), "--out", "run")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("reused") == 3 and "launch w" not in proc.stdout
    got, want = outputs(tmp_path / "run"), outputs(one_node)
    assert sorted(got) == sorted(want) and len(want) >= 6
    for name in want:
        assert got[name] == want[name], f"{name} differs between the 2 x 2 and the 1 x 4 run"


def test_slurm_tasks_started_without_torchrun_equal_one_node(tmp_path, one_node):
    launches = plan(tmp_path)
    worker = [sys.executable, "-m", "harness.backends.worker"]
    port = str(free_port())
    procs = [spawn(tmp_path, [*worker, launches["w1-0"]["plan"]], "golden.log",
                   {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"})]
    for task in range(4):  # what srun --nodes 2 --ntasks 4 sets in each task
        procs.append(spawn(tmp_path, [*worker, launches["w4-0"]["plan"]], f"task{task}.log", {
            "SLURM_PROCID": str(task), "SLURM_NTASKS": "4", "SLURM_LOCALID": str(task % 2),
            "SLURM_NODEID": str(task // 2), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1"}))
    assert wait_all(procs, tmp_path, timeout=600) == [0] * 5, logs(tmp_path)
    run = tmp_path / "run"
    assert all(trace.is_complete(s["trace_dir"]) for b in launches.values() for s in b["sides"])
    assert nodes_of(run, "megatron-w4-tp1-gtpoff-fp32") == {0: 0, 1: 0, 2: 1, 3: 1}
    proc = cli(tmp_path, "collect", str(W4), "--out", "run")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got, want = outputs(run), outputs(one_node)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name] == want[name], f"{name} differs between the SLURM-started and the one-node run"


def test_a_killed_node_is_named_by_node_rank_and_step(tmp_path):
    timeout_s = 60
    scenario = tmp_path / "s.toml"
    scenario.write_text(W4.read_text().replace("timeout_s = 120", f"timeout_s = {timeout_s}"))
    proc = cli(tmp_path, "plan", str(scenario), "--out", "run", "--nnodes", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    plan_w4 = str(tmp_path / "run" / "launches" / "plan-w4-0.json")
    endpoint = f"127.0.0.1:{free_port()}"
    node0 = spawn(tmp_path,
                  [sys.executable, "-m", "harness", "launch", plan_w4, "--nnodes", "2", "--node-rank", "0",
                             "--rdzv-endpoint", endpoint], "node0.log")
    # Node 1 under the user's own torchrun (the printed form): killed below as a machine dies.
    node1 = spawn(tmp_path, [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--node-rank=1",
                             "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                             "--rdzv-id=gtp-parity-w4-0", "--rdzv-conf=is_host=0", "--local-addr=127.0.0.1",
                             "--max-restarts=0",
                             "-m", "harness.backends.worker", plan_w4], "node1.log",
                                 {"PARITY_NODE_RANK": "1"})
    ref = tmp_path / "run" / "traces"
    try:
        deadline = time.monotonic() + 480
        while not any(b.get("node") == 1 and (b.get("step") or 0) >= 1 for b in _beats(ref)):
            assert (node0.poll() is None and node1.poll() is None
                    and time.monotonic() < deadline), logs(tmp_path)
            time.sleep(0.2)
        kill_tree(node1)  # node 1 and its ranks, at once
        killed = time.monotonic()
        last = {b["rank"]: b for b in _beats(ref) if b.get("node") == 1}
        code = node0.wait(timeout=timeout_s + 60)
        took = time.monotonic() - killed
    finally:
        kill_tree(node0)
        kill_tree(node1)
    said = (tmp_path / "node0.log").read_text()
    assert code == 3, said
    assert took < timeout_s + 30, f"node 0 took {took:.0f} s to end"
    # A node-0 rank may be listed too: when its node-0 peer reports the lost connection first,
    # torchrun stops it (SIGTERM) while it still waits in the collective, before it can report.
    m = re.search(r"node 1 rank\(s\) \[(\d), (\d)\](?:, node 0 rank\(s\) \[[\d, ]+\])? exited without an "
                  r"error "
                  r"report \(a hard exit, or the node was lost\); side megatron-w4-tp1-gtpoff-fp32: node 1 "
                  r"rank (\d) "
                  r"stopped at step (\d+) ", said)
    assert m and {int(m[1]), int(m[2])} >= set(last), said
    assert int(m[3]) in last and int(m[4]) == last[int(m[3])]["step"] == min(b["step"]
                                                                             for b in last.values()), said
    left = subprocess.run(["pgrep", "-af", plan_w4], capture_output=True, text=True).stdout
    assert left == "", f"processes left behind: {left}"
    (side,) = [p for p in ref.iterdir() if not trace.is_complete(p) and list(p.glob("rank*/index.json"))]
    manifest = json.loads((side / "manifest.json").read_text())
    assert manifest["complete"] is False and "node 1 rank(s)" in manifest["failed"]
    t = trace.read(side, allow_incomplete=True)  # kept, and readable as incomplete
    assert not t.complete and any(e.step == 0 for e in t.entries)
    proc = cli(tmp_path, "collect", str(scenario), "--out", "run")
    assert (proc.returncode == 3
            and "trace marked incomplete (launch w4-0" in proc.stdout), proc.stdout + proc.stderr


def _beats(traces: Path) -> list[dict]:
    out = []
    for p in traces.glob("*/rank*/progress.json"):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            pass
    return out
