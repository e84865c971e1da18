"""Planted faults: the localizer names the right step, phase, tensor, ranks and signature."""

import fnmatch
import json
import os
import subprocess
import sys

import pytest

from harness import cli
from harness import scenario
from harness.scenario.faults import (
    ARCH_FAULTS, EVAL_FAULTS, GROUP_FAULTS, MOE_FAULTS, MTP_FAULTS, MUON_FAULTS, PRECISION_FAULTS,
    VERDICT_FAULTS,
)
from harness.backends.faults import CATALOG
from tests.helpers import ASSETS, ROOT, run, summary

# The faults the megatron fault matrix plants (the FP8 one is planted in tests/test_fp8.py).
MENDS = {"backport-gtp-wgrad-fp32", "patch-gtp-embedding-wgrad-fp32"}  # no faults: the baseline of a bf16 one
PLANTED = sorted({f for s in scenario.load(ASSETS / "faults.toml") for f in s.candidate.inject} - MENDS)
# The optimizer param-group faults need weight decay: tests/test_update_signatures.py plants them.
UPDATE_FAULTS = sorted({f for s in scenario.load(ASSETS / "update_faults.toml") for f in s.candidate.inject})

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def fault_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("faults")
    code, doc = run(ASSETS / "faults.toml", out, parallel=2)
    assert code == 1, doc  # every scenario fails: each plants a fault
    return out


def test_every_megatron_fault_is_planted():
    # The MoE faults need an MoE model: tests/test_moe.py plants them; the FP8 fault is planted in
    # tests/test_fp8.py, the pipeline one in tests/test_pipeline.py, the checkpoint ones in
    # tests/test_checkpoint.py and tests/test_checkpoint_parallel.py; the precision faults (one bf16
    # rounding each, and the backport they are planted against) in tests/test_expectations.py, whose
    # per-tensor expectations catch them; the Muon faults (optimizer = "muon") in tests/test_muon.py;
    # the MTP faults need an MTP model: tests/test_mtp_runs.py; the process-group ones a caller's
    # collection: tests/test_process_groups.py; the evaluation's faults an evaluating side:
    # tests/test_eval.py; the faults at a verdict's edges (a NaN, a crash of the code under test)
    # tests/test_verdict_edges.py; the architecture switches' faults (a bias, a gated fc1, GQA) a model
    # with those switches: tests/test_arch_faults.py.
    elsewhere = {"fp8-unreduced-amax", "pp-swap-microbatch-grads", "ckpt-pad-rows-as-data",
                 "ckpt-expert-index-shifted", "ckpt-stage-layers-mirrored"}
    for family in (MOE_FAULTS, PRECISION_FAULTS, MUON_FAULTS, MTP_FAULTS, GROUP_FAULTS, EVAL_FAULTS,
                   VERDICT_FAULTS, ARCH_FAULTS):
        elsewhere |= set(family)
    assert set(PLANTED) | set(UPDATE_FAULTS) == set(CATALOG) - elsewhere


@pytest.mark.parametrize("fault", PLANTED)
def test_first_divergence_matches_the_planted_fault(fault_run, fault):
    s = summary(fault_run, f"fault-{fault}")
    fd = s["first_divergence"]
    expect = CATALOG[fault].expect
    assert s["verdict"] == "fail"
    assert fd["step"] == expect["step"], fd
    assert fd["kind"] == expect["kind"], fd
    assert fnmatch.fnmatchcase(fd["tensor"], expect["tensor"]), fd
    assert fd["signature"] == expect["signature"], fd


def test_fault_specifics(fault_run):
    fd = {f: summary(fault_run, f"fault-{f}")["first_divergence"] for f in PLANTED}
    # Backward runs in reverse layer order: the output layer's gradient is reduced first.
    assert fd["gtp-rs-no-prescale"]["tensor"] == "output_layer.weight"
    assert fd["gtp-rs-no-prescale"]["phase"] == "backward"
    swap = fd["gtp-ag-swap-shards"]
    assert swap["tensor"] == "embedding.word_embeddings.weight" and swap["phase"] == "weights"
    assert swap["permutation"]["permutation"] == [1, 0]
    drift = fd["gtp-ln-grad-not-reduced"]
    assert drift["tensor"].endswith("layernorm.bias") and sorted(drift["ranks"]) == [0, 1]
    leak = fd["gtp-pad-leak"]
    assert leak["ranks"] == [1] and leak["region"]["rows"][1] == 96  # last GTP rank, padded rows
    assert (fd["gtp-peers-same-sample"]["region"]["duplicated"]
            and fd["gtp-peers-same-sample"]["region"]["missing"])
    assert fd["optimizer-skips-weight"]["phase"] == "optimizer"
    assert fd["loss-report-wrong-group"]["phase"] == "loss"
    assert fd["grad-norm-double-count"]["norm_ratio"] > 1
    # Per-token loss with GTP's pre-scale still on: every GTP weight, on every rank, halved.
    assert fd["gtp-prescale-under-per-token-loss"]["ranks"] == [0, 1]
    assert fd["microbatch-grad-overwrite"]["phase"] == "backward"
    # GTP's other code paths: each where the catalogue puts it, phase included.
    for fault in ("token-count-without-gtp-peers", "gtp-prefetch-missing-wait",
                  "gtp-wgrad-rs-finalized-twice",
                  "distopt-offsets-ignore-gtp-pad"):
        assert fd[fault]["phase"] == CATALOG[fault].expect["phase"], (fault, fd[fault])
    # A skipped wait: the GEMM of layers.1's qkv read layers.0's, the shared buffer's previous weight.
    said = fd["gtp-prefetch-missing-wait"]["explanation"]
    assert "consumed decoder.layers.0.self_attention.linear_qkv.weight's weight" in said
    # Only the last GTP rank holds pad rows, so only its shards of the optimizer's ranges move.
    assert fd["distopt-offsets-ignore-gtp-pad"]["region"]["shard"] == {"gtp": 1}


def test_planted_faults_leave_installed_code_untouched(fault_run):
    # Each fault patches in the worker and undoes it; a clean side in the same launch passed.
    s = summary(fault_run, "fault-gtp-rs-no-prescale")
    assert s["checked"]["param"] > 0 and s["invariants"]["replica"] == []


# Permuted blocks are localized by re-reading tensors after the split; pad rows come from the
# invariant violations the workers found (the ranks' gather is the same JSON: one case).
@pytest.mark.parametrize(("fault", "splits"),
                         [("gtp-ag-swap-shards", ("jobs", "ranks")), ("gtp-pad-leak", ("jobs",))])
def test_compare_split_over_jobs_and_ranks_gives_one_process_summary(fault_run, fault, splits, tmp_path):
    """``--jobs 2`` (worker processes) and ``torchrun --nproc-per-node 2`` (ranks, rows
    gathered as JSON over gloo) write the same summary.json and results.csv as one process."""
    paths = summary(fault_run, f"fault-{fault}")["traces"]
    args = ["compare", paths["reference"], paths["candidate"], "--golden", paths["golden"]]
    out = {split: tmp_path / split / "cmp" for split in ("one", "jobs", "ranks")}  # same name: same summary
    assert cli.main([*args, "--out", str(out["one"])]) == 1
    assert cli.main([*args, "--out", str(out["jobs"]), "--jobs", "2"]) == 1
    if "ranks" in splits:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                    "harness"]
        done = subprocess.run([*torchrun, *args, "--out", str(out["ranks"])], env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 1, done.stderr[-2000:]
    one = json.loads((out["one"] / "summary.json").read_text())
    assert one["first_divergence"] == summary(fault_run, f"fault-{fault}")["first_divergence"]
    for split in splits:
        for name in ("summary.json", "results.csv"):
            assert (out[split] / name).read_bytes() == (out["one"] / name).read_bytes(), (split, name)
