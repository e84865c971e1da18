"""Multi-rank tests of the DistributedWeight conformance kit.

Three torchrun launches in all, each shared by the tests that read it (also across xdist
workers): one world-4 worker run over megatron-core's GTPShardedParam, the reference and every
faulty implementer; one world-2 CLI run; one world-2 pytest-under-torchrun run of the plugin.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from filelock import FileLock

from harness.conformance import te_source
from harness.conformance.registry import CLAUSES
from harness.conformance.reference import FAULTY
from harness.conformance.kit import ConformanceResult
from tests.test_conformance_te import te_file_or_skip

REPO = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 400
MCORE = "harness.conformance.mcore:gtp_sharded_param"
REFERENCE = "harness.conformance.reference:reference"
PLUGIN = "harness.pytest_plugin.conformance"

pytestmark = pytest.mark.multirank


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def _torchrun(
    nproc: int, args: list[str], cwd: Path, extra: list[str] = ()
) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        *extra,
        *args,
    ]
    return subprocess.run(
        command, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S
    )


def _shared(tmp_path_factory, worker_id: str, name: str, produce) -> dict:
    """Run ``produce(dir) -> dict`` once per session, even when xdist splits the tests."""
    if worker_id == "master":
        return produce(tmp_path_factory.mktemp(name))
    root = tmp_path_factory.getbasetemp().parent
    cache = root / f"{name}.json"
    with FileLock(str(root / f"{name}.lock")):
        if not cache.exists():
            out = root / name
            out.mkdir(exist_ok=True)
            cache.write_text(json.dumps(produce(out)))
    return json.loads(cache.read_text())


def plugin_args() -> list[str]:
    """``-p`` for the plugin unless an installed pytest11 entry point already loads it."""
    if any(ep.value.startswith(PLUGIN) for ep in entry_points(group="pytest11")):
        return []
    return ["-p", PLUGIN]


# --- launch 1: world 4, every implementer ------------------------------------------------------


def _run_world4(out: Path) -> dict:
    impls = [MCORE, REFERENCE] + [f"harness.conformance.reference:{name}@1x2" for name in FAULTY]
    args = ["-m", "harness.conformance.worker", "--json", str(out / "results.json")]
    for impl in impls:
        args += ["--impl", impl]
    proc = _torchrun(4, args, cwd=out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {r["impl"]: r for r in json.loads((out / "results.json").read_text())}


@pytest.fixture(scope="module")
def world4(tmp_path_factory, worker_id) -> dict[str, ConformanceResult]:
    raw = _shared(tmp_path_factory, worker_id, "conformance-world4", _run_world4)
    return {impl: ConformanceResult.from_json(data) for impl, data in raw.items()}


def _failing(result: ConformanceResult) -> set[tuple[str, str, str]]:
    return {(r.clause, r.case, r.mode) for r in result.records if r.status in ("fail", "error")}


def test_mcore_runs_the_required_matrix(world4):
    ran = {r.case for r in world4[MCORE].records if r.status != "skip"}
    for topo in ("tp1-gtp2", "tp1-gtp4", "tp2-gtp2"):
        for dtype in ("float32", "bfloat16"):
            for pad in (16, 0):
                case = f"{topo}/{dtype}/grad-float32/pad{pad}/mean/chain-distinct"
                assert case in ran, f"{case} did not run"
        assert f"{topo}/float32/grad-float32/pad16/sum/chain-distinct" in ran
        assert f"{topo}/bfloat16/grad-bfloat16/pad16/mean/chain-distinct" in ran


def test_mcore_fails_only_the_prefetch_alias_on_repeated_shapes(world4):
    # GTPShardedParam keys its gather buffers by (padded shape, dtype) alone, so with two
    # consecutive same-shape weights the forward prefetch of the second is issued into the buffer
    # the first call has just returned. Everything else conforms.
    expected = {
        (
            "forward.no_inflight_alias",
            f"{topo}/float32/grad-float32/pad16/mean/chain-repeated",
            "overlap",
        )
        for topo in ("tp1-gtp2", "tp1-gtp4", "tp2-gtp2")
    }
    assert _failing(world4[MCORE]) == expected
    failures = world4[MCORE].failures("forward.no_inflight_alias")
    assert {f.weight for f in failures} == {0}
    assert {f.rank for f in failures} == {0, 1, 2, 3}


def test_mcore_grouped_weights_conform_on_their_double_buffered_chain(world4):
    # Routed-expert weights classified into MCore's grouped chains alternate two gather buffers
    # per shape, so the prefetch alias of plain chains does not reach them.
    grouped = [r for r in world4[MCORE].records if "grouped" in r.case]
    assert grouped and all(r.status == "pass" for r in grouped), [
        (r.clause, r.case) for r in grouped if r.status != "pass"]


def test_world4_drove_tes_own_file(world4):
    label = te_file_or_skip().label
    assert {(r.dispatch, r.dispatch_source, r.dispatch_note) for r in world4.values()} == {
        ("te", label, "")
    }


def test_reference_passes_every_clause_in_every_case(world4):
    result = world4[REFERENCE]
    assert result.passed and not _failing(result)
    assert {r.clause for r in result.records} == set(CLAUSES)
    # The fused grouped MLP's attributes apply to grouped weights only: a skip elsewhere.
    skipped = {(r.clause, "grouped" in r.case) for r in result.records if r.status == "skip"}
    assert skipped == {("fused_mlp.routed_expert", False)}
    assert all(
        r.status == "pass" for r in result.records if "grouped" in r.case or r.status != "skip"
    )
    assert len({r.case for r in result.records}) == 30  # 10 cases x 3 topologies


@pytest.mark.parametrize("name", sorted(FAULTY))
def test_faulty_implementer_is_rejected_naming_the_clause(world4, name):
    result = world4[f"harness.conformance.reference:{name}"]
    clause = FAULTY[name]
    assert not result.passed
    assert result.clause_status(clause) == "fail"
    failures = result.failures(clause)
    assert failures and all(f.describe().startswith(f"[{clause}]") for f in failures)


@pytest.mark.parametrize("name", ["rebinds_main_grad", "unmarked_experts"])
def test_review_faults_fail_only_their_own_clause(world4, name):
    # rebinds_main_grad holds the right values (finalize.values passes): only the in-place
    # clause sees that DDP's view of main_grad never gets them.
    result = world4[f"harness.conformance.reference:{name}"]
    assert {clause for clause, _, _ in _failing(result)} == {FAULTY[name]}


def test_failure_records_locate_the_worst_element(world4):
    failure = world4["harness.conformance.reference:missing_mean"].failures("finalize.values")[0]
    assert failure.mismatched == failure.total > 0
    assert failure.worst_abs_diff > failure.bound >= 0
    assert len(failure.worst_index) == 2 and failure.weight is not None


def test_leaked_padding_fails_only_on_ranks_that_hold_pad_rows(world4):
    # At TP1 x G2 on 4 ranks, GTP rank 1 (global ranks 1 and 3) holds every pad row.
    failures = world4["harness.conformance.reference:leaked_padding"].failures("finalize.padding")
    assert {f.rank for f in failures} == {1, 3}


def test_results_round_trip_through_json(world4):
    result = world4[MCORE]
    again = ConformanceResult.from_json(json.loads(json.dumps(result.to_json())))
    assert again.records == result.records and again.passed is False


# --- launch 2: the CLI at world 2 ---------------------------------------------------------------


def _run_cli(out: Path) -> dict:
    command = [
        sys.executable,
        "-c",
        "import sys; from harness.conformance.cli import main; sys.exit(main(sys.argv[1:]))",
        "--impl",
        "harness.conformance.reference:leaked_padding",
        "--nproc",
        "2",
        "--json",
        str(out / "cli.json"),
    ]
    proc = subprocess.run(
        command, cwd=out, env=_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S
    )
    saved = json.loads((out / "cli.json").read_text()) if (out / "cli.json").exists() else None
    return {"rc": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr, "json": saved}


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory, worker_id) -> dict:
    return _shared(tmp_path_factory, worker_id, "conformance-cli", _run_cli)


def test_cli_exits_1_and_prints_the_failing_clause(cli_run):
    assert cli_run["rc"] == 1, cli_run["stderr"][-3000:]
    rows = {
        line.split()[0]: line.split()[1]
        for line in cli_run["stdout"].splitlines()
        if line.split()[:1] and line.split()[0] in CLAUSES
    }
    assert set(rows) == set(CLAUSES)
    assert rows["finalize.padding"] == "FAIL"
    assert all(status == "PASS" for clause, status in rows.items() if clause != "finalize.padding")
    assert "FAIL:" in cli_run["stdout"]


def test_cli_reports_the_te_file_it_drove(cli_run):
    header = cli_run["stdout"].splitlines()[1]
    label = te_file_or_skip().label
    assert header == f"Dispatchers: {label}"
    assert label.startswith(f"TE 2.20.2 distributed_weight.py {te_source.FILE_SHA256}")


def test_cli_writes_the_json_it_judged(cli_run):
    result = ConformanceResult.from_json(cli_run["json"])
    assert result.world_size == 2 and result.topologies == ["1x2"]
    assert result.clause_status("finalize.padding") == "fail"


# --- launch 3: pytest itself under torchrun with the plugin ------------------------------------


def _run_plugin(out: Path) -> dict:
    logs = out / "logs"
    args = [
        "-m",
        "pytest",
        *plugin_args(),
        "--distributed-weight-impl",
        "harness.conformance.reference:leaked_padding",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:xdist",
    ]
    proc = _torchrun(2, args, cwd=out, extra=["--log-dir", str(logs), "--redirects", "3"])
    per_rank = {}
    for path in logs.rglob("stdout.log"):
        per_rank[path.parent.name] = path.read_text()
    return {"rc": proc.returncode, "per_rank": per_rank, "stderr": proc.stderr}


@pytest.fixture(scope="module")
def plugin_run(tmp_path_factory, worker_id) -> dict:
    return _shared(tmp_path_factory, worker_id, "conformance-plugin", _run_plugin)


def test_plugin_fails_on_every_rank_when_one_rank_fails(plugin_run):
    assert plugin_run["rc"] != 0
    assert sorted(plugin_run["per_rank"]) == ["0", "1"], plugin_run["stderr"][-3000:]
    for rank, text in plugin_run["per_rank"].items():
        assert "FAILED conformance::finalize.padding" in text, f"rank {rank}:\n{text[-3000:]}"
        assert f"1 failed, {len(CLAUSES) - 1} passed" in text
        # The pad rows live on rank 1 only, yet rank 0 reports them too.
        assert "rank 1, weight 0" in text and "rank 0, weight" not in text
