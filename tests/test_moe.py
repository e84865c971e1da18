"""Expert GTP (MoE): megatron-core's routed experts against expert GTP off and the fp64 golden,
routing determinism, the expert grid's rank order, the MoE rules, and the planted MoE faults."""

import fnmatch
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from harness import scenario
from harness.common.errors import BadInput
from harness.scenario.faults import MOE_FAULTS
from harness.backends.gpt import layout_of, param_specs
from harness.backends.data import coord as data_coord
from harness.common.layout import assemble, holds, shard
from harness.common.mesh import expert_coord, on_grid
from tests.helpers import ASSETS, ROOT, results, run, summary

FAST = ASSETS / "moe_fast.toml"
# The faults the fast subset plants; the dense-group wgrad fault needs world 4 (EP 2 x EGTP 2):
# scenarios/moe_faults_nightly.toml plants it (one world-4 launch, its own test below).
FAST_FAULTS = sorted({f for s in scenario.load(FAST) for f in s.candidate.inject})
NIGHTLY_FAULTS = ROOT / "scenarios" / "moe_faults_nightly.toml"


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe")
    code, doc = run(FAST, out, parallel=1)
    assert code == 1, doc  # the two fault scenarios fail; the clean one must pass (below)
    return out


@pytest.mark.multirank
def test_expert_gtp_matches_expert_gtp_off_and_the_golden(moe_run):
    s = summary(moe_run, "moe-clean-egtp2-vs-off")
    assert s["verdict"] == "pass", s.get("first_divergence")
    df = results(moe_run, "moe-clean-egtp2-vs-off")
    # Every expert weight, gradient and router quantity was compared, not just the losses.
    for pattern in ("*.local_experts.3.linear_fc2.weight", "*.mlp.router.weight", "*.router.logits",
                    "*.router.routing_map", "*.router.tokens_per_expert", "*.router.aux_loss"):
        assert df["tensor"].map(lambda t: fnmatch.fnmatchcase(t, pattern)).any(), pattern
    expert_kinds = set(df[df["tensor"].str.contains("local_experts")]["kind"])
    assert expert_kinds >= {"param", "main_grad", "materialized"}


@pytest.mark.multirank
def test_routing_is_the_same_on_every_layout(moe_run):
    """Same logical weights and tokens: the same experts for every token on both sides and in
    the golden (fp64), and the same per-expert token counts."""
    df = results(moe_run, "moe-clean-egtp2-vs-off")
    routing = df[df["tensor"].str.endswith((".routing_map", ".tokens_per_expert"))]
    assert len(routing) == 2 * 2 * 2  # 2 layers x 2 quantities x 2 steps
    assert routing["bitwise_equal"].all()
    assert (routing["ref_err_golden"] == 0).all() and (routing["cand_err_golden"] == 0).all()


@pytest.mark.multirank
@pytest.mark.parametrize("fault", FAST_FAULTS)
def test_moe_fault_is_localized(moe_run, fault):
    s = summary(moe_run, f"moe-{fault}")
    fd, expect = s["first_divergence"], MOE_FAULTS[fault].expect
    assert s["verdict"] == "fail"
    assert (fd["step"], fd["kind"]) == (expect["step"], expect["kind"]), fd
    assert fnmatch.fnmatchcase(fd["tensor"], expect["tensor"]), fd
    assert fd["signature"] == expect["signature"], fd


@pytest.mark.multirank
def test_expert_wgrad_over_the_dense_gtp_group_is_localized(tmp_path):
    """The third MoE fault fires only where the dense and expert GTP groups differ (EP 2 x EGTP 2
    x GTP 2, world 4), a layout megatron-core itself diverges on against the golden: localized
    bitwise against the clean run of the same layout."""
    code, doc = run(NIGHTLY_FAULTS, tmp_path, parallel=1)
    assert code == 1, doc
    (s,) = scenario.load(NIGHTLY_FAULTS)
    (fault,) = s.candidate.inject
    fd, expect = summary(tmp_path, s.name)["first_divergence"], MOE_FAULTS[fault].expect
    assert (fd["step"], fd["kind"], fd["signature"]) == (expect["step"], expect["kind"],
                                                         expect["signature"]), fd
    assert fnmatch.fnmatchcase(fd["tensor"], expect["tensor"]), fd


def test_every_moe_fault_is_planted():
    nightly = {f for s in scenario.load(NIGHTLY_FAULTS) for f in s.candidate.inject}
    assert set(FAST_FAULTS) | nightly == set(MOE_FAULTS) and not set(FAST_FAULTS) & nightly


def test_topk_tie_breaking_does_not_depend_on_the_batch():
    """megatron-core's top-k routing picks a token's experts from that token's logits alone: the
    choice under exact ties is the same whichever tokens share its micro-batch or rank."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 3, (64, 4), generator=gen).float()  # many exact ties
    _, whole = topk_routing_with_score_function(logits, 2, score_function="softmax")
    perm = torch.randperm(64, generator=gen)
    parts = [topk_routing_with_score_function(logits[perm][i:i + 8], 2, score_function="softmax")[1]
             for i in range(0, 64, 8)]
    assert torch.equal(torch.cat(parts), whole[perm])


@pytest.mark.parametrize("etp, ep, eg, pp", [(1, 2, 2, 1), (2, 2, 2, 1), (2, 1, 2, 1), (1, 1, 2, 1),
                                             (1, 2, 1, 2), (1, 2, 2, 2)])
def test_expert_grid_is_megatron_cores_rank_order(etp, ep, eg, pp):
    """(PP 2 x EP 2 at world 4 gave stage 1's ranks expert DP coordinates 1 where megatron-core's
    are 0: found by the fuzzer on main, a trace the comparison could not assemble.)"""
    from megatron.core.parallel_state import RankGenerator

    world = 8
    gen = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * eg * pp), pp=pp, cp=1,
                        order="tp-cp-ep-gtp_remat-dp-pp", gtp_remat=eg)
    for axis, key in (("tp", "etp"), ("ep", "ep"), ("gtp_remat", "egtp"), ("dp", "edp")):
        for group in gen.get_ranks(axis):
            coords = [expert_coord(r, world, etp, ep, eg, pp) for r in group]
            assert [c[key] for c in coords] == list(range(len(group))), (axis, group)
            others = {tuple(v for k, v in c.items() if k != key) for c in coords}
            assert len(others) == 1, (axis, group)


def test_an_expert_weight_under_pipelining_is_assembled_from_its_stage():
    """PP 2 x EP 2 (world 4): expert 0 of layer 0 is held at EP coordinate 0 on stage 0 (rank 0)
    and stage 1 (rank 2) alike, but recorded by rank 0 only: the shard is rank 0's (the comparison
    looked for it on rank 2, found by the fuzzer on main)."""
    from types import SimpleNamespace

    from harness.backends.data import coord
    from harness.compare.assemble import _owners

    (sc,) = scenario.load(FAST)[:1]
    side = scenario.Side(world_size=4, pipeline_parallel=2, ep=2)
    spec = next(s for s in param_specs(sc.model) if s.name.endswith("local_experts.0.linear_fc1.weight"))
    layout = layout_of(spec, side, sc.model.num_experts)
    coords = {r: coord(r, side) for r in range(4)}
    assert [coords[r]["edp"] for r in range(4)] == [0, 0, 0, 0]  # expert DP 1: TP x EP x PP fill 4
    _, rank_of = _owners([SimpleNamespace(rank=0, layout=layout)], coords, {})
    assert rank_of == {(0, 0, 0): 0}


def test_expert_weights_are_cut_on_the_expert_grid():
    (sc,) = scenario.load(FAST)[:1]
    side = scenario.Side(world_size=8, gtp=2, ep=2, expert_gtp=2)
    spec = next(s for s in param_specs(sc.model) if s.name.endswith("local_experts.3.linear_fc1.weight"))
    layout = layout_of(spec, side, sc.model.num_experts)
    full = torch.arange(math.prod(spec.shape), dtype=torch.float32).view(spec.shape)
    held = {}
    for rank in range(8):
        c = expert_coord(rank, 8, 1, 2, 2)
        if holds(layout, c):
            held[rank] = shard(full, layout, on_grid(c, layout.grid))
    # Expert 3 lives on EP rank 1 (experts 2, 3): ranks 1, 3, 5, 7; EGTP pairs hold halves.
    assert sorted(held) == [1, 3, 5, 7]
    rows = spec.shape[0]
    assert torch.equal(torch.cat([held[1], held[3]])[:rows], full)
    assert torch.equal(held[1], held[5]) and torch.equal(held[3], held[7])  # expert DP replicas


def _expert_shards(model, side, name: str) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """An expert weight's logical value (distinct entries) and the shard each rank holds."""
    spec = next(s for s in param_specs(model) if s.name.endswith(name))
    layout = layout_of(spec, side, model.num_experts)
    full = torch.arange(math.prod(spec.shape), dtype=torch.float32).view(spec.shape)
    held, at = {}, {}
    for rank in range(side.world_size):
        c = data_coord(rank, side)
        if holds(layout, c):
            placed = on_grid(c, layout.grid)
            held[rank], at[(placed["tp"], placed["gtp"], placed["dp"])] = shard(full, layout, placed), rank
    rebuilt = assemble(layout, lambda c: held[at[(c["tp"], c["gtp"], c["dp"])]])
    assert torch.equal(rebuilt, full)  # the layout assembles what it cut
    return full, held


def test_expert_tensor_parallel_cuts_the_experts_as_the_dense_mlp():
    """Expert TP 2 (= TP, megatron-core's default) at world 4: each expert's fc1 is column-parallel over
    expert TP, a gated one by halves (rank r holds [gate_r; up_r], partition_stride 2), fc2 row-parallel;
    expert TP 1 at TP 2: every rank holds each expert whole; expert TP 2 x EGTP 2: the TP-local block
    [gate_r; up_r] (48 rows) padded to 64 (alignment 16 x EGTP 2) and cut in two on dim 0."""
    (sc,) = scenario.load(FAST)[:1]
    m = replace(sc.model, activation="swiglu")  # f = 48: fc1 [gate; up] of 96 rows
    f = m.ffn_hidden_size
    etp2 = scenario.Side(world_size=4, tp=2, sequence_parallel=True)
    full, held = _expert_shards(m, etp2, "layers.0.mlp.experts.local_experts.1.linear_fc1.weight")
    gate, up = full[:f], full[f:]
    for rank in range(4):
        half = slice(rank % 2 * f // 2, (rank % 2 + 1) * f // 2)  # expert TP = TP: the TP coordinate
        assert torch.equal(held[rank], torch.cat([gate[half], up[half]]))
    full, held = _expert_shards(m, etp2, "layers.0.mlp.experts.local_experts.1.linear_fc2.weight")
    columns = [slice(r * f // 2, (r + 1) * f // 2) for r in range(2)]
    assert all(torch.equal(held[rank], full[:, columns[rank % 2]]) for rank in range(4))
    etp1 = scenario.Side(world_size=4, tp=2, sequence_parallel=True, expert_tp=1)
    full, held = _expert_shards(m, etp1, "layers.0.mlp.experts.local_experts.1.linear_fc1.weight")
    assert sorted(held) == [0, 1, 2, 3] and all(torch.equal(t, full) for t in held.values())
    egtp = scenario.Side(world_size=4, tp=2, gtp=2, expert_gtp=2, sequence_parallel=True)
    full, held = _expert_shards(m, egtp, "layers.0.mlp.experts.local_experts.1.linear_fc1.weight")
    # Expert grid tp-ep-egtp-edp: rank = etp + 2 * egtp. TP-local [gate_r; up_r] is 48 rows, padded to 64.
    for rank in range(4):
        r, g = rank % 2, rank // 2
        half = slice(r * f // 2, (r + 1) * f // 2)
        local = torch.cat([gate[half], up[half], torch.zeros(16, m.hidden_size)])
        assert torch.equal(held[rank], local[g * 32:(g + 1) * 32])


def _bad(tmp_path, **edits) -> str:
    text = FAST.read_text().split("[matrix]")[0]
    for old, new in edits.items():
        text = text.replace(old, new)
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(BadInput) as e:
        scenario.load(path)
    return str(e.value)


@pytest.mark.parametrize("edit, key", [
    ({"num_experts = 4": "num_experts = 0"}, "ep"),  # expert GTP on a dense model
    ({"moe_topk = 2": "moe_topk = 5"}, "moe_topk"),
    ({"num_experts = 4": "num_experts = 3", "[candidate]\n": "[candidate]\nep = 2\nworld_size = 4\n"}, "ep"),
    ({"[candidate]\n": "[candidate]\nep = 2\n"}, "world_size"),  # 2 ranks < EP 2 x EGTP 2
    # Expert TP: megatron-core's MoELayer.forward raises at TP > 1 without sequence parallelism; the
    # harness lays experts out at expert TP 1 or TP only; expert TP x EP x EGTP divides the world.
    ({"[candidate]\n": "[candidate]\ntp = 2\nworld_size = 4\n"}, "sequence_parallel"),
    ({"[candidate]\n": "[candidate]\ntp = 4\nworld_size = 8\nsequence_parallel = true\nexpert_tp = 2\n"},
     "expert_tp"),
    ({"[candidate]\n": "[candidate]\ntp = 2\ngtp = 1\nworld_size = 8\nsequence_parallel = true\nep = 2\n"},
     "ep"),  # EP at TP 2: the dispatcher's uneven all-gather over expert TP does not run on gloo
    # expert TP on a dense model
    ({"num_experts = 4": "num_experts = 0", "expert_gtp = 2\n": "", "[candidate]\n": "[candidate]\ntp = 2\n"
      "world_size = 4\nsequence_parallel = true\nexpert_tp = 1\n"}, "expert_tp"),
    ({"[golden]\n": "[golden]\nexpert_tp = 1\n"}, "expert_tp"),
    ({"[candidate]\n": "[candidate]\ntp = 2\nworld_size = 4\nsequence_parallel = true\nsave_step = 1\n"},
     "tp"),  # MoE checkpoints at TP > 1
    # EGTP 2 cuts the expert-TP-local fc1 (42 / ETP 2 = 21 rows: no) when nothing pads it
    ({"ffn_hidden_size = 48": "ffn_hidden_size = 42", "[candidate]\n": "[candidate]\ntp = 2\ngtp = 1\n"
      "world_size = 4\nsequence_parallel = true\ngtp_pad_alignment = 0\n"}, "expert_gtp"),
    ({"[golden]\n": "[golden]\nep = 2\n"}, "ep"),
    ({"[candidate]\n": "[candidate]\nbackend = \"torch\"\n"}, "backend"),
    # Shared experts, the router's score function and group-limited top-k (megatron-core's own rules
    # from TransformerConfig.__post_init__, or the harness's, said as such).
    ({"num_experts = 4": "num_experts = 0\nmoe_shared_expert_intermediate_size = 8", "expert_gtp = 2\n": ""},
     "moe_shared_expert_intermediate_size"),
    ({"moe_topk = 2": "moe_topk = 2\nmoe_router_score_function = \"sqrtsoftplus\""},
     "moe_router_score_function"),
    ({"moe_topk = 2": "moe_topk = 1"}, "moe_topk"),  # softmax over one logit: pre-softmax not covered
    ({"moe_topk = 2": "moe_topk = 2\nmoe_router_num_groups = 2"}, "moe_router_num_groups"),
    ({"moe_topk = 2": "moe_topk = 2\nmoe_router_group_topk = 1"}, "moe_router_group_topk"),
    ({"moe_topk = 2": "moe_topk = 2\nmoe_router_num_groups = 3\nmoe_router_group_topk = 1"},
     "moe_router_num_groups"),
    ({"moe_topk = 2": "moe_topk = 2\nmoe_router_num_groups = 2\nmoe_router_group_topk = 3"},
     "moe_router_group_topk"),
    ({"moe_topk = 2": "moe_topk = 1\nmoe_router_score_function = \"sigmoid\"\nmoe_router_num_groups = 2\n"
      "moe_router_group_topk = 2"}, "moe_topk"),  # k // group_topk = 0: no expert scores a group
    ({"moe_topk = 2": "moe_topk = 4\nmoe_router_num_groups = 4\nmoe_router_group_topk = 2"}, "moe_topk"),
    ({"moe_topk = 2": "moe_topk = 2\nmoe_shared_expert_intermediate_size = 9",
      "[candidate]\n": "[candidate]\ngtp_pad_alignment = 0\nexpert_gtp = 1\n"}, "gtp"),
])
def test_moe_rules(tmp_path, edit, key):
    assert f".{key}" in _bad(tmp_path, **edit)


_MASKED = {"moe_aux_loss_coeff = 0.01": "moe_aux_loss_coeff = 0.01\nmoe_router_padding_mask = true",
           "global_batch_size = 4": "global_batch_size = 4\nloss_mask = \"variable\"",
           "clip_grad = 0.0": "clip_grad = 0.0\nper_token_loss = \"both\""}


@pytest.mark.parametrize("edit, says", [
    ({**_MASKED, "num_experts = 4": "num_experts = 0", "expert_gtp = 2\n": ""},
     "only with [model].num_experts"),
    ({**_MASKED, "global_batch_size = 4\n": "global_batch_size = 4\n#"}, "masks none"),
    ({**_MASKED, "moe_aux_loss_coeff = 0.01": "moe_aux_loss_coeff = 0.0\nmoe_router_padding_mask = true"},
     "changes nothing"),
    ({**_MASKED, "moe_topk = 2": "moe_topk = 2\nmtp_num_layers = 1"}, "with MTP is not covered yet"),
])
def test_the_router_padding_mask_rules(tmp_path, edit, says):
    """The padding mask is the tokens a variable loss mask drops, read by the load-balancing loss only."""
    text = _bad(tmp_path, **edit)
    assert "[model].moe_router_padding_mask" in text and says in text, text


def test_the_router_padding_mask_is_the_dropped_tokens(tmp_path):
    """GPTModel.forward's padding_mask is True where the loss mask drops the token (megatron-core's
    True = padding), [b, s] as input_ids; nothing is passed without the option."""
    from harness.backends.megatron import moe

    (sc,) = scenario.load(FAST)[:1]
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    got = moe.forward_kwargs(replace(sc.model, moe_router_padding_mask=True), mask)
    assert torch.equal(got["padding_mask"], torch.tensor([[False, False, True], [False, True, True]]))
    assert moe.forward_kwargs(sc.model, mask) == {}


def test_the_moe_options_reach_megatron_core():
    """TransformerConfig's MoE arguments of a scenario with the options set (None / the default: the
    tree's own behaviour, no shared experts, no group limit)."""
    from harness.backends.megatron import moe

    (sc,) = scenario.load(FAST)[:1]
    m = replace(sc.model, activation="swiglu", moe_shared_expert_intermediate_size=24,
                moe_router_score_function="sigmoid", moe_router_num_groups=2, moe_router_group_topk=1)
    got = moe.config_kwargs(SimpleNamespace(model=m, side=sc.candidate))
    assert {k: got[k] for k in ("moe_shared_expert_intermediate_size", "moe_router_score_function",
                                "moe_router_num_groups", "moe_router_group_topk")} == {
        "moe_shared_expert_intermediate_size": 24, "moe_router_score_function": "sigmoid",
        "moe_router_num_groups": 2, "moe_router_group_topk": 1}


def test_expert_tp_reaches_megatron_core():
    """initialize_model_parallel's and TransformerConfig's expert TP: expert_tp, or TP where it is none
    (megatron-core's own default), and the expert weight shards expert TP x EGTP."""
    from harness.backends.megatron import moe

    (sc,) = scenario.load(FAST)[:1]  # expert GTP 2
    side = replace(sc.candidate, world_size=8, tp=2, sequence_parallel=True)
    for expert_tp, etp in ((None, 2), (1, 1), (2, 2)):
        at = replace(side, expert_tp=expert_tp)
        got = moe.config_kwargs(SimpleNamespace(model=sc.model, side=at))
        shards = got["expert_tensor_parallel_num_weight_shards"]
        assert (got["expert_tensor_parallel_size"], shards) == (etp, 2 * etp)
        assert moe.parallel_kwargs(at)["expert_tensor_parallel_size"] == etp


def test_moe_fault_on_a_dense_model_is_refused(tmp_path):
    text = _bad(tmp_path, **{"num_experts = 4": "num_experts = 0", "expert_gtp = 2\n": "",
                             "[candidate]\n": "[candidate]\ninject = [\"moe-aux-loss-wrong-group\"]\n"})
    assert "inject" in text and "dense" in text
