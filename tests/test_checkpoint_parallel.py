"""Checkpoints saved from expert-parallel (EP 2 x expert GTP 2) and pipelined (PP 2 x GTP 2) runs:
the ``ckpt-*`` entries of ``scenarios/features.toml`` run once, with the loads only the installed
wheel supports (EP 2 x expert GTP 2 loaded at EP 1) and one planted fault per layout (experts
saved under another EP rank's indices, stages under the mirrored stage's layer numbers), each
localized at the load; the refusals (an interleaved side, another optimizer chain) before launch."""

from __future__ import annotations

import copy
import fnmatch
import json

import pytest
import torch

from harness import cli, scenario
from harness.backends.gpt import param_specs
from harness.backends.megatron import checkpoint
from harness.common.errors import BadInput
from harness.compare.signatures import other_tensor
from harness.scenario import checkpoint as checkpointing
from harness.scenario.faults import CATALOG
from harness.scenario.matrix import expand_matrix, read_toml
from harness.scenario.parse import parse_scenario
from harness.scenario.rules import validate
from harness.session import run_scenarios
from helpers import ASSETS, ROOT, results, summary

FEATURES = ROOT / "scenarios" / "features.toml"
LABELS = ("ckpt-ep2-egtp2", "ckpt-pp2-gtp2")
# What the suite loads besides the shipped entries: EP 1 (the 0.19.2 wheel keeps expert GTP
# shards in the dense optimizer, so its chain matches), and each layout's save fault.
EXTRA = {
    "ckpt-ep2-egtp2": [{"label": "ep1-egtpoff-gtpoff", "world_size": 2, "ep": 1, "expert_gtp": 1, "gtp": 1},
                       {"label": "fault-expert-index", "inject": ["ckpt-expert-index-shifted"]}],
    "ckpt-pp2-gtp2": [{"label": "fault-stage-layers", "world_size": 2, "pipeline_parallel": 1, "gtp": 1,
                       "inject": ["ckpt-stage-layers-mirrored"]}],
}
FAULTS = {"ckpt-ep2-egtp2-fault-expert-index": ("ckpt-expert-index-shifted", "local_experts.0.",
                                                "local_experts.2."),
          "ckpt-pp2-gtp2-fault-stage-layers": ("ckpt-stage-layers-mirrored", "layers.0.", "layers.1.")}


def _docs(extra: dict | None = None) -> list[tuple[dict, str]]:
    """The ``ckpt-*`` documents of features.toml, with ``extra`` loads appended per label."""
    docs = [(copy.deepcopy(d), src) for d, src in expand_matrix(read_toml(FEATURES), FEATURES)
            if d["axes"]["feature"] in LABELS]
    for d, _ in docs:
        d["checkpoint"]["load_into"] += (extra or {}).get(d["axes"]["feature"], [])
    return docs


def _expand(doc: dict, src: str) -> list[scenario.Scenario]:
    return checkpointing.expand(doc, src, parse_scenario, validate)


def _suite() -> list[scenario.Scenario]:
    return [s for d, src in _docs(EXTRA) for s in _expand(d, src)]


# --- the scenarios and their refusals ------------------------------------------------------


def test_expert_parallel_and_pipelined_runs_are_saved_and_loaded():
    by_name = {s.name: s for s in _suite()}
    ep, pp = by_name["ckpt-ep2-egtp2-ep1-egtpoff-gtpoff"], by_name["ckpt-pp2-gtp2-pp1-gtpoff"]
    assert ep.description.startswith("checkpoint: TP1xGTP2 EP2xEGTP2 DP2 -> TP1xGTP-off DP2 load at step 1")
    assert pp.description.startswith("checkpoint: TP1xGTP2 PP2 -> TP1xGTP-off DP2 load at step 1")
    assert (ep.saver.ep, ep.saver.expert_gtp, ep.saver.gtp, ep.saver.save_step) == (2, 2, 2, 1)
    assert (pp.saver.pipeline_parallel, pp.saver.gtp) == (2, 2) and pp.compare.exact_steps == (1,)
    # The matrix's [candidate] (GTP 2) is what every loader starts from, under its own keys.
    assert by_name["ckpt-pp2-gtp2-pp1-gtp2"].candidate.gtp == 2 and pp.candidate.gtp == 1
    assert by_name["ckpt-ep2-egtp2-fault-expert-index"].saver.inject == ()  # planted where it saves:
    saver = checkpointing.saver_side(by_name["ckpt-ep2-egtp2-fault-expert-index"])
    assert saver.inject == ("ckpt-expert-index-shifted",)


def test_an_interleaved_side_is_refused():
    _, (doc, src) = _docs()
    doc["model"]["num_layers"] = 4  # PP 2 x VPP 2: four model chunks of one layer
    doc["checkpoint"]["load_into"] = [{"label": "vpp", "virtual_pipeline": 2}]
    with pytest.raises(BadInput, match="interleaved"):
        _expand(doc, src)


@pytest.mark.parametrize("label, fault, problem", [
    ("ckpt-pp2-gtp2", "ckpt-expert-index-shifted", "no expert parallelism"),
    ("ckpt-ep2-egtp2", "ckpt-stage-layers-mirrored", "not pipelined"),
])
def test_a_save_fault_the_saved_layout_cannot_fire_is_refused(label, fault, problem):
    (doc, src), = [(d, s) for d, s in _docs() if d["axes"]["feature"] == label]
    doc["checkpoint"]["load_into"] = [{"label": "f", "inject": [fault]}]
    with pytest.raises(BadInput, match=f"{fault} never fires: .*{problem}"):
        _expand(doc, src)


def test_an_sgd_run_is_refused():
    """megatron-core's load calls the optimizer's init_state_fn, which SGD does not have."""
    _, (doc, src) = _docs()
    doc["train"] = {**doc["train"], "optimizer": "sgd"}
    with pytest.raises(BadInput, match="SGD optimizer's checkpoint"):
        _expand(doc, src)


def _chain_case(**loader) -> scenario.Scenario:
    (doc, src), = [(d, s) for d, s in _docs() if d["axes"]["feature"] == "ckpt-ep2-egtp2"]
    doc["checkpoint"]["load_into"] = [{"label": "x", "world_size": 2, **loader}]
    return _expand(doc, src)[0]


def test_a_load_into_another_optimizer_chain_is_refused_on_the_tree_that_builds_it():
    ep1 = _chain_case(ep=1, expert_gtp=1, gtp=1)
    ep2 = _chain_case(expert_gtp=1, gtp=1)
    wheel, fixed = (lambda side: False), (lambda side: True)
    # The wheel drops allreduce = False from expert GTP shards: EP 2 x EGTP 2 experts are dense.
    checkpointing.check_expert_optimizers(ep1, wheel)
    with pytest.raises(BadInput, match="saved run .* dense optimizer, the loader .* optimizer of their own"):
        checkpointing.check_expert_optimizers(ep2, wheel)
    # With abf04f46e3 the saved experts have their own optimizer, as EP 2's always do.
    checkpointing.check_expert_optimizers(ep2, fixed)
    with pytest.raises(BadInput, match="ChainedOptimizer.load_state_dict"):
        checkpointing.check_expert_optimizers(ep1, fixed)


def test_the_refusal_is_exit_2_before_anything_launches(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["run", str(ASSETS / "checkpoint_ep_chain.toml"), "--out", str(out)]) == 2
    assert "dense optimizer" in capsys.readouterr().err and not (out / "traces").exists()


@pytest.mark.multirank
def test_the_chain_rule_is_the_installed_wheels():
    """The optimizers megatron-core chains for each layout of the EP scenarios, built on 4 ranks."""
    from repro._common import spawn

    layouts = [(2, 2, 2), (2, 1, 1), (1, 1, 1), (1, 2, 2)]
    built = spawn(_chains, 4, layouts)[0]
    model = next(s.model for s in scenario.load(FEATURES) if s.name.startswith("ckpt-ep2-egtp2"))
    for (ep, eg, g), n in zip(layouts, built):
        side = scenario.Side(world_size=4, ep=ep, expert_gtp=eg, gtp=g)
        assert n == 1 + checkpointing.expert_optimizer(side, model.num_experts, fixed=False), (ep, eg, g)


def _chains(rank: int, world: int, layouts: list) -> list[int]:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import gtp_api
    from megatron.core.transformer.transformer_config import TransformerConfig

    from harness.backends.megatron import compat

    out = []
    for ep, eg, g in layouts:
        compat.reset_gtp_state()
        ps.initialize_model_parallel(1, gtp_remat_size=g, expert_model_parallel_size=ep,
                                     expert_gtp_remat_size=eg)
        gtp_api.configure_gtp_remat_from_recipe(calculate_per_token_loss=False)
        cfg = TransformerConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                                tensor_parallel_num_weight_shards=g,
                                    expert_tensor_parallel_num_weight_shards=eg,
                                num_moe_experts=4, moe_router_topk=2, expert_model_parallel_size=ep,
                                moe_token_dispatcher_type="alltoall", use_cpu_initialization=True,
                                    add_bias_linear=False,
                                gradient_accumulation_fusion=False)
        model = GPTModel(config=cfg,
                         transformer_layer_spec=get_gpt_layer_local_spec(num_experts=4,
                                                                         moe_grouped_gemm=False),
                         vocab_size=64, max_sequence_length=8, share_embeddings_and_output_weights=False,
                         position_embedding_type="learned_absolute")
        ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(), model)
        out.append(len(get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3),
                                              [ddp]).chained_optimizers))
        ps.destroy_model_parallel()
    compat.reset_gtp_state()
    return out


def test_permuted_tensors_are_named_by_the_tensor_they_hold():
    ref = {(1, "exp_avg", "a"): torch.arange(6.0).view(2, 3), (1, "exp_avg", "b"): torch.ones(2, 3),
           (1, "param", "c"): torch.zeros(2, 3)}
    assert other_tensor(torch.ones(2, 3), (1, "exp_avg", "a"), ref) == "b"
    assert other_tensor(torch.ones(2, 3) * 2, (1, "exp_avg", "a"), ref) is None
    assert other_tensor(torch.zeros(2, 3), (1, "exp_avg", "a"), ref) is None  # zeros show no permutation


# --- the runs -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt-parallel")
    code = run_scenarios(_suite(), out, parallel=2)
    return code, out


def _clean() -> list[str]:
    return [s.name for s in _suite() if "fault" not in s.name]


@pytest.mark.multirank
@pytest.mark.parametrize("name", _clean())
def test_each_load_is_bitwise_and_training_continues(suite, name):
    _, out = suite
    doc = summary(out, name)
    assert doc["verdict"] == "pass", doc.get("first_divergence")
    assert doc["checkpoint"]["bitwise_at_load"]
    df = results(out, name)
    load = df[(df["step"] == 1) & (df["kind"] != "scalar")]
    names = {p.name for p in param_specs(next(s for s in _suite() if s.name == name).model)}
    for kind in ("param", "exp_avg", "exp_avg_sq"):  # every expert and every stage's layers
        assert set(load[load["kind"] == kind]["tensor"]) == names, kind
    assert (load["policy"] == "exact").all() and load["bitwise_equal"].astype(bool).all()
    after = df[(df["step"] == 2) & df["kind"].isin(["param", "main_grad", "loss", "activation"])]
    assert not after.empty and after["passed"].astype(bool).all()


@pytest.mark.multirank
@pytest.mark.parametrize("name", sorted(FAULTS))
def test_each_save_fault_is_localized_at_the_load(suite, name):
    code, out = suite
    assert code == 1  # the faults fail their scenarios (and only they: the test above)
    fault, mine, theirs = FAULTS[name]
    s = summary(out, name)
    fd, expect = s["first_divergence"], CATALOG[fault].expect
    assert s["verdict"] == "fail" and not s["checkpoint"]["bitwise_at_load"]
    assert (fd["step"], fd["phase"], fd["signature"]) == (1, "load", expect["signature"])
    assert fd["kind"] == expect["kind"] and fnmatch.fnmatch(fd["tensor"], expect["tensor"])
    # The loaded tensor is, bit for bit, the saved run's tensor of the other expert or layer.
    assert fd["holds"] == fd["tensor"].replace(mine, theirs)


@pytest.mark.multirank
def test_expert_and_layer_stacked_keys_hold_the_logical_tensors(suite):
    _, out = suite
    (saved,) = [p for p in out.glob("traces/*ep2-egtp2*/checkpoint")
                if not json.loads((p.parent / "manifest.json").read_text())["config"]["inject"]]
    meta = checkpoint.read_metadata(saved / ".metadata").state_dict_metadata
    # Layers x experts x the whole (unsharded) expert weight, from 4 ranks' EP x EGTP shards.
    assert tuple(meta["decoder.layers.mlp.experts.experts.linear_fc1.weight"].size) == (2, 4, 64, 32)
    exp_avg = meta["optimizer.state.exp_avg.decoder.layers.mlp.experts.experts.linear_fc2.weight"]
    assert tuple(exp_avg.size) == (2, 4, 32, 64)
