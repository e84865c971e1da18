"""Differential test: the torch backend's GTP against megatron-core's GTP, same canonical
weights and data, fp32 (tests/assets/fp8_diff_fp32.toml) and bf16 with fp32 masters
(fp8_diff_bf16.toml, once scenario.py allows bf16 on the torch backend): TP1 G2 world 2,
TP2 G2 world 4, and DP 2 with GTP on and off at world 4. One run.

The two backends issue different ATen calls for the same math (``F.linear`` and autograd here,
megatron-core's own ``matmul`` forward and explicit wgrad/dgrad GEMMs there; ``matmul`` then a
division by sqrt(d_head) here, ``baddbmm`` with ``alpha`` there), so bitwise equality of what
they compute is not guaranteed on every CPU. What is: the copies (step-0 weights, inputs) are
bitwise equal, every computed tensor and scalar is within the compare policy, and the grad
norm within the rounding bound of two norms of the compared gradients."""

import json

import pytest

from harness import scenario
from harness.scenario import schema
from harness.capture import trace
from harness.session import run_scenarios
from tests.helpers import ASSETS, results, summary

pytestmark = pytest.mark.multirank

TOPOLOGIES = ["tp1-gtp2", "tp2-gtp2", "tp1-gtp2-dp2", "tp2-gtpoff-dp2"]
BF16 = "bf16" in schema.PRECISIONS["torch"]
NAMES = [f"diff-torch-vs-megatron-{t}" for t in TOPOLOGIES] + [
    pytest.param(f"diff-bf16-torch-vs-megatron-{t}", id=f"bf16-{t}",
                 marks=pytest.mark.skipif(not BF16, reason="scenario.py allows no bf16 on the torch backend"))
    for t in TOPOLOGIES
]


@pytest.fixture(scope="module")
def diff_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("diff")
    scenarios = scenario.load(ASSETS / "fp8_diff_fp32.toml")
    if BF16:
        scenarios += scenario.load(ASSETS / "fp8_diff_bf16.toml")
    code = run_scenarios(scenarios, out, parallel=2)
    assert code == 0, json.loads((out / "summary.json").read_text())
    return out


@pytest.mark.parametrize("name", NAMES)
def test_every_tensor_matches_megatron_core(diff_run, name):
    df = results(diff_run, name)
    assert summary(diff_run, name)["verdict"] == "pass"
    tensors = df[df["kind"] != "scalar"]
    kinds = {"param", "param_before", "materialized", "main_grad", "activation", "logits", "loss", "input"}
    assert kinds | ({"master"} if "bf16" in name else set()) <= set(tensors["kind"])
    assert len(tensors[tensors["kind"] == "main_grad"]) == 2 * 21  # every parameter, both steps
    assert tensors["passed"].astype(bool).all()
    # Copies, not computations: the same canonical weights and token ids on both sides.
    copies = tensors[(tensors["step"] == 0) | (tensors["kind"] == "input")]
    assert len(copies) and copies["bitwise_equal"].astype(bool).all()


@pytest.mark.parametrize("name", NAMES)
def test_scalars_within_policy_and_grad_norm_within_rounding(diff_run, name):
    scalars = results(diff_run, name).query("kind == 'scalar'")
    assert set(scalars["tensor"]) == {"reduced_loss", "grad_norm", "lr", "skipped"}
    assert scalars["passed"].astype(bool).all(), scalars[["step", "tensor", "policy", "bound"]]
    # Two norms of fp32 gradients, each within gamma_m of the exact norm (m from the model's
    # tensor sizes, count and ranks: harness.compare.bounds.norm_roundings), judged by the reverse
    # triangle inequality over the compared gradients (compare._grad_norm_consistency).
    norms = scalars[scalars["tensor"] == "grad_norm"]
    assert (norms["bitwise_equal"].astype(bool) | (norms["policy"] == "consistency")).all()
    # The LR is Python float arithmetic on the same integers on both sides: correctly rounded
    # IEEE doubles, the same on every machine (cos, from libm, is one function on one
    # machine for both); skipped is 0.
    assert scalars[scalars["tensor"].isin(["lr", "skipped"])]["bitwise_equal"].astype(bool).all()


@pytest.mark.parametrize("name", [NAMES[0], NAMES[1], NAMES[4]])
def test_same_capture_as_the_megatron_backend(diff_run, name):
    """Same kinds, canonical names, micro-batches, layouts, shard shapes and scalars, per rank."""
    traces = {r: trace.read(p) for r, p in summary(diff_run, name)["traces"].items()}
    ref, cand = traces["reference"], traces["candidate"]

    def entries(t):
        return sorted((e.rank, e.step, e.kind, e.name, e.micro_batch, e.sample_ids, e.local_shape, e.dtype,
                       str(e.layout.to_json()) if e.layout else None) for e in t.entries)

    assert entries(ref) == entries(cand)
    def scalars(t):
        return sorted((s["rank"], s["step"], s["name"], s.get("micro_batch"), str(s.get("sample_ids")))
                      for s in t.scalars)

    assert scalars(ref) == scalars(cand)
    for rank, info in ref.infos.items():
        assert set(cand.infos[rank]["gtp_params"]) == set(info["gtp_params"])
        assert cand.infos[rank]["data_parallel_rank"] == info["data_parallel_rank"]
        assert cand.infos[rank]["data_parallel_size"] == info["data_parallel_size"]
    # Zero counts include the GTP pad rows, as megatron-core counts them.
    def zeros(t):
        return {(s["rank"], s["step"]): s["value"] for s in t.scalars if s["name"] == "num_zeros"}

    assert zeros(ref) == zeros(cand) and zeros(ref)
