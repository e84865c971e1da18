"""Verdicts at the edges: a NaN or Inf named as such (``non-finite``), never read as a zero; an
exception of the code under test on one side a parity verdict (``raised``, exit 1), not a failed
run (exit 3). Fast tests on constructed tensors and records; the planted faults in one launch."""

from __future__ import annotations

import dataclasses
import json
import math
import traceback
from pathlib import Path

import pytest
import torch

from harness import scenario
from harness.backends import worker
from harness.capture import trace
from harness.common.mesh import Mesh
from harness.compare import metrics as M
from harness.compare.judge import compare
from harness.compare.outcome import failure_outcome, one_side_raised
from harness.compare.signatures import nonfinite_of
from harness.compare.summary import Verdict
from harness.scenario import Role
from harness.scenario.faults import CATALOG
from harness.session import run_scenarios
from tests.helpers import ASSETS, results, summary
from tests.test_trace import plain_loop_trace

NAN, RAISE, ADAM = "gtp-main-grad-nan", "gtp-backward-raises", "adam-update-scaled"


# --- non-finite: metrics and signature on constructed tensors ---------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_tensor_wholly_nan_reads_nan_in_every_metric_of_its_difference(dtype):
    r = torch.randn(6, 5, generator=torch.Generator().manual_seed(1)).to(dtype)
    c = torch.full_like(r, float("nan"))
    m = M.metrics(r, c)
    for k in ("max_abs", "max_rel", "rel_l2", "cosine", "max_ulp", "p99_ulp", "scaled_ulp"):
        assert math.isnan(m[k]), k  # never 0: the difference is unbounded
    assert m["mismatched"] == m["nonfinite_mismatch"] == r.numel() and not m["bitwise_equal"]
    assert (m["nan_cand"], m["inf_cand"], m["nan_ref"], m["inf_ref"]) == (r.numel(), 0, 0, 0)


def test_the_worst_element_of_a_nonfinite_pair_is_its_first_new_nonfinite_one():
    r = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))
    c = r.clone()
    r[0, 0] = float("nan")  # the reference's own NaN, where the candidate is finite
    c[5, 2], c[6, 1] = float("inf"), float("nan")
    m = M.metrics(r, c)
    assert m["worst_index"] == [5, 2] and m["cand_at_worst"] == math.inf
    assert (m["nan_cand"], m["inf_cand"], m["nan_ref"], m["inf_ref"]) == (1, 1, 1, 0)
    assert m["mismatched"] == 3  # the finite elements are equal
    finite = M.measure(r, c, finite_only=True)[0]  # the finite elements alone: equal
    assert finite["max_abs"] == 0.0 and finite["worst_index"] == [0, 0]


def test_matching_nonfinite_values_are_no_divergence():
    r = torch.tensor([1.0, float("nan"), float("inf")])
    m = M.metrics(r, r.clone())
    assert m["nonfinite_mismatch"] == 0 and m["max_abs"] == 0.0 and "nan_cand" not in m


def test_a_nonfinite_event_names_its_side_and_counts():
    counts = {"nan_cand": 2, "inf_cand": 1, "nan_ref": 0, "inf_ref": 0}
    row = {"policy": "nonfinite", "nonfinite_mismatch": 3, **counts}
    assert nonfinite_of(row) == {"side": "candidate", **counts}
    assert nonfinite_of({**row, "nan_cand": 0, "inf_cand": 0, "nan_ref": 3})["side"] == "reference"
    assert nonfinite_of({"policy": "noise-floor", "nonfinite_mismatch": 0}) is None
    assert nonfinite_of({"policy": "padding", "max_abs": float("nan")})["in"] == "pad rows"
    assert nonfinite_of({"policy": "padding", "max_abs": 1e-3}) is None  # pad-rows, as before


def test_an_all_nan_gradient_is_the_first_divergence_named_nonfinite(tmp_path):
    plain_loop_trace(tmp_path / "ref")
    plain_loop_trace(tmp_path / "cand", poison=(2, "1.weight"))
    traces = {"reference": trace.read(tmp_path / "ref"), "candidate": trace.read(tmp_path / "cand")}
    doc, rows = compare(traces)
    fd = doc.first_divergence
    assert doc.verdict == Verdict.FAIL
    assert (fd.step, fd.kind, fd.tensor, fd.signature) == (2, "main_grad", "1.weight", "non-finite"), fd
    assert fd.extra["non_finite"] == {"side": "candidate", "nan_cand": 6, "inf_cand": 0, "nan_ref": 0,
                                      "inf_ref": 0}
    assert "6 NaN in the candidate" in fd.explanation
    row = rows[(rows["step"] == 2) & (rows["kind"] == "main_grad") & (rows["tensor"] == "1.weight")].iloc[0]
    assert math.isnan(row["max_abs"]) and row["mismatched"] == 6 and row["policy"] == "nonfinite"


# --- raised: the record, and the verdict from it -----------------------------------------------


def _raise_in_megatron() -> Exception:
    from megatron.core.tensor_parallel.generalized_tensor_parallelism import GTPShardedParam

    try:
        GTPShardedParam.wgrad_reduce_scatter(None, None)  # no param: megatron-core itself raises
    except Exception as e:  # noqa: BLE001 - the exception is the subject
        return e
    raise AssertionError("megatron-core did not raise")


def test_an_exception_of_megatron_core_names_its_innermost_frame_and_tree():
    e = _raise_in_megatron()
    rec = worker.raised_by_code_under_test(e)
    inner = traceback.extract_tb(e.__traceback__)[-1]
    assert rec["type"] == type(e).__name__ and rec["message"] == str(e)
    assert rec["frame"] == {"file": "megatron/core/tensor_parallel/generalized_tensor_parallelism.py",
                            "function": "wgrad_reduce_scatter", "line": inner.lineno}
    assert Path(inner.filename).resolve().is_relative_to(rec["tree"])


def _raise_through(kind: type, megatron_file: str) -> Exception:
    """``kind`` raised inside torch.distributed's Python, called from megatron-core (frames
    compiled under those two folders, as a failed collective's traceback has them)."""
    import megatron.core

    dist_file = str(Path(torch.distributed.__file__).parent / "distributed_c10d_fake.py")
    ns = {"kind": kind}
    exec(compile("def collective():\n    raise kind('Connection closed by peer')\n", dist_file, "exec"), ns)
    exec(compile("def caller():\n    collective()\n",
                 str(Path(megatron.core.__file__).parent / megatron_file), "exec"), ns)
    try:
        ns["caller"]()
    except kind as e:
        return e
    raise AssertionError("nothing raised")


def test_a_failed_collective_is_not_the_code_under_tests_raise():
    """A peer that stopped breaks the collective the survivors are in (gloo raises a RuntimeError
    inside torch.distributed, under megatron-core's call): the launch names the rank that
    stopped, no verdict blames megatron-core. A ValueError there (a collective misused by the
    caller) stays the caller's."""
    assert worker.raised_by_code_under_test(_raise_through(RuntimeError, "gtp_caller.py")) is None
    rec = worker.raised_by_code_under_test(_raise_through(ValueError, "gtp_caller.py"))
    assert rec["type"] == "ValueError" and rec["frame"]["file"] == "megatron/core/gtp_caller.py"


def test_an_exception_of_the_harness_is_no_verdict():
    try:
        {}[None]
    except KeyError as e:
        assert worker.raised_by_code_under_test(e) is None


def _failed_scenario():
    s = scenario.load(ASSETS / "tiny.toml")[0]
    jobs = {r: type("J", (), {"trace_dir": f"/t/{r}", "provenance": {}})() for r in s.sides}
    return s, jobs


RAISED = {"type": "KeyError", "message": "None", "tree": "/site-packages", "step": 1,
          "phase": "forward_backward",
          "ranks": [0, 1], "frame": {"file": "megatron/core/x.py", "function": "f", "line": 7}}


@pytest.mark.parametrize(("failed", "raised", "verdict"), [
    ({Role.CANDIDATE: "raised"}, {Role.CANDIDATE: RAISED}, Verdict.FAIL),
    ({Role.REFERENCE: "raised"}, {Role.REFERENCE: RAISED}, Verdict.FAIL),
    # the same exception on both sides, a timeout, the golden: the run failed
    ({Role.CANDIDATE: "raised", Role.REFERENCE: "raised"}, {Role.CANDIDATE: RAISED, Role.REFERENCE: RAISED},
     Verdict.ERROR),
    ({Role.CANDIDATE: "timed out"}, {}, Verdict.ERROR),
    ({Role.CANDIDATE: "raised", Role.GOLDEN: "lost"}, {Role.CANDIDATE: RAISED}, Verdict.ERROR),
])
def test_one_side_raising_in_the_code_under_test_is_a_verdict(failed, raised, verdict):
    s, jobs = _failed_scenario()
    out = failure_outcome(s, failed, jobs, raised)
    assert out.verdict == verdict
    if verdict == Verdict.FAIL:
        fd = out.first_divergence
        side = one_side_raised(failed, raised)
        got = (fd.signature, fd.kind, fd.step, fd.phase, fd.ranks)
        assert got == ("raised", "raised", 1, "forward_backward", [0, 1])
        assert fd.tensor == "KeyError: None" and "megatron/core/x.py:f:7" in fd.explanation
        assert fd.extra["raised"]["side"] == side and fd.extra["raised"]["tree"] == "/site-packages"


# --- the planted faults, in one launch ----------------------------------------------------------


@pytest.fixture(scope="module")
def edges_run(tmp_path_factory):
    """tiny.toml with each planted fault on its candidate (the reference and golden shared)."""
    out = tmp_path_factory.mktemp("edges")
    base = scenario.load(ASSETS / "tiny.toml")[0]
    # The raising candidate first: the sides after it in its launch run in a launch of their own.
    planted = [dataclasses.replace(base, name=f"edge-{f}",
                                   candidate=dataclasses.replace(base.candidate, inject=(f,)))
               for f in (RAISE, NAN)]
    bf16 = scenario.load(ASSETS / "clean_bf16.toml")[0]  # tiny.toml in bf16 with Adam and weight decay
    planted.append(dataclasses.replace(bf16, name=f"edge-{ADAM}", candidate=dataclasses.replace(
        bf16.candidate, inject=(*bf16.candidate.inject, ADAM))))
    code = run_scenarios(planted, out, parallel=2)
    return code, out, {s.name: s for s in planted}


@pytest.mark.multirank
def test_a_nan_in_one_gtp_shard_is_localized_at_its_step_on_its_ranks(edges_run):
    _, out, planted = edges_run
    s, expect = summary(out, f"edge-{NAN}"), CATALOG[NAN].expect
    fd = s["first_divergence"]
    assert s["verdict"] == "fail"
    assert (fd["step"], fd["phase"], fd["kind"], fd["tensor"], fd["signature"]) == (
        expect["step"], expect["phase"], expect["kind"], expect["tensor"], expect["signature"]), fd
    side = planted[f"edge-{NAN}"].candidate
    last = Mesh.of_side(side)
    holders = sorted(last.rank({"tp": t, "gtp": side.gtp - 1, "dp": d}) for t in range(side.tp)
                     for d in range(side.world_size // (side.tp * side.gtp)))
    assert fd["ranks"] == holders and fd["region"]["shard"] == {"gtp": side.gtp - 1}
    assert fd["non_finite"] == {"side": "candidate", "nan_cand": 1, "inf_cand": 0, "nan_ref": 0, "inf_ref": 0}
    assert fd["metrics"].get("max_abs") is None  # NaN: no number, never 0


@pytest.mark.multirank
def test_an_exception_in_gtps_backward_on_the_candidate_is_a_raised_verdict(edges_run):
    code, out, _ = edges_run
    assert code == 1  # a verdict, not a failed run (3)
    s = summary(out, f"edge-{RAISE}")
    fd = s["first_divergence"]
    assert s["verdict"] == "fail" and set(s["error"]) == {"candidate"}
    got = (fd["step"], fd["phase"], fd["kind"], fd["signature"])
    assert got == (1, "forward_backward", "raised", "raised"), fd
    assert fd["tensor"] == "KeyError: None" and fd["ranks"] == [0, 1]
    frame = fd["raised"]["frame"]
    assert frame["file"].startswith("megatron/core/") and frame["function"] and frame["line"] > 0
    assert fd["raised"]["tree"] and fd["raised"]["side"] == "candidate"
    # the sides it shared a launch with, after it, still ran: in a launch of their own
    assert summary(out, f"edge-{NAN}")["verdict"] == "fail"
    after = [p.name for p in (out / "launches").glob("plan-w2-*-after1.json")]
    assert after, sorted(p.name for p in (out / "launches").iterdir())


@pytest.mark.multirank
def test_an_adam_update_scaled_by_five_percent_fails_its_step_bitwise(edges_run):
    """bf16, Adam: the weight's main_grad, weight and state are bitwise equal on both sides, so its
    update must be; 1.05 x the update of one LayerNorm weight fails at step 1 on its fp32 master."""
    _, out, _ = edges_run
    s, expect = summary(out, f"edge-{ADAM}"), CATALOG[ADAM].expect
    fd = s["first_divergence"]
    assert s["verdict"] == "fail"
    got = (fd["step"], fd["phase"], fd["kind"], fd["tensor"], fd["signature"])
    assert got == (expect["step"], expect["phase"], expect["kind"], expect["tensor"], expect["signature"]), fd
    # Each side's fp32 master rounds once per element (half an ULP of the LayerNorm weight, about
    # 1 + lr); the fitted factor moves by at most those two roundings over the update's RMS, which
    # at Adam's first step is lr (|m_hat / sqrt(v_hat)| = 1) less its decay term.
    side = scenario.load(ASSETS / "clean_bf16.toml")[0].reference
    rel = torch.finfo(torch.float32).eps * (1 + side.lr) / (side.lr * (1 - side.weight_decay))
    assert fd["update"]["factor"] == pytest.approx(1.05, rel=rel), fd["update"]
    rows = results(out, f"edge-{ADAM}")
    at = rows[(rows["step"] == 1) & (rows["tensor"] == expect["tensor"])].set_index("kind")
    row = at.loc["master"]
    assert (row["expectation"], row["policy"]) == ("bitwise", "bitwise")
    assert row["bound_on"] == "bits (every bit equal)"
    assert "per tensor" in row["expectation_reason"]
    # What the noise floor alone said of it (policy_passed): in this setting it fails too, at
    # about k x the reference's error against the golden; the bf16 weight itself is bitwise
    # equal at step 1 (5% of an lr = 1e-3 update is below half a bf16 ULP of weights near 1).
    assert not bool(row["policy_passed"])
    assert bool(at.loc["param"]["bitwise_equal"])


def test_after_a_raise_the_sides_it_took_with_it_run_again(tmp_path):
    """A launch whose side raised in the code under test: the sides that never ran or never
    finished form a launch of their own (their partial traces removed); a harness failure, none."""
    from harness.run.plan import Launch, after_raise

    jobs = []
    for name in ("done", "raised", "never"):
        side = type("S", (), {"label": lambda self: "s"})()
        jobs.append(type("J", (), {"key": name, "trace_dir": str(tmp_path / name), "side": side})())
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "manifest.json").write_text('{"complete": true}')
    (tmp_path / "raised" / "rank1").mkdir(parents=True)
    (tmp_path / "raised" / "rank1" / "error.json").write_text('{"step": 1, "raised": {"type": "KeyError"}}')
    (tmp_path / "never" / "rank0").mkdir(parents=True)  # a partial trace: removed before it runs again
    b = Launch("w2-0", 2, 1, jobs, {j.key: 60.0 for j in jobs})
    again = after_raise(b)
    assert [j.key for j in again.jobs] == ["never"] and again.name == "w2-0-after1" and again.world == 2
    assert not (tmp_path / "never").exists() and again.timeout_s == {"never": 60.0}
    (tmp_path / "raised" / "rank1" / "error.json").write_text('{"step": 1, "error": "harness"}')
    assert after_raise(b) is None


def test_a_raise_names_the_rank_that_crashed_not_the_peer_that_lost_it(tmp_path):
    """Rank 1 raised in the code under test; rank 0 then raised in its next collective because
    rank 1 was gone: the record (and the fuzzer's cluster) is rank 1's exception."""
    from harness.run.launch import raised_record

    side = type("S", (), {"label": lambda self: "s"})()
    job = type("J", (), {"key": "j", "trace_dir": str(tmp_path), "side": side})()
    gone = "[gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:27572"
    for rank, raised in ((0, {"type": "RuntimeError", "message": gone, "where": "p2p_communication.py"}),
                         (1, {"type": "IndexError", "message": "index 1 out of bounds", "where": "moe.py"})):
        (tmp_path / f"rank{rank}").mkdir()
        (tmp_path / f"rank{rank}" / "error.json").write_text(json.dumps({"step": 1, "raised": raised}))
    record = raised_record(job, 2)
    assert (record["type"], record["ranks"]) == ("IndexError", [1])
    (tmp_path / "rank1" / "error.json").unlink()  # only the peer's error left: it is what there is
    assert raised_record(job, 2)["type"] == "RuntimeError"


# --- provenance: a warning only where the difference can matter --------------------------------


def _traced(backend, megatron, torch_version="2.6"):
    from harness.run.provenance import _digest

    prov = {"versions": {"torch": torch_version, "megatron-core": megatron}, "code": {"megatron": megatron}}
    prov["digest"] = _digest(prov)
    return type("T", (), {"manifest": {"backend": backend, "provenance": prov}})()


def test_the_golden_is_not_warned_of_a_megatron_core_it_does_not_import():
    from harness.compare.outcome import provenance_warnings

    ref, cand = _traced("megatron", "0.19.2"), _traced("megatron", "0.20.0")
    warned = provenance_warnings({"reference": ref, "candidate": cand, "golden": _traced("torch", "0.20.0")})
    assert len(warned) == 1 and warned[0].startswith("candidate trace") and "0.19.2 vs 0.20.0" in warned[0]
    # a difference the golden's computation does read is still named
    golden = _traced("torch", "0.20.0", torch_version="2.7")
    warned = provenance_warnings({"reference": ref, "golden": golden})
    assert len(warned) == 1 and "versions.torch: 2.6 vs 2.7" in warned[0] and "megatron" not in warned[0]


# --- optimizer updates: the per-tensor rule, and what each bound applies to --------------------


def _rows(target_grad_bitwise: bool):
    import pandas as pd

    rows = [{"step": 0, "kind": "param", "tensor": t, "bitwise_equal": True, "policy": "exact",
             "passed": True} for t in ("a", "b")]
    rows += [{"step": 1, "kind": "main_grad", "tensor": "a", "bitwise_equal": target_grad_bitwise},
             {"step": 1, "kind": "main_grad", "tensor": "b", "bitwise_equal": False},  # another's rounding
             {"step": 1, "kind": "master", "tensor": "a", "bitwise_equal": False, "shape": "(4,)"},
             {"step": 2, "kind": "master", "tensor": "a", "bitwise_equal": False, "shape": "(4,)"}]
    return pd.DataFrame(rows).assign(policy=lambda d: d["policy"].fillna("noise-floor"),
                                     passed=lambda d: d["passed"].fillna(True))


@pytest.mark.parametrize(("grad_bitwise", "expected"), [(True, "bitwise"), (False, "noise-floor")])
def test_an_element_wise_update_is_bitwise_where_its_own_inputs_are(grad_bitwise, expected):
    from harness.compare import expectations as ex

    df = _rows(grad_bitwise)
    cfg = {"precision": "bf16", "optimizer": "adam", "clip_grad": 0.0, "gtp": 1}
    up = ex._Upstream(df)
    row = df[(df["step"] == 1) & (df["kind"] == "master")].iloc[0].to_dict()
    exp, why = ex.expectation(row, cfg, {**cfg, "gtp": 2}, up, None)
    assert exp == expected, why
    # step 2 reads the step-1 state, which differs: no bound carries through
    row2 = df[(df["step"] == 2) & (df["kind"] == "master")].iloc[0].to_dict()
    assert ex.expectation(row2, cfg, {**cfg, "gtp": 2}, up, None)[0] == "noise-floor"


def test_an_active_clip_reads_every_gradient_so_the_per_tensor_rule_needs_them_all():
    """The clip factor is computed from the norm of every main_grad, recorded rounded to fp32: two
    norms that round alike can scale the updates differently (measured on gtp_paths.toml's
    recompute-full-prefetch-off: equal fp32 norms, Adam states 5e-10 apart)."""
    import pandas as pd

    from harness.compare import expectations as ex

    df = _rows(True)
    norm = {"step": 1, "kind": "scalar", "tensor": "grad_norm", "bitwise_equal": True, "ref_value": 1.17,
            "cand_value": 1.17, "policy": "consistency", "passed": True}
    up = ex._Upstream(pd.concat([df, pd.DataFrame([norm])], ignore_index=True))
    row = df[(df["step"] == 1) & (df["kind"] == "master")].iloc[0].to_dict()
    for clip, expected in ((1.0, "noise-floor"), (2.0, "bitwise")):  # active: noise; inactive: bitwise
        cfg = {"precision": "bf16", "optimizer": "adam", "clip_grad": clip, "gtp": 1}
        assert ex.expectation(row, cfg, {**cfg, "gtp": 2}, up, None)[0] == expected, clip


def test_every_bound_names_the_statistic_it_bounds():
    import pandas as pd

    from harness.compare.tolerance import BOUND_ON, with_bound_on

    df = with_bound_on(pd.DataFrame({"policy": ["noise-floor", "bitwise", "bounded", "nonfinite", None]}))
    assert df["bound_on"].tolist()[:3] == [BOUND_ON["noise-floor"], BOUND_ON["bitwise"], BOUND_ON["bounded"]]
    assert df["bound_on"].tolist()[3:] == ["", ""]
    assert BOUND_ON["noise-floor"].startswith("rms") and BOUND_ON["dtype"].startswith("each element")
