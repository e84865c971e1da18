"""In-process tests of the conformance kit: layout, comparisons, CLI arguments, plugin options."""

from __future__ import annotations

import json
from importlib.metadata import entry_points

import pytest
import torch

from harness.conformance import cli, layout
from harness.conformance.registry import CLAUSES
from harness.conformance.failures import Failure, compare_tensors, failure_lines
from harness.conformance.drive import Case, _passthrough_problems, default_cases
from harness.conformance.protocol import KIT_DISPATCH, CollectiveRecorder, overlaps
from harness.conformance.kit import ClauseRecord, ConformanceResult, Topology, default_topologies

pytest_plugins = ["pytester"]

PLUGIN = "harness.pytest_plugin.conformance"


def test_padding_puts_pad_rows_on_the_last_ranks():
    # D=24, a=16, G=4: P=64, S=16; rank 1 holds 8 real rows, ranks 2 and 3 only padding.
    assert layout.padded_rows(24, 4, 16) == 64
    assert layout.shard_slice(24, 4, 16, 1) == slice(16, 32)
    assert layout.padded_rows(40, 2, 0) == 40
    with pytest.raises(ValueError, match="do not divide"):
        layout.padded_rows(42, 4, 0)
    coords = layout.Coords(tp=1, gtp=4, dp=1, rank=3)
    exp = layout.expected_main_grad(
        seed=0,
        coords=coords,
        module=0,
        member=0,
        shape=(24, 8),
        pad_for_alignment=16,
        microbatches=1,
        reduction="mean",
        grad_dtype=torch.float32,
        main_grad_dtype=torch.float32,
    )
    assert exp.real_rows == 0 and exp.value.shape == (16, 8) and not exp.value.any()


def test_rank_order_is_tp_then_gtp_then_replicate():
    coords = layout.Coords(tp=2, gtp=2, dp=2, rank=6)
    assert (coords.tp_rank, coords.gtp_rank, coords.dp_rank) == (0, 1, 1)
    assert coords.gtp_peers() == [4, 6]


def test_expected_mean_and_sum_differ_by_g():
    coords = layout.Coords(tp=1, gtp=2, dp=1, rank=0)
    kwargs = dict(
        seed=3,
        coords=coords,
        module=0,
        member=0,
        shape=(32, 4),
        pad_for_alignment=16,
        microbatches=2,
        grad_dtype=torch.float32,
        main_grad_dtype=torch.float32,
    )
    mean = layout.expected_main_grad(reduction="mean", **kwargs)
    total = layout.expected_main_grad(reduction="sum", **kwargs)
    torch.testing.assert_close(total.value, 2 * mean.value)
    assert bool((mean.bound > 0).all())


def test_compare_reports_count_worst_diff_and_index():
    want = torch.zeros(3, 4)
    got = want.clone()
    got[2, 1], got[0, 0] = 5.0, 1.0
    found = compare_tensors(got, want)
    assert found["mismatched"] == 2 and found["total"] == 12
    assert found["worst_abs_diff"] == 5.0 and found["worst_index"] == (2, 1)
    assert compare_tensors(got.double(), want) == {"found": "dtype torch.float64, not torch.float32"}
    assert compare_tensors(got, want, bound=torch.full((3, 4), 10.0)) is None


def test_summary_collapses_repeats():
    failure = Failure("finalize.values", "c", "overlap", 1, 0, "x", "y")
    lines = failure_lines([failure, failure, failure])
    assert lines == [failure.describe() + " (+2 more like it)"]


def test_kit_dispatch_leaves_plain_tensors_alone():
    assert _passthrough_problems(KIT_DISPATCH) == []
    assert not KIT_DISPATCH.is_distributed_weight(torch.nn.Parameter(torch.zeros(2)))


def test_overlap_detects_shared_memory():
    base = torch.zeros(8, 4)
    assert overlaps(base[:4], base[3:5]) and not overlaps(base[:4], base[4:])
    assert not overlaps(base, torch.zeros(8, 4))


def test_recorder_counts_rounds_and_tracks_unwaited_async_outputs(monkeypatch):
    import contextlib

    import torch.distributed as dist

    class Work:
        def wait(self):
            return True

    @contextlib.contextmanager
    def fake_coalescing(group=None, device=None, async_ops=False):
        yield Work()

    monkeypatch.setattr(dist, "all_gather_into_tensor", lambda out, inp, **kw: Work())
    monkeypatch.setattr(dist, "_coalescing_manager", fake_coalescing)
    a, b, c = torch.zeros(4), torch.zeros(4), torch.zeros(4)
    with CollectiveRecorder() as recorder:
        with recorder.call("forward") as log:
            dist.all_gather_into_tensor(a, a)  # synchronous: a round, nothing pending
            work = dist.all_gather_into_tensor(b, b, async_op=True)
            with dist._coalescing_manager(async_ops=True) as manager:
                dist.all_gather_into_tensor(c, c)
                dist.all_gather_into_tensor(c, c)
        assert log.rounds == 3  # the coalesced block counts once
        assert [id(t) for t in log.inflight_outputs()] == [id(b), id(c), id(c)]
        work.wait()
        manager.wait()
        assert log.inflight_outputs() == []
        dist.all_gather_into_tensor(a, a)
    assert [entry.label for entry in recorder.logs] == ["forward", "outside"]


def test_recorder_restores_torch_distributed():
    import torch.distributed as dist

    before = dist.all_gather_into_tensor
    with CollectiveRecorder():
        assert dist.all_gather_into_tensor is not before
    assert dist.all_gather_into_tensor is before


def test_case_matrix_and_topologies():
    names = [c.name for c in default_cases(2, 2)]
    assert len(names) == len(set(names)) == 10
    assert "tp2-gtp2/bfloat16/grad-float32/pad0/mean/chain-distinct" in names
    assert [str(t) for t in default_topologies(4)] == ["1x2", "1x4", "2x2"]
    with pytest.raises(ValueError, match="does not divide"):
        Topology(2, 4).check(4)
    with pytest.raises(ValueError, match="do not divide"):
        Case(tp=1, gtp=4, shapes=((42, 8),), pad_for_alignment=0)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--impl", "no_such_module_xyz:factory", "--nproc", "2"],
            "cannot import module 'no_such_module_xyz'",
        ),
        (
            ["--impl", "harness.conformance.reference", "--nproc", "2"],
            "not of the form module:factory",
        ),
        (
            ["--impl", "harness.conformance.reference:FAULTY", "--nproc", "2"],
            "no callable 'FAULTY'",
        ),
        (
            ["--impl", "harness.conformance.reference:reference", "--nproc", "1"],
            "need at least 2 ranks",
        ),
        (
            ["--impl", "harness.conformance.reference:reference", "--nproc", "4", "--gtp", "3"],
            "does not divide",
        ),
        (["--nproc", "2"], "--impl"),
    ],
)
def test_cli_bad_arguments_exit_2(argv, message, capsys):
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def _result(status: str) -> dict:
    record = ClauseRecord("finalize.values", "tp1-gtp2/x", "overlap", status)
    return ConformanceResult("m:f", "kit", 2, ["1x2"], [record]).to_json()


@pytest.mark.parametrize("status, code", [("pass", 0), ("skip", 0), ("fail", 1), ("error", 1)])
def test_cli_exit_status_follows_the_records(monkeypatch, capsys, status, code):
    def fake_launch(args, topologies, out):
        assert [str(t) for t in topologies] == ["1x2"]
        out.write_text(json.dumps([_result(status)]))
        return type("Done", (), {"returncode": 0, "stderr": ""})()

    monkeypatch.setattr(cli, "_launch", fake_launch)
    assert cli.main(["--impl", "harness.conformance.reference:reference", "--nproc", "2"]) == code
    assert ("PASS:" if code == 0 else "FAIL:") in capsys.readouterr().out


# --- pytest plugin, in process --------------------------------------------------------------------


def _plugin_args() -> list[str]:
    # -p would register the plugin twice once an installed pytest11 entry point loads it.
    if any(ep.value.startswith(PLUGIN) for ep in entry_points(group="pytest11")):
        return []
    return ["-p", PLUGIN]


def test_plugin_registers_option_and_ini_twin(pytester):
    result = pytester.runpytest(*_plugin_args(), "--help")
    result.stdout.fnmatch_lines(
        ["*--distributed-weight-impl=MODULE:FACTORY*", "*distributed_weight_impl*"]
    )


def test_plugin_bad_spec_names_where_it_came_from(pytester):
    result = pytester.runpytest(*_plugin_args(), "--distributed-weight-impl", "nope_xyz:f")
    result.stderr.fnmatch_lines(["*--distributed-weight-impl: cannot import module 'nope_xyz'*"])
    pytester.makeini("[pytest]\ndistributed_weight_impl = harness.conformance.reference\n")
    result = pytester.runpytest(*_plugin_args())
    result.stderr.fnmatch_lines(
        ["*ini option distributed_weight_impl in *: *not of the form module:factory*"]
    )


def test_plugin_bad_topology_names_the_option(pytester):
    impl = "harness.conformance.reference:reference"
    args = ["--distributed-weight-impl", impl, "--distributed-weight-topology", "1x2,3"]
    result = pytester.runpytest(*_plugin_args(), *args)
    result.stderr.fnmatch_lines(
        ["*--distributed-weight-topology: topology '3' is not of the form TxG*"]
    )


def test_plugin_items_explain_that_torchrun_is_needed(pytester):
    result = pytester.runpytest(
        *_plugin_args(), "--distributed-weight-impl", "harness.conformance.reference:reference"
    )
    result.assert_outcomes(failed=len(CLAUSES))
    result.stdout.fnmatch_lines(["*needs at least 2 ranks*torchrun*"])


def test_plugin_is_inert_without_an_implementer(pytester):
    pytester.makepyfile("def test_one():\n    pass\n")
    result = pytester.runpytest(*_plugin_args())
    result.assert_outcomes(passed=1)
