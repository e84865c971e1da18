"""Differential test: the torch backend's GTP against megatron-core's GTP, fp32, same canonical
weights and data (tests/assets/fp8_diff_fp32.toml: TP1 G2 world 2, TP2 G2 world 4, and DP 2
with GTP on and off at world 4). One run; every figure below was measured bitwise."""

import pytest

from harness import trace
from tests.helpers import ASSETS, results, run, summary

pytestmark = pytest.mark.multirank

TOPOLOGIES = ["tp1-gtp2", "tp2-gtp2", "tp1-gtp2-dp2", "tp2-gtpoff-dp2"]
NAMES = [f"diff-torch-vs-megatron-{t}" for t in TOPOLOGIES]


@pytest.fixture(scope="module")
def diff_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("diff")
    code, doc = run(ASSETS / "fp8_diff_fp32.toml", out, parallel=2)
    assert code == 0, doc
    return out


@pytest.mark.parametrize("name", NAMES)
def test_every_tensor_bitwise_equal_to_megatron_core(diff_run, name):
    df = results(diff_run, name)
    assert summary(diff_run, name)["verdict"] == "pass"
    tensors = df[df["kind"] != "scalar"]
    kinds = set(tensors["kind"])
    assert {"param", "param_before", "materialized", "main_grad", "activation", "logits", "loss", "input"} <= kinds
    assert len(tensors[tensors["kind"] == "main_grad"]) == 2 * 21  # every parameter, both steps
    assert tensors["bitwise_equal"].all(), tensors[~tensors["bitwise_equal"].astype(bool)][["step", "kind", "tensor"]]


@pytest.mark.parametrize("name", NAMES)
def test_scalars_within_two_ulp(diff_run, name):
    # The grad norm is the one value not bitwise equal: summed in fp64 here, in fp32 by
    # megatron-core's multi-tensor L2 norm (1-2 fp32 ULP apart at step 2).
    scalars = results(diff_run, name).query("kind == 'scalar'")
    assert set(scalars["tensor"]) == {"reduced_loss", "grad_norm", "lr", "skipped"}
    assert scalars["scaled_ulp"].max() <= 2, scalars[["step", "tensor", "scaled_ulp"]]
    assert scalars[scalars["tensor"] != "grad_norm"]["bitwise_equal"].all()


@pytest.mark.parametrize("name", NAMES[:2])
def test_same_capture_as_the_megatron_backend(diff_run, name):
    """Same kinds, canonical names, micro-batches, layouts, shard shapes and scalars, per rank."""
    traces = {r: trace.read(p) for r, p in summary(diff_run, name)["traces"].items()}
    ref, cand = traces["reference"], traces["candidate"]

    def entries(t):
        return sorted((e.rank, e.step, e.kind, e.name, e.micro_batch, e.sample_ids, e.local_shape, e.dtype,
                       str(e.layout.to_json()) if e.layout else None) for e in t.entries)  # fmt: skip

    assert entries(ref) == entries(cand)
    names = lambda t: sorted({(s["rank"], s["step"], s["name"], s.get("micro_batch")) for s in t.scalars})  # noqa: E731
    assert names(ref) == names(cand)
    for rank, info in ref.infos.items():
        assert set(cand.infos[rank]["gtp_params"]) == set(info["gtp_params"])
        assert cand.infos[rank]["data_parallel_rank"] == info["data_parallel_rank"]
        assert cand.infos[rank]["data_parallel_size"] == info["data_parallel_size"]
    steps = {(s["rank"], s["step"], s["name"]): s["value"] for s in cand.scalars}
    ref_steps = {(s["rank"], s["step"], s["name"]): s["value"] for s in ref.scalars}
    assert {k: v for k, v in steps.items() if k[2] == "num_zeros"} == \
           {k: v for k, v in ref_steps.items() if k[2] == "num_zeros"}  # pad rows counted as MCore counts them
