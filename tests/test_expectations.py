"""Per-tensor expectations (harness.compare.expectations): the rules, and the bound of a sum
of the same terms in two orders that ``bounded`` judges main_grads by."""

import dataclasses

import pandas as pd
import pytest
import torch

from harness.compare import bounds, expectations as ex
from harness.scenario.schema import Side


def _cfg(**kw) -> dict:
    side = Side(**{"backend": "megatron", "world_size": 2, "precision": "bf16", **kw})
    return {**dataclasses.asdict(side), "micro_batches": 1}


def _traces(ref: dict, cand: dict):
    class T:
        def __init__(self, config):
            self.manifest = {"config": config}
    return {"reference": T(ref), "candidate": T(cand)}


def _row(step, kind, tensor="w", bitwise=True, **kw):
    return {"step": step, "kind": kind, "tensor": tensor, "passed": True, "policy": "noise-floor",
            "bitwise_equal": bitwise, "nonfinite_mismatch": 0, **kw}


def _judged(rows, ref, cand):
    df = ex.judge_rows(pd.DataFrame(rows), _traces(ref, cand),
                       policy=type("P", (), {"policy": "noise-floor"})())
    return {(r["step"], r["kind"], r["tensor"]): r for r in df.to_dict("records")}


def test_gtp_changes_no_kernel_but_tp_and_recipes_do():
    assert ex.different_kernels(_cfg(gtp=1), _cfg(gtp=2, gtp_weight_prefetch=False, recompute="full")) is None
    assert "reduction dimension" in ex.different_kernels(_cfg(tp=1), _cfg(tp=2))
    assert "recipe" in ex.different_kernels(_cfg(recipe="mxfp8"), _cfg(recipe="mxfp8"))
    assert "distributed_optimizer" in ex.different_kernels(_cfg(), _cfg(distributed_optimizer=True))


def test_a_forward_on_equal_weights_must_be_bitwise_and_fails_otherwise():
    rows = [_row(0, "param", policy="exact"), _row(1, "activation", bitwise=False),
            _row(1, "logits", bitwise=True)]
    out = _judged(rows, _cfg(gtp=1), _cfg(gtp=2))
    act = out[(1, "activation", "w")]
    assert act["expectation"] == "bitwise" and act["policy"] == "bitwise" and not act["passed"]
    assert out[(1, "logits", "w")]["passed"]
    # Under another TP the same rows keep the scenario's policy, and say why.
    out = _judged(rows, _cfg(tp=1, world_size=2), _cfg(tp=2, world_size=2))
    assert out[(1, "activation", "w")]["expectation"] == "noise-floor" and out[(1, "activation",
        "w")]["passed"]
    assert "TP" in out[(1, "activation", "w")]["expectation_reason"]


def test_after_weights_differ_nothing_downstream_is_claimed():
    rows = [_row(0, "param", policy="exact"), _row(1, "param", bitwise=False),
            _row(2, "activation", bitwise=False)]
    out = _judged(rows, _cfg(gtp=1), _cfg(gtp=2))
    assert out[(2, "activation", "w")]["expectation"] == "noise-floor"
    assert "step 1" in out[(2, "activation", "w")]["expectation_reason"]


def test_main_grad_of_two_terms_is_bitwise_of_more_bounded_by_its_terms():
    two = _judged([_row(0, "param", policy="exact"), _row(1, "main_grad", bitwise=False)], _cfg(gtp=1),
                  _cfg(gtp=2))
    assert two[(1, "main_grad", "w")]["expectation"] == "bitwise" and not two[(1, "main_grad", "w")]["passed"]
    four = {**_cfg(gtp=1), "micro_batches": 2}
    rows = [_row(0, "param", policy="exact"), _row(1, "main_grad", "a", bitwise=False, terms_excess=-1e-9,
            terms_bound_max=1e-8),
                _row(1, "main_grad", "b", bitwise=False, terms_excess=1e-6, terms_bound_max=1e-8),
            _row(1, "main_grad", "c", bitwise=False)]
    out = _judged(rows, four, {**_cfg(gtp=2), "micro_batches": 2})
    assert out[(1, "main_grad", "a")]["expectation"] == "bounded" and out[(1, "main_grad", "a")]["passed"]
    assert not out[(1, "main_grad", "b")]["passed"] and out[(1, "main_grad", "b")]["bound"] == 1e-8
    assert out[(1, "main_grad", "c")]["expectation"] == "noise-floor"  # no terms recorded


def test_the_optimizer_step_is_bitwise_only_on_equal_grads_and_clip_factor():
    base = [_row(0, "param", policy="exact"), _row(1, "main_grad")]
    norm = {"step": 1, "kind": "scalar", "tensor": "grad_norm", "bitwise_equal": False,
            "policy": "consistency",
            "passed": True, "ref_value": 2.0, "cand_value": 2.0000002}
    rows = [*base, norm, _row(1, "exp_avg_sq", bitwise=False)]
    clipped = _judged(rows, _cfg(gtp=1, clip_grad=1.0), _cfg(gtp=2, clip_grad=1.0))
    assert clipped[(1, "exp_avg_sq", "w")]["expectation"] == "noise-floor"
    unclipped = _judged(rows, _cfg(gtp=1, clip_grad=4.0), _cfg(gtp=2, clip_grad=4.0))
    assert unclipped[(1, "exp_avg_sq", "w")]["expectation"] == "bitwise"
    assert not unclipped[(1, "exp_avg_sq", "w")]["passed"]
    assert unclipped[(1, "scalar", "grad_norm")]["expectation"] == "bounded"


def test_old_traces_without_a_configuration_keep_their_policy():
    df = pd.DataFrame([_row(1, "activation", bitwise=False)])
    traces = _traces(None, None)
    assert ex.judge_rows(df, traces, policy=None).equals(df)


@pytest.mark.parametrize("n_ranks,micro_batches", [(4, 2), (8, 1), (2, 4)])
def test_the_sum_bound_holds_for_reordered_fp32_sums_and_not_for_a_bf16_rounding(n_ranks, micro_batches):
    """bf16 terms (wgrad GEMM outputs) summed in fp32 per micro-batch then over ranks (DDP) and
    over ranks per micro-batch then accumulated (GTP): every element within the bound; the
    peers' partial sum rounded to bf16 once more breaks it in most elements."""
    g = torch.Generator().manual_seed(n_ranks * 10 + micro_batches)
    terms = torch.randn(n_ranks, micro_batches, 4096, generator=g).bfloat16().float()
    ddp = torch.zeros(4096)
    for r in range(n_ranks):
        local = torch.zeros(4096)
        for m in range(micro_batches):
            local += terms[r, m]
        ddp += local / n_ranks
    gtp, gtp_bf16 = torch.zeros(4096), torch.zeros(4096)
    for m in range(micro_batches):
        peers = torch.zeros(4096)
        for r in reversed(range(n_ranks)):
            peers += terms[r, m] / n_ranks
        gtp += peers
        gtp_bf16 += peers.bfloat16().float()
    n = n_ranks * micro_batches
    bound = bounds.sum_reorder_bound(n, terms.double().abs().sum((0, 1)) / n_ranks, torch.float32)
    assert ((gtp.double() - ddp.double()).abs() <= bound).all()
    assert ((gtp_bf16.double() - ddp.double()).abs() > bound).float().mean() > 0.5


def test_matrix_when_records_the_bf16_gtp_divergence_on_exactly_those_scenarios():
    from harness import scenario
    from tests.helpers import ROOT

    known = {s.name: s.expect for s in scenario.load(ROOT / "scenarios/default.toml")}
    bf16_gtp = {n for n in known if "bf16" in n and "gtpoff" not in n}
    assert len(bf16_gtp) == 8 and {n for n, e in known.items() if e is not None} == bf16_gtp
    assert all(known[n].fixed_in == "e5542e85f2" and known[n].signature == "extra-rounding" for n in bf16_gtp)


@pytest.fixture(scope="module")
def precision_run(tmp_path_factory):
    from harness import scenario
    from harness.session import run_scenarios
    from tests.helpers import ASSETS

    out = tmp_path_factory.mktemp("precision")
    run_scenarios(scenario.load(ASSETS / "precision_faults.toml"), out, parallel=1)
    return out


FAULTS = ["gtp-rs-bf16", "distopt-grad-rs-bf16", "microbatch-accum-bf16", "adam-exp-avg-sq-bf16-gtp",
          "grad-reduce-bf16-ignored"]


@pytest.mark.multirank
@pytest.mark.parametrize("fault", FAULTS)
def test_a_precision_fault_breaks_its_expectation_where_the_noise_floor_passes_it(precision_run, fault):
    import fnmatch

    from harness.scenario.faults import CATALOG
    from tests.helpers import results, summary

    s = summary(precision_run, f"precision-{fault}")
    fd, expect = s["first_divergence"], CATALOG[fault].expect
    assert s["verdict"] == "fail"
    assert (fd["step"], fd["kind"], fd["signature"]) == (expect["step"], expect["kind"],
                                                         expect["signature"]), fd
    assert fnmatch.fnmatchcase(fd["tensor"], expect["tensor"]), fd
    # the narrower dtype is named: the extra rounding's, or the buffer's that ignored its configuration
    assert "bfloat16" in fd["explanation"] or fd.get("dtypes") == {"reference": "bfloat16",
                                                                   "candidate": "float32"}, fd
    df = results(precision_run, f"precision-{fault}")
    broken = df[~df["passed"].astype(bool)]
    assert set(broken["expectation"]) <= {"bitwise", "bounded"} and len(broken)
    # The scenario's noise-floor policy alone passes every tensor: the fault hides under it.
    assert df["policy_passed"].astype(bool).all()


@pytest.mark.multirank
def test_the_clean_baselines_hold_their_expectations_and_the_wheel_does_not(precision_run):
    from tests.helpers import results, summary

    for case in ("clean-1mb", "clean-2mb"):
        assert summary(precision_run, f"precision-{case}")["verdict"] == "pass"
    one = results(precision_run, "precision-clean-1mb")
    # One micro-batch per rank: every tensor of the step, the optimizer's state included, is
    # claimed bitwise (the grad norm: its consistency bound); two: the main_grads are bounded.
    assert set(one[one["kind"] != "scalar"]["expectation"]) == {"bitwise"}
    two = results(precision_run, "precision-clean-2mb")
    assert set(two[two["kind"] == "main_grad"]["expectation"]) == {"bounded"}
    wheel = summary(precision_run, "precision-wheel")
    assert wheel["verdict"] == "fail" and wheel["first_divergence"]["signature"] == "extra-rounding"
    er = wheel["first_divergence"]["extra_rounding"]
    # two terms per main_grad: 0.19.2's GTP value is exactly the GTP-off sum rounded to bf16
    assert (er["dtype"], er["pattern"], er["rounded"]) == ("bfloat16", "exact", "candidate"), er
