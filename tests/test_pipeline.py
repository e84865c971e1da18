"""Pipeline parallelism on megatron-core's real schedules: PP 2 (1F1B over 4 micro-batches) and
PP 2 x VPP 2 (interleaved) against PP 1 and the golden, each stage recording what it computes
under global layer names, and a micro-batch gradient paired with the wrong micro-batch
localized to its stage.

The 4-rank pairs (PP 2 x GTP 2 against PP 1 x GTP off, bf16, Adam, PP 2 x TP 2) are in the
nightly matrix ``scenarios/pipeline.toml``."""

from __future__ import annotations

import dataclasses
import fnmatch
import json

import pytest

from harness import scenario
from harness.capture import trace
from harness.backends.megatron.pipeline import global_name, owned, stage_layers
from harness.common.errors import BadInput
from harness.scenario.faults import CATALOG, check_reach
from harness.backends.gpt import param_specs
from harness.scenario.matrix import read_toml
from harness.scenario.planting import plant
from harness.session import run_scenarios
from helpers import ASSETS, assert_grads_differ_by_order_only, results, summary

TINY = ASSETS / "pipeline_tiny.toml"
FAULT = "pp-swap-microbatch-grads"


@pytest.fixture(scope="module")
def pp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline")
    (clean,) = scenario.load(TINY)
    (faulty,) = plant([clean], [FAULT])
    faulty = dataclasses.replace(faulty, name=f"{clean.name}-{FAULT}")
    code = run_scenarios([clean, faulty, _interleaved()], out, parallel=2)
    return code, out, clean, faulty


def _interleaved() -> scenario.Scenario:
    """The fast pair interleaved: 4 layers, 2 model chunks per stage (layers 0, 2 | 1, 3)."""
    raw = read_toml(TINY)
    raw["name"] = "vpp2-pp2-vs-pp1-tiny"
    raw["model"]["num_layers"] = 4
    raw["candidate"]["virtual_pipeline"] = 2
    return scenario.parse_scenario(raw, str(TINY))


def _index(path, rank: int) -> dict:
    return json.loads((path / f"rank{rank}" / "index.json").read_text())


@pytest.mark.multirank
def test_pp2_matches_pp1_and_the_golden(pp_run):
    code, out, clean, _ = pp_run
    assert code == 1  # the planted scenario fails; the clean one must pass
    s = summary(out, clean.name)
    assert s["verdict"] == "pass", s["first_divergence"]
    assert not s["invariants"]["replica"] and not s["invariants"]["padding"]


@pytest.mark.multirank
def test_each_stage_records_what_it_computes_under_global_names(pp_run):
    _, out, clean, _ = pp_run
    path = trace.read(summary(out, clean.name)["traces"]["candidate"]).path
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["mesh"] == {"tp": 1, "gtp": 1, "dp": 1, "pp": 2}
    first, last = _index(path, 0), _index(path, 1)

    def names(index, kind):
        return {e["name"] for e in index["tensors"] if e["step"] == 1 and e["kind"] == kind}

    assert names(first, "activation") >= {"embedding", "decoder.layers.0", "decoder.layers.0.mlp"}
    assert not any(n.startswith("decoder.layers.1") for n in names(first, "activation"))
    assert names(last, "activation") >= {"decoder.layers.1", "decoder.final_layernorm"}
    assert names(last, "logits") == {"output_layer"} and not names(first, "logits")
    assert names(first, "main_grad") == owned([p.name for p in param_specs(clean.model)], 2, 2, 0)
    # Losses exist on the last stage; the logged loss is broadcast to the first (read there).
    losses = [s for s in last["scalars"] if s["name"] == "loss" and s["step"] == 1]
    assert len(losses) == clean.candidate.num_microbatches(clean.data) == 4
    assert not [s for s in first["scalars"] if s["name"] == "loss"]
    reduced = [{s["step"]: s["value"] for s in ix["scalars"] if s["name"] == "reduced_loss"}
               for ix in (first, last)]
    assert reduced[0] == reduced[1]


@pytest.mark.multirank
@pytest.mark.parametrize("interleaved", [False, True], ids=["1f1b", "interleaved"])
def test_forward_bitwise_and_grads_within_the_reordering_bound(pp_run, interleaved):
    # A stage reads the bytes the previous one sent: each micro-batch's forward is the same
    # kernels on the same operands as PP 1's. The gradients sum the same 4 partials in another order.
    _, out, clean, _ = pp_run
    sc = _interleaved() if interleaved else clean
    assert summary(out, sc.name)["verdict"] == "pass"
    df = results(out, sc.name)
    fwd = df[(df["step"] == 1) & df["kind"].isin(["activation", "logits", "loss"])]
    assert len(fwd) and fwd["bitwise_equal"].all(), fwd[~fwd["bitwise_equal"]]["tensor"].tolist()
    assert assert_grads_differ_by_order_only(out, sc) == len(param_specs(sc.model))


@pytest.mark.multirank
def test_swapped_microbatch_grads_are_localized_to_the_first_stage(pp_run):
    _, out, clean, faulty = pp_run
    s = summary(out, faulty.name)
    fd, expect = s["first_divergence"], CATALOG[FAULT].expect
    assert s["verdict"] == "fail"
    assert (fd["step"], fd["kind"], fd["signature"]) == (expect["step"], expect["kind"],
                                                         expect["signature"]), fd
    assert fnmatch.fnmatchcase(fd["tensor"], expect["tensor"]) and fd["ranks"] == [0], fd
    df = results(out, faulty.name)
    fwd = df[(df["step"] == 1) & df["kind"].isin(["activation", "logits", "loss"])]
    assert fwd["passed"].all()  # the forward is untouched
    grads = df[(df["step"] == 1) & (df["kind"] == "main_grad")]
    last_stage = owned(list(grads["tensor"]), 2, 2, 1)
    assert grads[grads["tensor"].isin(last_stage)]["passed"].all()
    assert not grads[~grads["tensor"].isin(last_stage)]["passed"].all()


def test_stages_split_layers_evenly_and_names_are_global():
    assert list(stage_layers(4, 2, 1)) == [2, 3]
    assert [list(stage_layers(4, 2, s, 2, c)) for s in (0, 1) for c in (0, 1)] == [[0], [2], [1], [3]]
    assert global_name("decoder.layers.0.mlp.fc1.weight", {0: 2, 1: 3}) == "decoder.layers.2.mlp.fc1.weight"
    assert global_name("output_layer.weight", {}) == "output_layer.weight"
    names = ["embedding.word_embeddings.weight", "decoder.layers.0.x", "decoder.layers.3.x",
             "decoder.final_layernorm.weight", "output_layer.weight"]
    assert owned(names, 4, 2, 0) == {"embedding.word_embeddings.weight", "decoder.layers.0.x"}
    assert owned(names, 4, 2, 1) == {"decoder.layers.3.x", "decoder.final_layernorm.weight",
                                     "output_layer.weight"}


@pytest.mark.parametrize("edit, where, rule", [
    ({"candidate": {"world_size": 3}}, "[candidate].world_size", "multiple of TP x G x PP"),
    ({"model": {"num_layers": 3}}, "[candidate].pipeline_parallel", "must divide [model].num_layers"),
    ({"model": {"untie_embeddings": False}}, "[model].untie_embeddings", "untied embeddings"),
    ({"candidate": {"pipeline_parallel": 0}}, "[candidate].pipeline_parallel", ">= 1"),
    ({"candidate": {"virtual_pipeline": 1}}, "[candidate].virtual_pipeline", "must be >= 2, got 1"),
    ({"candidate": {"virtual_pipeline": 2}}, "[candidate].pipeline_parallel", "4 model chunks must divide"),
    ({"candidate": {"backend": "torch"}}, "[candidate].pipeline_parallel", "only the megatron backend"),
])
def test_bad_pipeline_settings_name_key_and_rule(edit, where, rule):
    raw = read_toml(TINY)
    for table, values in edit.items():
        raw[table] = {**raw.get(table, {}), **values}
    with pytest.raises(BadInput) as e:
        scenario.parse_scenario(raw, str(TINY))
    assert where in str(e.value) and rule in str(e.value)


def test_the_fault_is_refused_where_it_cannot_fire():
    (s,) = scenario.load(TINY)
    assert check_reach(FAULT, s.candidate, s.data) is None
    assert "never fires" in check_reach(FAULT, s.reference, s.data)
    with pytest.raises(BadInput, match="never fires"):
        plant([s], [FAULT], "reference")
    assert "1F1B schedule only" in check_reach(FAULT, _interleaved().candidate, s.data)
