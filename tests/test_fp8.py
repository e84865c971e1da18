"""FP8 / FP4 recipes across GTP on the torch backend: the scenarios/fp8.toml matrix (5 recipes x
TP 1 / 2 x fp32 / bf16, GTP 2 vs off) passes with no false alarm, and the planted
fp8-unreduced-amax fault (tests/assets/fp8_fault.toml, fp32 and bf16) is localized. Both files
run in one session: one launch per world size."""

import fnmatch
import json
from pathlib import Path

import pytest

from harness import scenario
from harness.backends.faults import CATALOG
from harness.session import run_scenarios
from tests.helpers import ASSETS, ROOT, results, summary

pytestmark = pytest.mark.multirank

RECIPES = ["delayed", "current", "mxfp8", "block", "nvfp4"]
PRECISIONS = ["fp32", "bf16"]
CLEAN = [f"{r}-tp{tp}-{p}" for r in RECIPES for tp in (1, 2) for p in PRECISIONS]
FAULTS = [f"fault-fp8-unreduced-amax-{p}" for p in PRECISIONS]


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8")
    scenarios = scenario.load(ROOT / "scenarios/fp8.toml") + scenario.load(ASSETS / "fp8_fault.toml")
    code = run_scenarios(scenarios, out, parallel=2)
    doc = json.loads((out / "summary.json").read_text())
    assert code == 1, doc  # the planted fault fails, nothing else
    return out


def test_matrix_is_the_product_of_recipes_tp_and_precision():
    names = [s.name for s in scenario.load(ROOT / "scenarios/fp8.toml")]
    assert sorted(names) == sorted(CLEAN)
    for s in scenario.load(ROOT / "scenarios/fp8.toml"):
        assert s.reference.recipe == s.candidate.recipe != "none" and s.golden.recipe == "none"
        assert (s.reference.gtp, s.candidate.gtp) == (1, 2)
        assert s.reference.tp == s.candidate.tp and s.reference.world_size == s.candidate.world_size
        assert s.candidate.gtp_pad_alignment == (32 if s.candidate.recipe == "mxfp8" else 16)
        assert s.reference.precision == s.candidate.precision == s.axes["precision"]
        assert s.compare.k_at(1) == 1.25  # both sides read the same weights and inputs at step 1


def test_nightly_matrix_reuses_the_fp8_model_and_policy_with_gtp_4():
    short = {s.name: s for s in scenario.load(ROOT / "scenarios/fp8.toml")}
    nightly = scenario.load(ROOT / "scenarios/fp8_nightly.toml")  # its base's own [matrix] is not expanded
    assert len(nightly) == 5 * 4 * 2 and {s.candidate.gtp for s in nightly} == {2, 4}
    model = next(iter(short.values())).model
    for s in nightly:
        assert s.model == model and s.candidate.optimizer == "adam" and s.candidate.steps == 4
        twin = short[f"{s.axes['recipe']}-tp{s.candidate.tp}-{s.axes['precision']}"]
        assert s.compare == twin.compare and s.candidate.recipe == twin.candidate.recipe


@pytest.mark.parametrize("name", CLEAN)
def test_clean_scenario_passes(fp8_run, name):
    out = fp8_run
    assert summary(out, name)["verdict"] == "pass", summary(out, name)["first_divergence"]
    df = results(out, name)
    later = df[df["step"] > 0]
    # The quantized all-gather is exact and both sides run the same torch ops on the same shapes
    # (the gathered weight, pad stripped, has the GTP-off weight's shape): the step-1 forward is
    # bitwise the GTP-off one on any one machine. Later steps read weights updated from
    # gradients summed in another order, where each FP8 rounding near a boundary may flip: no
    # a-priori bound tighter than the policy's, which the verdict above applies.
    fwd = later[later["kind"].isin(["activation", "logits", "loss"]) & (later["step"] == 1)]
    assert len(fwd) and fwd["bitwise_equal"].all()
    if not name.endswith("fp32"):
        grads = later[(later["step"] == 1) & (later["kind"] == "main_grad")]
        assert not grads["bitwise_equal"].all()  # the bf16 reduce-scatter is visible, and tolerated
    # The grad norm is explained by the gradients whenever it is not bitwise equal.
    norms = later[(later["tensor"] == "grad_norm") & ~later["bitwise_equal"].astype(bool)]
    assert (norms["policy"] == "consistency").all()


def test_the_recipes_really_quantize(fp8_run):
    out = fp8_run
    err = {n: results(out, n).query("step == 1 and kind == 'logits'")["ref_err_golden"].item() for n in CLEAN}
    assert min(err.values()) > 1e-3  # FP8 error in the logits: 7e-3 to 3e-2 (fp32 alone: ~1e-6)
    for p in PRECISIONS:
        assert err[f"nvfp4-tp1-{p}"] > 2 * err[f"current-tp1-{p}"]  # E2M1 is coarser than E4M3
        assert err[f"delayed-tp1-{p}"] != err[f"current-tp1-{p}"]


@pytest.mark.parametrize("fault", FAULTS)
def test_planted_unreduced_amax_is_localized(fp8_run, fault):
    out = fp8_run
    s = summary(out, fault)
    fd, expect = s["first_divergence"], CATALOG["fp8-unreduced-amax"].expect
    assert s["verdict"] == "fail"
    keys = ("step", "kind", "signature")
    assert [fd[k] for k in keys] == [expect[k] for k in keys], fd
    assert fnmatch.fnmatchcase(fd["tensor"], expect["tensor"]), fd
    assert fd["tolerance"]["recipe"] == "float8_current_scaling"
    # The region names the sample holding the worst element and the ranks that read it.
    sample = fd["region"]["sample_id"]
    assert sample in range(4) and fd["ranks"] == [sample % 2]  # data rank d reads d, d + 2
    m = fd["metrics"]
    assert m["cand_err_golden"] > 1.25 * m["ref_err_golden"]  # beyond the FP8 noise floor (k = 1.25)
    df = results(out, fault)
    weights = df[df["kind"].isin(["materialized", "param_before"]) & (df["step"] == 1)]
    assert weights["bitwise_equal"].all()  # the high-precision weights are right; their FP8 copies are not


@pytest.mark.parametrize("fault", FAULTS)
def test_unreduced_amax_hides_inside_te_tolerances_and_k_4(fp8_run, fault, tmp_path):
    # Why the FP8 scenarios judge step 1 at k = 1.25: TE's own distributed-vs-single-process
    # tolerance for current scaling, and the default noise floor, both pass the faulty run.
    from harness.scenario.schema import ComparePolicy
    from harness.session import compare_traces

    paths = {role: Path(p) for role, p in summary(fp8_run, fault)["traces"].items()}
    for i, policy in enumerate([ComparePolicy(policy="dtype"), ComparePolicy(k=4.0)]):
        code = compare_traces(paths["reference"], paths["candidate"], paths["golden"], tmp_path / str(i),
                              policy)
        assert code == 0, policy
