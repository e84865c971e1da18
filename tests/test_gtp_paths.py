"""GTP's other code paths on megatron-core's real code: the path options reach megatron-core,
the paths that hold pass against GTP off and the golden, and megatron-core's three known
divergences are reported as such, each naming its cause (``scenarios/gtp_paths.toml``)."""

from __future__ import annotations

import dataclasses
import json
import xml.etree.ElementTree as ET

import pandas as pd
import pytest
import torch

from harness import report
from harness import scenario
from harness.compare.outcome import judge_known_divergence
from harness.compare.summary import ScenarioSummary
from harness.session import run_scenarios
from helpers import ROOT

PATHS = ROOT / "scenarios" / "gtp_paths.toml"
KNOWN = {
    "recompute-full-prefetch-on": ("gemm-consumed-foreign-weight", "the recompute GEMM of "
                                   "decoder.layers.0.self_attention.linear_qkv.weight consumed "
                                   "decoder.layers.1.self_attention.linear_qkv.weight's weight"),
    "shared-buffer-prefetch-on": ("gemm-consumed-foreign-weight", "the forward GEMM of "
                                  "decoder.layers.0.mlp.linear_fc1.weight consumed "
                                  "decoder.layers.0.mlp.linear_fc2.weight's weight"),
    "per-token-loss-transformer-config": ("ratio-1/G", "the GTP mean was taken twice"),
    # Step 2: GTP's prefetch gathers shards DDP's overlapped param all-gather has not updated.
    "overlap-param-gather-prefetch-on": ("replica-drift", "a replicated tensor differs across ranks"),
}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    out = tmp_path_factory.mktemp("paths")
    code = run_scenarios(scenario.load(PATHS), out, parallel=2)
    doc = json.loads((out / "summary.json").read_text())
    return code, {s["scenario"]: s for s in doc["scenarios"]}, out


@pytest.mark.multirank
def test_paths_that_hold_pass_and_known_divergences_are_named(paths):
    code, by_name, _ = paths
    assert code == 0  # a known divergence that diverged as recorded does not fail the gate
    for name, s in by_name.items():
        if name not in KNOWN:
            assert s["verdict"] == "pass", (name, s.get("first_divergence"))
            continue
        signature, text = KNOWN[name]
        fd = s["first_divergence"]
        assert s["verdict"] == "known-divergence", (name, s.get("expectation"))
        assert (fd["step"] == s["expect"]["step"] and fd["signature"] == signature
                and text in fd["explanation"])
        assert "generalized_tensor_parallelism.py" in s["expect"]["reason"]


@pytest.mark.multirank
def test_grad_reduce_in_bf16_reaches_ddp(paths):
    """grad_reduce_in_fp32 = false: DDP keeps main_grad (and reduces it) in bf16 on both sides,
    where every other bf16 side's main_grads are fp32."""
    _, by_name, out = paths
    assert by_name["grad-reduce-bf16"]["verdict"] == "pass"
    rows = pd.read_csv(out / "scenarios" / "grad-reduce-bf16" / "results.csv")
    grads = rows[rows["kind"] == "main_grad"]
    assert len(grads) and set(grads["dtype"]) == {"bfloat16"}


@pytest.mark.multirank
def test_known_divergences_are_expected_failures_in_junit_and_report(paths, tmp_path):
    _, by_name, out = paths
    cases = {c.get("name"): c
             for c in ET.parse(report.write_junit(out, tmp_path / "j.xml")).getroot().iter("testcase")}
    for name in by_name:
        skipped = cases[name].find("skipped")
        assert (skipped is not None and skipped.get("type") == "known-divergence") == (name in KNOWN)
        assert cases[name].find("failure") is None
    index = report.write_index(out, tmp_path / "rep").read_text()
    assert index.count('class="known-divergence"') >= len(KNOWN)
    page = (tmp_path / "rep" / "scenarios" / "recompute-full-prefetch-on.html").read_text()
    assert "KNOWN DIVERGENCE" in page and "all_gather_and_prefetch" in page


@pytest.mark.multirank
def test_distributed_optimizer_state_is_the_local_optimizers_bit_for_bit(paths):
    """GTP 2, local vs distributed optimizer, fp32, no clipping: each state tensor is put
    together from the data-parallel ranks' ranges. Bitwise is guaranteed here, not observed:
    the replicate-DP group has 2 ranks and a sum of two terms is the same in either order
    (all-reduce vs reduce-scatter), and Adam is element-wise."""
    import pandas as pd

    _, by_name, out = paths
    rows = pd.read_csv(out / "scenarios" / "distributed-vs-local-optimizer" / "results.csv")
    assert by_name["distributed-vs-local-optimizer"]["verdict"] == "pass"
    for kind in ("exp_avg", "exp_avg_sq", "main_grad", "param"):
        mine = rows[rows["kind"] == kind]
        assert len(mine) and mine["bitwise_equal"].astype(bool).all(), kind


def _doc(verdict: str, signature: str | None = None, step: int = 1) -> dict:
    fd = {"step": step, "signature": signature} if signature else None
    return {"verdict": verdict, "first_divergence": fd}


@pytest.mark.parametrize(("doc", "expect", "verdict"), [
    (_doc("fail", "ratio-1/G"), {"signature": "ratio-1/G", "step": 1}, "known-divergence"),
    (_doc("fail", "ratio-G"), {"signature": "ratio-1/G"}, "fail"),  # diverged otherwise
    (_doc("fail", "ratio-1/G", step=2), {"signature": "ratio-1/G", "step": 1}, "fail"),
    (_doc("pass"), {"signature": "ratio-1/G"}, "fail"),  # fixed upstream: the record must go
    (_doc("fail", "mismatch"), {}, "known-divergence"),  # any divergence, as recorded
    (_doc("pass"), None, "pass"),
])
def test_a_known_divergence_gates_on_change(doc, expect, verdict):
    exp = None if expect is None else scenario.KnownDivergence(reason="file:function:line", **expect)
    before = ScenarioSummary.from_json(doc)
    after = judge_known_divergence(before, exp)
    assert after.verdict == verdict
    assert ("expectation" in after.to_json()) == (verdict == "fail")
    assert before == ScenarioSummary.from_json(doc)  # a new summary: the judged one is unchanged


def test_variable_loss_mask_gives_every_sample_its_own_token_count():
    """What makes a wrong normalization show: the samples of a step count different numbers
    of tokens (1..seq_length), and the same sample the same number on every side."""
    from harness.backends import data as data_mod

    sc = next(s for s in scenario.load(PATHS) if s.name == "per-token-loss-variable-length")
    ids = data_mod.step_sample_ids(1, sc.data)
    counts = data_mod.loss_mask(sc.data, ids, sc.model.seq_length).sum(1)
    assert len(set(counts.tolist())) > 1 and counts.min() >= 1 and counts.max() <= sc.model.seq_length
    again = data_mod.loss_mask(sc.data, ids[::-1], sc.model.seq_length).sum(1)
    assert torch.equal(again, counts.flip(0))


def test_nightly_paths_hold_the_controls_of_the_param_gather_divergence():
    """The divergence's two controls (prefetch off, one DDP bucket) differ from it in exactly
    the one switch each names, so a pass of both points at GTP's prefetch across buckets."""
    main = {s.name: s for s in scenario.load(PATHS)}
    nightly = {s.name: s for s in scenario.load(ROOT / "scenarios" / "gtp_paths_nightly.toml")}
    known = main["overlap-param-gather-prefetch-on"].candidate
    assert known.overlap_param_gather and known.gtp_weight_prefetch and known.bucket_size
    off = nightly["overlap-param-gather-prefetch-off"].candidate
    one = nightly["overlap-param-gather-one-bucket"].candidate
    assert off == dataclasses.replace(known, gtp_weight_prefetch=False)
    assert one == dataclasses.replace(known, bucket_size=None)
    assert all(s.expect is None for s in nightly.values())


def test_an_overlapped_param_gather_s_weights_are_recorded_when_the_forward_reads_them():
    # GTP off with overlap_param_gather: the distributed optimizer's step writes only this rank's
    # range; DDP's forward pre-hook all-gathers the rest before the module's GEMM. A weight recorded
    # at the start of the step mixes updated and pre-step rows (a replica-drift of our own, fuzz
    # finding fuzz-1-c7); recorded after its module's forward it is what the GEMM read.
    from harness.backends.recording import Materialized

    class Cap:
        def __init__(self):
            self.got = {}

        def wants(self, kind, name=""):
            return True

        def tensor(self, kind, name, value, layout):
            self.got[name] = value.detach().clone()

    lin = torch.nn.Linear(3, 2, bias=False)
    stale, gathered = torch.zeros(2, 3), torch.arange(6.0).view(2, 3)

    def all_gather(*_):  # DDP's forward pre-hook finishing the param all-gather
        lin.weight.data.copy_(gathered)

    lin.register_forward_pre_hook(all_gather)
    for at_forward, want in ((False, stale), (True, gathered)):
        cap = Cap()
        lin.weight.data.copy_(stale)
        mat = Materialized(cap, {"w": None}, [("w", lin.weight)])
        if at_forward:
            mat.at_forward(lin.modules())
        mat.begin_step()
        x = torch.ones(1, 3)
        assert torch.equal(lin(x), x @ gathered.T)  # the module's output is left as it is
        lin(x)  # a second micro-batch records nothing more
        assert torch.equal(cap.got["w"], want)
