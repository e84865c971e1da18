"""The architecture switches' planted faults (harness.scenario.arch_faults): a replicated bias and a
replicated query norm whose grads are not reduced over the GTP group, a gated fc1's halves and GQA's
query groups moved across GTP shards, a padded vocabulary's output layer handed out with GTP's pad
rows in front, a tied weight's grad from one of its two uses, and a routed expert's gated fc1 halves
moved across expert GTP shards.
Each refused, with its reason, on a side without the switch or layout it needs (fast); all planted in
one launch set (the GTP ones on a tiny GTP 2 model with every switch they need, the tied one at TP 1
against TP 2 with GTP off, the expert one with gated routed experts under expert GTP 2), each
localized where the catalogue says, with what it did measured from the traces."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness import scenario
from harness.capture import trace
from harness.common.errors import BadInput
from harness.compare.assemble import assemble_trace
from harness.scenario.arch_faults import ARCH_FAULTS, BIAS, EXPERT_GLU, GLU, QK_NORM, QKV, TIED, VOCAB
from harness.scenario.faults import CATALOG
from harness.scenario.planting import plant
from tests.helpers import ROOT, run, step1_partial_grad_bound, summary

GTP_FAULTS = (BIAS, GLU, QKV, VOCAB, QK_NORM)  # planted on one model with every switch they need
FAULTS = (*GTP_FAULTS, TIED, EXPERT_GLU)


def _base(**model) -> scenario.Scenario:
    """architectures.toml's bias case (TP 1, 2 ranks, fp32, 2 Adam steps, GTP 2 vs off) with
    ``model``'s switches."""
    s = next(x for x in scenario.load(ROOT / "scenarios" / "architectures.toml")
             if x.name == "bias-tp1-gtp2-fp32")
    return dataclasses.replace(s, model=dataclasses.replace(s.model, **model))


def _tied() -> scenario.Scenario:
    """The bias case with tied embeddings, TP 1 against TP 2 at GTP off (GTP raises on tied ones)."""
    s = _base(untie_embeddings=False)
    return dataclasses.replace(s, name="arch-tied-clean",
                               candidate=dataclasses.replace(s.candidate, gtp=1, tp=2))


# Every switch the faults need: a bias, a gated fc1 of 160 rows (2 GTP shards of 80, no pad),
# 2 query groups of 64 rows in a 128-row QKV (one group per GTP shard, no pad), 71 tokens padded
# to 72 rows (GTP pads the output layer's 72 to 96: 24 pad rows), the query and key norms.
SWITCHES = {"add_bias_linear": True, "activation": "swiglu", "num_query_groups": 2, "vocab_size": 71,
            "make_vocab_size_divisible_by": 4, "qk_layernorm": True}


def _moe_base() -> scenario.Scenario:
    """The same model with 4 gated routed experts (each fc1 160 rows: 2 expert GTP shards of 80, no
    pad), dense GTP 2 and expert GTP 2 against both off, EP 1."""
    s = dataclasses.replace(_base(add_bias_linear=False, activation="swiglu", num_experts=4), name="arch-moe")
    return dataclasses.replace(s, candidate=dataclasses.replace(s.candidate, expert_gtp=2))


# --- reach: refused, naming what is missing -------------------------------------------------------


def test_the_catalogue_holds_them_with_their_targets():
    for name in FAULTS:
        f = CATALOG[name]
        assert f is ARCH_FAULTS[name] and f.expect["tensor"] == f.target, name


def test_each_fault_fits_the_model_with_its_switches():
    planted = plant([_base(**SWITCHES)], GTP_FAULTS)
    assert planted[0].candidate.inject == GTP_FAULTS
    assert plant([_tied()], [TIED])[0].candidate.inject == (TIED,)


@pytest.mark.parametrize(("fault", "model", "train", "said"), [
    (BIAS, {}, {}, "needs add_bias_linear"),
    (GLU, {"add_bias_linear": False}, {}, "needs a gated activation"),
    (GLU, {"activation": "geglu", "ffn_hidden_size": 72}, {}, "gate/up boundary on a GTP shard boundary"),
    (GLU, {"activation": "swiglu"}, {"world_size": 4, "tp": 2}, "fc1's TP block of 80 rows"),
    (GLU, {"activation": "swiglu", "num_experts": 4}, {}, "an MoE model ([model].num_experts) has none"),
    (QKV, {}, {}, "needs grouped-query attention"),
    (QK_NORM, {}, {}, "needs qk_layernorm"),
    (QKV, {"num_query_groups": 1}, {}, "whole query groups on each GTP shard"),
    (TIED, {"untie_embeddings": False}, {}, "at GTP off with tied embeddings"),  # the candidate has GTP
    (TIED, {}, {"gtp": 1}, "at GTP off with tied embeddings"),  # untied
    (VOCAB, {}, {}, "needs a padded vocabulary"),
    (VOCAB, {"vocab_size": 60, "make_vocab_size_divisible_by": 32}, {}, "needs GTP pad rows"),
])
def test_a_side_without_the_layout_a_fault_needs_refuses_it(fault, model, train, said):
    s = _base(**{"add_bias_linear": False, **model})
    if train:
        s = dataclasses.replace(s, reference=dataclasses.replace(s.reference, **train),
                                candidate=dataclasses.replace(s.candidate, **train))
    with pytest.raises(BadInput, match=r"\[candidate\]\.inject") as e:
        plant([s], [fault])
    assert said in str(e.value) and fault in str(e.value)


def test_at_g_4_the_halves_are_two_shards_each_and_two_query_groups_too_few():
    """At G = 4 the gate/up boundary is still a shard boundary where fc1 has no pad rows (2 x 64 rows:
    a multiple of 16 x 4; 2 x 80 is not), while 2 query groups cannot give each of 4 shards whole groups."""
    from harness.scenario.arch_faults import arch_reach

    s = _base(**SWITCHES)
    side = dataclasses.replace(s.candidate, gtp=4, world_size=4)
    assert arch_reach(GLU, side, dataclasses.replace(s.model, ffn_hidden_size=64)) is None
    assert "no pad rows" in arch_reach(GLU, side, s.model)
    assert "a multiple of G = 4" in arch_reach(QKV, side, s.model)
    assert arch_reach(QKV, side, dataclasses.replace(s.model, num_query_groups=4)) is None


@pytest.mark.parametrize(("model", "side", "said"), [
    ({"activation": "gelu"}, {}, "needs routed experts ([model].num_experts) with a gated activation"),
    ({}, {"expert_gtp": 1}, "with expert GTP (expert_gtp > 1) at EP 1"),
    ({}, {"ep": 2, "world_size": 4}, "with expert GTP (expert_gtp > 1) at EP 1"),
    ({"ffn_hidden_size": 72}, {}, "fc1 of 144 rows with no pad rows"),
])
def test_the_expert_glu_fault_needs_its_layout(model, side, said):
    s = _moe_base()
    s = dataclasses.replace(s, model=dataclasses.replace(s.model, **model),
                            candidate=dataclasses.replace(s.candidate, **side))
    with pytest.raises(BadInput, match=r"\[candidate\]\.inject") as e:
        plant([s], [EXPERT_GLU])
    assert said in str(e.value) and EXPERT_GLU in str(e.value)


@pytest.mark.parametrize("fault", GTP_FAULTS)
def test_a_side_without_gtp_refuses_each(fault):
    with pytest.raises(BadInput, match=r"\[reference\]\.inject") as e:
        plant([_base(**SWITCHES)], [fault], side="reference")
    assert "megatron side with GTP (gtp > 1)" in str(e.value)


def test_gtp_parity_inject_lists_them(capsys):
    from harness.cli import main

    assert main(["inject", "--list"]) == 0
    listed = capsys.readouterr().out
    for name in FAULTS:
        assert f"{name} " in listed and CATALOG[name].bug_class in listed


# --- the seven planted, in one launch set -----------------------------------------------------------


@pytest.fixture(scope="module")
def arch_run(tmp_path_factory):
    """One clean candidate and one per fault on a model with every switch (reference and golden
    shared)."""
    out = tmp_path_factory.mktemp("arch-faults")
    base = dataclasses.replace(_base(**SWITCHES), name="arch-clean")
    planted = [base] + [dataclasses.replace(p, name=f"arch-{f}")
                        for f in GTP_FAULTS for p in plant([base], [f])]
    tied = _tied()
    planted += [tied, dataclasses.replace(plant([tied], [TIED])[0], name=f"arch-{TIED}")]
    planted += [dataclasses.replace(p, name=f"arch-{EXPERT_GLU}") for p in plant([_moe_base()], [EXPERT_GLU])]
    code, _ = run(planted, out)
    return code, out, base


@pytest.mark.multirank
def test_the_model_with_every_switch_is_at_parity_unplanted(arch_run):
    code, out, _ = arch_run
    assert code == 1  # the planted ones fail
    for name in ("arch-clean", "arch-tied-clean"):
        s = summary(out, name)
        assert s["verdict"] == "pass", (name, s.get("first_divergence"))


@pytest.mark.multirank
@pytest.mark.parametrize("fault", FAULTS)
def test_each_fault_is_localized_where_the_catalogue_says(arch_run, fault):
    _, out, _ = arch_run
    s, expect = summary(out, f"arch-{fault}"), CATALOG[fault].expect
    fd = s["first_divergence"]
    assert s["verdict"] == "fail"
    got = (fd["step"], fd["phase"], fd["kind"], fd["tensor"], fd["signature"])
    assert got == tuple(expect[k] for k in ("step", "phase", "kind", "tensor", "signature")), fd
    if fault == TIED:  # TP 2 x DP 1: the worst element's TP shard is on one rank
        assert len(fd["ranks"]) == 1, fd
    else:  # both GTP peers: each its own partial, or the same wrong hand-out
        assert fd["ranks"] == [0, 1]
    if expect["signature"] == "permuted-blocks":
        assert fd["permutation"] == {"blocks": 2, "pad_rows": 0, "permutation": [1, 0]}, fd
    if expect["signature"] == "pad-rows-as-data":  # 72 rows padded to a multiple of 16 x 2: 24
        assert fd["inserted_rows"] == {"row": 0, "count": 24}, fd


def _traces(out, name):
    paths = summary(out, name)["traces"]
    return {role: trace.read(paths[role]) for role in ("reference", "candidate")}


@pytest.mark.multirank
@pytest.mark.parametrize("fault", [BIAS, QK_NORM])
def test_the_unreduced_replicated_grad_is_each_gtp_peers_own_partial(arch_run, fault):
    """Each GTP rank keeps the partial of its own samples (the fc1 bias's, the query norm's): the two
    differ by far more than any order of summing allows, and their mean is the reference's reduced
    grad within the reordering bound of the step's partials (tests.helpers.step1_partial_grad_bound)."""
    _, out, base = arch_run
    traces, name = _traces(out, f"arch-{fault}"), CATALOG[fault].target
    ref = assemble_trace(traces["reference"]).tensors[(1, "main_grad", name)].double()
    per_rank = {e.rank: traces["candidate"].tensor(e).double() for e in traces["candidate"].entries
                if (e.step, e.kind, e.name) == (1, "main_grad", name)}
    assert sorted(per_rank) == [0, 1]
    bound = step1_partial_grad_bound(base)[name].double()
    assert float(((per_rank[0] - per_rank[1]).abs() - 2 * bound).max()) > 0  # not one value
    mean = (per_rank[0] + per_rank[1]) / 2
    over = (mean - ref).abs() - bound
    assert float(over.max()) <= 0, f"{float(over.max()):.3g} over the reordering bound"


@pytest.mark.multirank
@pytest.mark.parametrize("fault", [GLU, QKV, EXPERT_GLU])
def test_the_handed_out_weight_is_the_gathered_one_with_its_blocks_moved(arch_run, fault):
    """Step 1's weights are the initial ones on both sides, bitwise: the candidate's hand-out is
    the reference's weight rolled by half its rows ([up; gate]; at G = 2 one shard of query groups),
    bit for bit."""
    _, out, _ = arch_run
    traces, name = _traces(out, f"arch-{fault}"), CATALOG[fault].target
    ref, cand = (assemble_trace(traces[role]).tensors[(1, "materialized", name)]
                 for role in ("reference", "candidate"))
    assert not torch.equal(ref, cand)
    assert torch.equal(torch.roll(ref, shifts=ref.shape[0] // 2, dims=0), cand)


@pytest.mark.multirank
def test_the_tied_grad_holds_the_lookups_use_alone(arch_run):
    """With the output layer's use dropped, the shared weight's grad is the embedding lookup's: zero
    on every row no input token looks up (4 x 16 inputs from 72 tokens leave at least 8 such rows),
    where the reference's grad holds the output layer's dense term; on looked-up rows both hold the
    lookup's term, so the two grads differ there too but not everywhere."""
    _, out, _ = arch_run
    traces, name = _traces(out, f"arch-{TIED}"), CATALOG[TIED].target
    ref, cand = (assemble_trace(traces[role]).tensors[(1, "main_grad", name)]
                 for role in ("reference", "candidate"))
    unused = (cand == 0).all(dim=1)
    assert int(unused.sum()) >= 72 - 4 * 16
    assert bool((ref[unused] != 0).any(dim=1).all())  # the output layer's term, dropped


@pytest.mark.multirank
def test_the_output_layers_hand_out_has_gtps_pad_rows_in_front(arch_run):
    """Step 1's hand-out of the padded vocabulary's output layer (72 rows: 71 tokens and a padded row)
    is the reference's weight with GTP's 24 zero pad rows in front and its last 24 rows cut off, bit
    for bit: the first 24 tokens' logits are 0 in the loss."""
    _, out, _ = arch_run
    traces, name = _traces(out, f"arch-{VOCAB}"), CATALOG[VOCAB].target
    ref, cand = (assemble_trace(traces[role]).tensors[(1, "materialized", name)]
                 for role in ("reference", "candidate"))
    assert ref.shape[0] == 72 and bool(ref[:24].ne(0).any())
    assert torch.equal(cand, torch.cat([torch.zeros_like(ref[:24]), ref[:48]]))
