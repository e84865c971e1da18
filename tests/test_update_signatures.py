"""The optimizer-phase judgement: updates compared by their structure (update-term), and
precision-loss named only where the candidate has a precision mechanism."""

import fnmatch
from types import SimpleNamespace

import pytest
import torch

from harness import scenario
from harness.scenario.faults import CATALOG
from harness.compare.localize import _StepContext
from harness.compare.updates import FACTOR_MIN, FIT_RESIDUAL, update_term
from tests.helpers import ASSETS, run, summary

UPDATE_FAULTS = sorted({f for s in scenario.load(ASSETS / "update_faults.toml") for f in s.candidate.inject})
NEW_SIGNATURES = {"update-term", "precision-loss"}


def _weights(seed=0, n=(16, 8)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*n, generator=g, dtype=torch.float64), torch.randn(*n, generator=g,
                                                                          dtype=torch.float64)


def test_a_scaled_update_is_a_factor():
    p, grad = _weights()
    ref_after = p - 0.1 * grad
    term = update_term(p, ref_after, p, p - 0.05 * grad)
    assert term["kind"] == "factor" and term["factor"] == pytest.approx(0.5, rel=1e-12)
    assert term["text"] == "update scaled by 0.5"


def test_a_missing_weight_decay_is_the_lr_wd_param_term():
    p, grad = _weights(1)
    lr, wd = 0.05, 0.1
    ref_after = p - lr * (grad + wd * p)  # SGD with decay
    term = update_term(p, ref_after, p, p - lr * grad, lr=lr, wd=wd)
    assert term["kind"] == "param-term" and term["coefficient"] == pytest.approx(lr * wd, rel=1e-9)
    assert "+lr*wd*param" in term["text"]
    twice = update_term(p, ref_after, p, p - lr * (grad + 2 * wd * p), lr=lr, wd=wd)
    assert "-lr*wd*param" in twice["text"]


def test_an_unstructured_difference_has_no_term():
    p, grad = _weights(2)
    _, other = _weights(3)
    assert update_term(p, p - 0.1 * grad, p, p - 0.1 * other) is None
    # a factor within FACTOR_MIN of 1 is not a structure; an update that did not land is
    # stale-update's, not this judgement's
    assert update_term(p, p - 0.1 * grad, p, p - 0.1 * (1 + FACTOR_MIN / 2) * grad) is None
    assert update_term(p, p - 0.1 * grad, p, p.clone()) is None
    assert FIT_RESIDUAL < 1


def _traces(cand_precision, ref_precision="fp32"):
    def t(precision):
        return SimpleNamespace(manifest={"precision": precision, "train": {"weight_decay": 0.1}},
                               scalars=[{"name": "lr", "step": 1, "rank": 0, "value": 0.05}])
    return {"candidate": t(cand_precision), "reference": t(ref_precision)}


@pytest.mark.parametrize("cand,ref,recipe,mechanism", [
    ("fp32", "fp32", "none", False),   # a logic error however small, never precision loss
    ("bf16", "bf16", "none", True),    # bf16 reductions round
    ("bf16", "fp32", "none", True),
    ("fp32", "fp32", "mxfp8", True),   # a recipe quantizes
])
def test_precision_loss_needs_a_mechanism(cand, ref, recipe, mechanism):
    ctx = _StepContext.of(_traces(cand, ref), 1, recipe)
    assert ctx.precision_mechanism is mechanism
    assert (ctx.lr, ctx.wd) == (0.05, 0.1)



@pytest.fixture(scope="module")
def update_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("update-faults")
    code, doc = run(ASSETS / "update_faults.toml", out, parallel=2)
    assert code == 1, doc
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("fault", UPDATE_FAULTS)
def test_update_faults_are_update_terms(update_run, fault):
    fd = summary(update_run, f"update-{fault}")["first_divergence"]
    expect = CATALOG[fault].expect
    assert (fd["step"], fd["kind"], fd["signature"]) == (expect["step"], expect["kind"],
                                                         expect["signature"]), fd
    assert fnmatch.fnmatchcase(fd["tensor"], expect["tensor"]), fd
    sc = next(s for s in scenario.load(ASSETS / "update_faults.toml") if s.name == f"update-{fault}")
    lr, wd = sc.candidate.lr, sc.candidate.weight_decay
    if fault == "gtp-update-lr-mult":
        # Within FIT_RESIDUAL of the planted factor (the fit's own acceptance bound).
        assert fd["update"]["factor"] == pytest.approx(0.5, rel=FIT_RESIDUAL)
    else:
        assert fd["update"]["coefficient"] == pytest.approx(lr * wd, rel=FIT_RESIDUAL)
        assert "weight decay not applied" in fd["update"]["text"]


@pytest.mark.multirank
def test_clean_bf16_produces_no_update_or_precision_signature(tmp_path):
    code, doc = run(ASSETS / "clean_bf16.toml", tmp_path, parallel=2)
    for s in doc["scenarios"]:
        fd = s.get("first_divergence") or {}
        assert fd.get("signature") not in NEW_SIGNATURES, fd
        assert s["verdict"] == "pass", s


def test_extra_rounding_names_the_narrower_dtype_and_the_rounded_side():
    """fp32 sums of two bf16 terms against the same sums rounded to bf16 (a reduce-scatter in
    bf16): each value differs by at most half a bf16 ULP, and only one side is bf16-exact."""
    from harness.compare.signatures import extra_rounding

    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(64, 48, generator=g).bfloat16().float() for _ in range(2))
    exact = a + b  # exact in fp32: two bf16 values of nearby exponents
    rounded = exact.bfloat16().float()
    found = extra_rounding(exact, rounded)
    assert found["dtype"] == "bfloat16" and found["rounded"] == "candidate" and found["pattern"] == "exact"
    assert found["elements"] == int((exact != rounded).sum()) and found["median_ulps"] <= 0.5
    assert extra_rounding(rounded, exact)["rounded"] == "reference"
    # rounded partial sums added in fp32 (a bf16 reduce-scatter, then an fp32 all-reduce)
    c, d = (torch.randn(64, 48, generator=g).bfloat16().float() for _ in range(2))
    fp32, partial = exact + (c + d), rounded + (c + d).bfloat16().float()
    found = extra_rounding(fp32, partial)
    assert (found["dtype"], found["pattern"], found["rounded"]) == ("bfloat16", "ulp-scale", "candidate")
    # fp16 has 3 more mantissa bits: rounding to it is not bf16's pattern and is named as fp16
    assert extra_rounding(exact, exact.half().float())["dtype"] == "float16"
    # not it: both sides bf16-exact, or a difference larger than a few bf16 ULPs
    assert extra_rounding(rounded, (rounded * 1.5).bfloat16().float()) is None
    assert extra_rounding(exact, (exact * 1.01).bfloat16().float()) is None
    assert extra_rounding(exact, exact + 1e-7) is None
    # fp32 noise of another summation order: far below a bf16 ULP
    assert extra_rounding(fp32, (a + c) + (b + d)) is None
    # rounded partial sums, but a few elements wrong by their own size (misplaced ranges)
    broken = partial.clone()
    broken[:4] = -broken[:4]
    assert extra_rounding(fp32, broken) is None
    # wrong rows of values below fp16's normal range (Adam's second moments, ~1e-8): not fp16's ULPs
    small = exact.double().abs() * 1e-8
    assert extra_rounding(small, torch.cat([small[:32], small[33:], small[32:33]])) is None


def test_a_shape_mismatch_of_a_per_sample_tensor_is_named_without_its_sample_ids():
    """A per-sample activation whose two sides' shapes differ (a capture layout the harness got wrong)
    has a row with no sample ids (NaN in the table): named ``mismatch`` with its shapes in the row, never
    a crash of the signature (an MTP depth's re-embedding under sequence parallelism once did this)."""
    from types import SimpleNamespace

    import pandas as pd

    from harness.compare.localize import _signature

    key = (1, "activation", "embedding")
    logical = {"reference": SimpleNamespace(tensors={}, samples={key: {0: torch.zeros(16, 4)}}),
               "candidate": SimpleNamespace(tensors={}, samples={key: {0: torch.zeros(8, 4)}})}
    first = {"step": 1, "kind": "activation", "tensor": "embedding", "policy": "shape",
             "sample_ids": float("nan"), "detail": "shape (1, 16, 4) vs (1, 8, 4)"}
    assert _signature(first, pd.DataFrame([first]), logical, {"tp": 2}, key) == ("mismatch", {})
