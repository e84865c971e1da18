"""Sides beyond one machine, without launching: who a worker is under torchrun or SLURM, the
node flags and their bad inputs, the plan's commands, and failures named by node and rank."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from harness.capture import trace
from harness.cli import main
from harness.common.errors import BadInput
from harness.common.jsonio import write_json
from harness.run import launch as launcher
from harness.run.nodes import NODE_ENV, Nodes, RankEnv, node_commands, parse_endpoint, rank_env
from helpers import ASSETS

W4 = ASSETS / "tiny_w4.toml"


# --- who a worker is ---


def test_torchrun_variables_come_first():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "GROUP_RANK": "0", NODE_ENV: "1",
           "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}  # torchrun under srun: torchrun's ranks count
    assert rank_env(env, 4) == RankEnv(3, 4, 1, 1, "torchrun")
    del env[NODE_ENV]  # a plain torchrun: its own node numbering
    assert rank_env(env, 4).node == 0
    assert rank_env({"RANK": "0", "WORLD_SIZE": "1"}, 1) == RankEnv(0, 1, 0, 0, "torchrun")


def test_slurm_variables_make_the_rank():
    env = {"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert rank_env(env, 4) == RankEnv(2, 4, 0, 1, "slurm")
    assert rank_env({}, 1) == RankEnv(0, 1, 0, 0, "single")
    # A batch script's own step sees the allocation's task count: a world-1 plan is task 0 alone.
    assert rank_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}, 1) == RankEnv(0, 1, 0, 0, "slurm")


@pytest.mark.parametrize("env, says", [
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "4"}, "set MASTER_ADDR and MASTER_PORT"),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "MASTER_ADDR": "127.0.0.1"}, "set MASTER_PORT"),
    ({"SLURM_PROCID": "4", "SLURM_NTASKS": "4"}, "SLURM_PROCID=4 is not below SLURM_NTASKS=4"),
    ({"SLURM_PROCID": "x"}, "SLURM_PROCID='x' is not an integer"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK=-1 is negative"),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, None),  # world-1 plan on task 1: refused
])
def test_bad_rank_variables_are_named(env, says):
    with pytest.raises(ValueError) as e:
        rank_env(env, 1 if says is None else 4)
    assert (says or "a plan of world size 1 runs as one task") in str(e.value)


# --- the node flags ---


@pytest.mark.parametrize("text, want", [
    ("127.0.0.1:29500", ("127.0.0.1", 29500)), ("localhost:1", ("localhost", 1)),
    ("node-0.cluster:65535", ("node-0.cluster", 65535)), ("[::1]:29500", ("::1", 29500)),
])
def test_endpoints_parse(text, want):
    assert parse_endpoint(text) == want


@pytest.mark.parametrize("text", ["127.0.0.1", "127.0.0.1:", ":29500", "127.0.0.1:0", "127.0.0.1:70000",
                                  "a b:1", "[zz]:1", "127.0.0.1:29500:1", "-host:1"])
def test_malformed_endpoints_are_refused(text):
    with pytest.raises(BadInput) as e:
        parse_endpoint(text)
    assert str(e.value).startswith("--rdzv-endpoint: ")


@pytest.mark.parametrize("args, flag", [
    ((2, 2, "127.0.0.1:1", 4), "--node-rank"), ((2, 0, None, 4), "--rdzv-endpoint"),
    ((2, 0, "127.0.0.1:1", 3), "--nnodes"), ((2, 1, "127.0.0.1:1", 1), "--nnodes"),
    ((0, 0, None, 4), "--nnodes"), ((2, 0, "nope", 4), "--rdzv-endpoint"),
])
def test_node_flags_are_checked_together(args, flag):
    with pytest.raises(BadInput) as e:
        Nodes.of(*args)
    assert e.value.where == flag


def test_node_rank_zero_hosts_the_store(tmp_path):
    nodes = Nodes.of(2, 0, "127.0.0.1:29500", 4)
    argv = nodes.torchrun(tmp_path / "plan.json", 4, "w4-0", join_timeout_s=180)
    # A loopback endpoint: every node on this machine, the first to bind the port hosts it.
    assert "--rdzv-conf=join_timeout=180" in argv and "--nproc-per-node=2" in argv
    assert "--local-addr=127.0.0.1" in argv
    assert "--rdzv-conf=is_host=0,join_timeout=180" in Nodes.of(2, 1, "127.0.0.1:29500", 4).torchrun(
        tmp_path / "plan.json", 4, "w4-0", join_timeout_s=180)
    head = Nodes.of(2, 0, "10.0.0.1:29500", 4).torchrun(tmp_path / "plan.json", 4, "w4-0", join_timeout_s=180)
    assert "--rdzv-conf=is_host=1,join_timeout=180" in head and not any("--local-addr" in a for a in head)
    other = Nodes.of(2, 1, "10.0.0.1:29500", 4).torchrun(tmp_path / "plan.json", 4, "w4-0",
                                                         join_timeout_s=180)
    assert "--rdzv-conf=is_host=0,join_timeout=180" in other
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser().parse_args(argv[3:])  # torchrun itself reads them
    assert (parsed.nnodes, parsed.rdzv_backend, parsed.rdzv_endpoint, parsed.rdzv_id) == (
        "2", "c10d", "127.0.0.1:29500", "gtp-parity-w4-0")


def test_printed_commands_are_what_torchrun_reads(tmp_path):
    where, lines = node_commands("w4-0", tmp_path / "plan-w4-0.json", 4, 2, "127.0.0.1:29500", tmp_path)
    assert "on 2 nodes, 2 rank(s) each" in where
    hows = [how for how, _ in lines]
    assert hows[0].startswith("supervised") and hows[1] == "your torchrun" and hows[2].startswith("SLURM")
    words = shlex.split(lines[1][1].replace("=R ", "=0 "))
    i = words.index("torch.distributed.run")
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser().parse_args(words[i + 1:])
    assert (parsed.nnodes, parsed.node_rank, parsed.nproc_per_node, parsed.rdzv_id) == ("2", 0, "2",
        "gtp-parity-w4-0")
    assert parsed.training_script_args == [str(tmp_path / "plan-w4-0.json")]
    assert "srun --nodes=2 --ntasks=4 --ntasks-per-node=2 " in lines[2][1]
    where, lines = node_commands("w1-0", tmp_path / "p.json", 1, 2, None, tmp_path)
    assert where == "on one node" and lines[1][0] == "plain"
    where, _ = node_commands("w2-0", tmp_path / "p.json", 2, 4, None, tmp_path)
    assert where == "on one node (world 2 does not split over 4 nodes)"


# --- plan, then bad flags refused with nothing lost ---


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    out = tmp_path_factory.mktemp("planned") / "run"
    assert main(["plan", str(W4), "--out", str(out), "--nnodes", "2", "--rdzv-endpoint",
                 "127.0.0.1:29500"]) == 0
    return out


def test_plan_writes_every_launch_and_launches_nothing(planned, capsys):
    index = json.loads((planned / "launches" / "plans.json").read_text())
    assert [(b["name"], b["world"]) for b in index["launches"]] == [("w1-0", 1), ("w4-0", 4)]
    sides = {s["side"] for b in index["launches"] for s in b["sides"]}
    assert sides == {"torch-w1-tp1-gtpoff-fp64", "megatron-w4-tp1-gtpoff-fp32", "megatron-w4-tp1-gtp2-fp32"}
    plan = json.loads((planned / "launches" / "plan-w4-0.json").read_text())
    assert plan["world"] == 4 and set(plan["timeout_s"].values()) == {120}
    assert all(Path(j["trace_dir"]).is_absolute() for j in plan["jobs"])  # every node reads them
    assert not (planned / "traces").exists()


def test_plan_prints_each_nodes_command(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["plan", str(W4), "--out", str(out), "--nnodes", "2", "--rdzv-endpoint",
                 "127.0.0.1:29500"]) == 0
    said = capsys.readouterr().out
    assert f"-m harness launch {out.resolve()}/launches/plan-w4-0.json --nnodes 2 --node-rank R " \
           "--rdzv-endpoint 127.0.0.1:29500" in said
    assert "launch w1-0: 1 side(s), world 1, on one node" in said
    assert f"gtp-parity collect {W4} --out {out}" in said


def _cli(argv: list[str]) -> int:
    """The command line's exit code (argparse's own refusals exit through SystemExit)."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("argv, flag", [
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:29500"], "--node-rank"),
    (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1"], "--rdzv-endpoint"),
    (["--nnodes", "2"], "--rdzv-endpoint"),
    (["--nnodes", "3", "--rdzv-endpoint", "127.0.0.1:29500"], "--nnodes"),
    (["--nnodes", "0"], "--nnodes"),
    (["--node-rank", "-1"], "--node-rank"),
])
def test_bad_launch_flags_are_one_line_and_lose_nothing(planned, capfd, argv, flag):
    before = _snapshot(planned)
    code = _cli(["launch", str(planned / "launches" / "plan-w4-0.json"), *argv])
    err = capfd.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and flag in err, err
    assert _snapshot(planned) == before


def test_bad_plan_flags_and_plan_files_are_refused(planned, tmp_path, capfd):
    before = _snapshot(planned)
    assert _cli(["plan", str(W4), "--out", str(planned), "--rdzv-endpoint", "host:port"]) == 2
    assert capfd.readouterr().err.strip().startswith("gtp-parity: --rdzv-endpoint: ")
    assert _snapshot(planned) == before
    for text in ('{"jobs": []}', '{"name": "w4-0", "world": 4, "jobs": [{"key": 1}]}', "[", "\xff"):
        (tmp_path / "x.json").write_text(text)
        assert _cli(["launch", str(tmp_path / "x.json")]) == 2
        err = capfd.readouterr().err
        assert "not a" in err and len(err.strip().splitlines()) == 1, err


def test_collect_launches_nothing_and_says_what_is_missing(planned, capsys):
    out = planned.parent / "collect"
    assert main(["collect", str(W4), "--out", str(out)]) == 3
    said = capsys.readouterr().out
    assert "run failed" in said and "not run (no trace at" in said
    assert not (out / "launches").exists()


# --- failures named by node and rank ---


def _fake_trace(path: Path, beats: dict[int, dict], errors: dict[int, str]) -> None:
    for r, b in beats.items():
        write_json(path / f"rank{r}" / "progress.json", {"rank": r, **b})
    for r, e in errors.items():
        write_json(path / f"rank{r}" / "error.json", {"rank": r, "step": beats[r]["step"], "error": e})


@pytest.fixture
def w4_jobs(planned):
    from harness.run.job import Job

    plan = json.loads((planned / "launches" / "plan-w4-0.json").read_text())
    return [Job.from_json(j) for j in plan["jobs"]]


def test_a_lost_node_is_named_with_its_ranks_and_step(tmp_path, w4_jobs):
    import dataclasses

    job = dataclasses.replace(w4_jobs[0], trace_dir=str(tmp_path / "t"))
    lost = "RuntimeError: Connection closed by peer [127.0.0.1]:1234"
    _fake_trace(tmp_path / "t",
                {0: {"step": 2, "phase": "begin", "node": 0}, 1: {"step": 2, "phase": "begin", "node": 0},
                                 2: {"step": 1, "phase": "optimizer", "node": 1},
                                 3: {"step": 1, "phase": "forward_backward", "node": 1}},
                {0: lost, 1: lost})
    said = launcher.describe_failure([job], 4)
    assert said.startswith("node 1 rank(s) [2, 3] exited without an error report (a hard exit, or the node "
                           "was lost); ")
    assert "node 1 rank 3 stopped at step 1 (forward_backward)" in said
    launcher.mark_incomplete([job], 4, failed=said)
    assert not trace.is_complete(job.trace_dir)
    assert json.loads((tmp_path / "t" / "manifest.json").read_text())["failed"] == said
    assert "trace marked incomplete (node 1 rank(s) [2, 3]" in launcher.describe_pending(job, 4)


def test_one_node_messages_name_ranks_as_before(tmp_path, w4_jobs):
    import dataclasses

    job = dataclasses.replace(w4_jobs[0], trace_dir=str(tmp_path / "t"))
    _fake_trace(tmp_path / "t", {r: {"step": 1, "phase": "begin", "node": 0} for r in range(4)},
                {0: "ValueError: boom"})
    said = launcher.describe_failure([job], 4)
    assert said == f"side {job.side.label()}: rank 0 raised at step 1: ValueError: boom"
    (tmp_path / "t" / "rank0" / "error.json").unlink()
    said = launcher.describe_failure([job], 4)
    assert said.startswith("rank(s) [0, 1, 2, 3] exited without an error report (a hard exit); ")


def test_worker_refuses_a_task_count_that_is_not_the_plans(planned, monkeypatch, capsys):
    """Before any process group: a world-4 plan started as 2 SLURM tasks, or with no store."""
    from harness.backends import worker

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", NODE_ENV):
        monkeypatch.delenv(k, raising=False)
    plan = str(planned / "launches" / "plan-w4-0.json")
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    assert worker.main([plan]) == 2
    assert "needs world size 4, launched with 2" in capsys.readouterr().err
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.delenv("MASTER_PORT")
    assert worker.main([plan]) == 2
    assert "set MASTER_PORT" in capsys.readouterr().err
