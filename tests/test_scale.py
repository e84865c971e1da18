"""The scale check in the suite: the 25.2M-parameter GPT of scenarios/scale_nightly.toml (hidden
512, FFN 4096, 4 layers, vocab 4096, seq 128), GTP 2 vs GTP off on two ranks, fp32 and bf16,
against the fp64 golden. A correct pair must pass at this size (the grad norm sums
4.2M-element tensors: the bounds must hold where rounding grows with n), and a planted fault
must still be localized where the tiny models localize it. One run: the clean and planted
scenarios share their reference and golden sides."""

import dataclasses
import fnmatch
import math
import shutil

import pytest

from harness import scenario
from harness.scenario.faults import CATALOG
from harness.backends.gpt import param_specs
from harness.scenario.planting import plant
from harness.session import run_scenarios
from tests.helpers import ROOT, results, summary

SCALE = ROOT / "scenarios" / "scale_nightly.toml"
PLANTED = {"fp32": "gtp-rs-no-prescale", "bf16": "gtp-ag-swap-shards"}
MENDED = ("backport-gtp-wgrad-fp32", "patch-gtp-embedding-wgrad-fp32")


@pytest.fixture(scope="module")
def scale_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("scale")
    clean = scenario.load(SCALE)
    planted = [dataclasses.replace(f, name=f"{s.name}-{PLANTED[s.candidate.precision]}")
               for s in clean for f in plant([s], [PLANTED[s.candidate.precision]])]
    # bf16 with GTP's wgrad reduce-scattered in fp32 (the wheel's known divergence mended):
    # what the derived expectations must pass at this size.
    mended = [dataclasses.replace(f, name=f"{s.name}-{MENDED[0]}", expect=None)
              for s in clean if s.candidate.precision == "bf16" for f in plant([s], list(MENDED))]
    run_scenarios([*clean, *planted, *mended], out, parallel=1)
    yield out, clean
    shutil.rmtree(out, ignore_errors=True)  # ~8 GB of traces: not left for pytest to keep


@pytest.mark.multirank
def test_the_scale_model_is_at_least_25m_parameters():
    (s, *_) = scenario.load(SCALE)
    assert sum(math.prod(p.shape) for p in param_specs(s.model)) >= 25_000_000


@pytest.mark.multirank
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_correct_pair_passes_at_scale(scale_run, precision):
    out, clean = scale_run
    (s,) = [s for s in clean if s.candidate.precision == precision]
    name = s.name if precision == "fp32" else f"{s.name}-{MENDED[0]}"
    doc = summary(out, name)
    assert doc["verdict"] == "pass", doc.get("first_divergence")
    df = results(out, name)
    # The derived expectations hold at this size: the step-1 forward and gradients bitwise (two
    # terms per sum), nothing judged by the noise floor at step 1 but what follows the grad norm.
    step1 = df[(df["step"] == 1) & df["kind"].isin(["activation", "logits", "loss", "main_grad"])]
    assert set(step1["expectation"]) == {"bitwise"}
    # Every weight's gradient was judged at both steps, and the grad norm by its consistency
    # with them (the bound that must grow with the number of summed elements).
    assert (df["kind"] == "main_grad").sum() == 2 * len(param_specs(s.model))
    norm = df[(df["kind"] == "scalar") & (df["tensor"] == "grad_norm")]
    assert len(norm) == 2 and set(norm["policy"]) == {"consistency"} and norm["passed"].all()


@pytest.mark.multirank
def test_the_wheels_bf16_reduce_scatter_is_the_known_divergence_at_scale(scale_run):
    out, clean = scale_run
    (s,) = [s for s in clean if s.candidate.precision == "bf16"]
    doc = summary(out, s.name)
    assert doc["verdict"] == "known-divergence" and doc["first_divergence"]["signature"] == "extra-rounding"


@pytest.mark.multirank
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_planted_fault_is_localized_at_scale(scale_run, precision):
    out, clean = scale_run
    (s,) = [s for s in clean if s.candidate.precision == precision]
    fault = PLANTED[precision]
    doc = summary(out, f"{s.name}-{fault}")
    fd, expect = doc["first_divergence"], CATALOG[fault].expect
    assert doc["verdict"] == "fail"
    assert (fd["step"], fd["kind"], fd["signature"]) == (expect["step"], expect["kind"],
                                                         expect["signature"]), fd
    assert fnmatch.fnmatchcase(fd["tensor"], expect["tensor"]), fd
