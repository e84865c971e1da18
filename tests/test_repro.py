"""The GTP reproducers in repro/ still show what repro/FINDINGS.md claims about megatron-core
0.19.2: each runs real megatron-core on CPU ranks (gloo) and the claims are checked on every
rank. A change in megatron-core (a fix) or in the CPU layer that alters them fails here."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import MAIN_TREE, at_revision, needs_repositories

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.multirank

QKV = "decoder.layers.{}.self_attention.linear_qkv.weight"
FC1 = "decoder.layers.{}.mlp.linear_fc1.weight"
FC2 = "decoder.layers.{}.mlp.linear_fc2.weight"


def _run(script: str, sides: list[str], tmp: Path, flag: str = "--sides", returncode: int = 0,
         extra: tuple[str, ...] = ()) -> list[dict]:
    out = tmp / f"{Path(script).stem}.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "repro" / script), "--json", str(out), flag, ",".join(sides), *extra],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == returncode, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def _wrong(side: dict) -> set[tuple[str, str, str]]:
    return {(g["phase"], g["param"], g["verdict"]) for g in side["wrong_gemms"]}


def _consumed(phase: str, param: str, instead_of: str) -> tuple[str, str, str]:
    return (phase, instead_of, f"consumed {param}'s weight instead of {instead_of}'s")


@pytest.fixture(scope="module")
def recompute(tmp_path_factory):
    sides = ["gtp-off", "gtp2-prefetch-off", "gtp2-prefetch-on", "gtp2-prefetch-on-sync-gathers",
             "gtp2-prefetch-on-te-phase-iter2"]
    return _run("gtp_full_recompute_prefetch.py", sides, tmp_path_factory.mktemp("recompute"))


def test_full_recompute_prefetch_off_is_bitwise_gtp_off(recompute):
    # TP1: GTP's wgrad (x 1/2, exact) SUM-reduce-scattered equals DDP's (a + b) / 2 bit for bit.
    for rank in recompute:
        off, side = rank["gtp-off"], rank["gtp2-prefetch-off"]
        assert side["loss"] == off["loss"] and side["first_grad_diff_vs_gtp-off"] is None
        assert side["gemms"] > 0 and not side["wrong_gemms"]


@pytest.mark.parametrize("label", ["gtp2-prefetch-on", "gtp2-prefetch-on-sync-gathers",
                                   "gtp2-prefetch-on-te-phase-iter2"])
def test_full_recompute_prefetch_on_recomputes_layer0_with_layer1_qkv(recompute, label):
    # Forward untouched (loss bitwise); the recompute of layer 0 reads layer 1's gathered qkv
    # weight, whether gathers overlap or not and on either recompute chain (fwd chain under
    # tensor_parallel.checkpoint, recompute chain under TE's recompute phase, from its 2nd pass).
    for rank in recompute:
        side = rank[label]
        assert side["loss"] == rank["gtp-off"]["loss"]
        assert side["first_grad_diff_vs_gtp-off"] is not None
        assert _wrong(side) == {_consumed("recompute", QKV.format(1), QKV.format(0))}


@pytest.fixture(scope="module")
def sequence_parallel(tmp_path_factory):
    sides = ["gtp-off", "gtp2-prefetch-off", "gtp2-prefetch-on-sync-gathers",
             "gtp2-prefetch-on-no-sp-sync-gathers"]
    return _run("gtp_sequence_parallel_prefetch.py", sides, tmp_path_factory.mktemp("sp"))


def test_sequence_parallel_prefetch_off_reads_every_weight_right(sequence_parallel):
    for rank in sequence_parallel:
        side = rank["gtp2-prefetch-off"]
        assert side["loss"] == rank["gtp-off"]["loss"]
        assert side["gemms"] > 0 and not side["wrong_gemms"]


@pytest.mark.parametrize("label", ["gtp2-prefetch-on-sync-gathers",
                                   "gtp2-prefetch-on-no-sp-sync-gathers"])
def test_prefetch_of_same_shaped_fc2_lands_in_fc1s_buffer(sequence_parallel, label):
    # Sequence parallel or not: fc1 and fc2 are both 128 x 128 at TP2, share one gather
    # buffer, and fc1's own forward prefetch of fc2 overwrites the weight fc1 is about to read.
    expected = {_consumed("forward", FC2.format(i), FC1.format(i)) for i in (0, 1)}
    for rank in sequence_parallel:
        side = rank[label]
        assert _wrong(side) == expected
        assert side["loss"] != rank["gtp-off"]["loss"]


@pytest.fixture(scope="module")
def per_token(tmp_path_factory):
    sides = ["gtp-off", "gtp2-transformer-config-only", "gtp2-config-and-gtp-recipe"]
    return _run("gtp_per_token_loss_config.py", sides, tmp_path_factory.mktemp("per-token"))


def test_per_token_loss_on_transformer_config_alone_halves_gtp_wgrads(per_token):
    # The pre-scale multiplies by 1/G = 1/2, exact in binary floating point, so the norm ratio
    # (sums of squares in float64, sqrt) is exactly 0.5 on GTP-sharded weights, 1 elsewhere.
    for rank in per_token:
        side = rank["gtp2-transformer-config-only"]
        assert side["gtp_config_per_token_loss"] is False
        assert side["grad_ratio_vs_gtp_off"] == {"gtp_sharded": 0.5, "replicated": 1.0}
        assert side["loss"] == rank["gtp-off"]["loss"]


def test_per_token_loss_through_gtp_recipe_is_bitwise_gtp_off(per_token):
    for rank in per_token:
        side = rank["gtp2-config-and-gtp-recipe"]
        assert side["gtp_config_per_token_loss"] is True
        assert side["first_grad_diff_vs_gtp-off"] is None and not side["wrong_gemms"]


def test_expert_grads_are_g_times_too_large_at_ep2_without_expert_gtp(tmp_path):
    """FINDINGS G on the wheel: EP 2, expert GTP off, dense GTP 2 gives every expert main_grad
    scaled by one factor, G = 2 (closer to 2 than to 1 or 4, one factor: the residual test of
    the ratio signature); EP 1 with dense GTP only holds parity on the wheel (G' is main's)."""
    cases = _run("moe_expert_grad_scale.py", ["ep2-egtpoff-gtp2", "ep1-egtpoff-gtp2"], tmp_path,
                 flag="--cases")
    for rank in cases["ep2-egtpoff-gtp2"]:
        assert abs(rank["ratio"] - 2) < 0.5 and rank["residual"] < 0.05, rank
    for rank in cases["ep1-egtpoff-gtp2"]:
        assert abs(rank["ratio"] - 1) < 0.25 and rank["residual"] < 0.05 and not rank["expert_buffer"], rank


def test_interleaved_prefetch_hands_a_chunk_another_layers_weight(tmp_path):
    """FINDINGS row 8 on the wheel: with GTP 2 and prefetch on, some forward hand-out under the
    interleaved schedule holds another layer's weight; GTP off hands out none."""
    ranks = _run("gtp_vpp_prefetch_chain.py", ["gtp-off", "gtp2-prefetch-on"], tmp_path)
    assert not any(r["gtp-off"]["wrong_handouts"] for r in ranks)
    wrong = [h for r in ranks for h in r["gtp2-prefetch-on"]["wrong_handouts"]]
    assert wrong and all(h["param"] not in h["holds"] for h in wrong), wrong


# Megatron-LM main for the reproducers that also show what main fixed (a git:REPO@REV spec or a
# folder holding megatron/; the default is the local mirror where there is one).


def _rounded_once_more(weight: dict) -> bool:
    """GTP's main_grad is the GTP-off one rounded to bf16 (never equal to it, at most half a bf16
    ULP off), and the reduce-scatter's inputs summed in fp32 are the GTP-off main_grad: the two
    runs computed the same per-rank wgrads and only the reduction's dtype differs."""
    return (weight["rs_dtype"] == "bfloat16" and not weight["bitwise"]
            and weight["equals_off_rounded_to_bf16"]
            and weight["rs_inputs_summed_equal_off"] and weight["max_bf16_ulps"] == 0.5)


def test_gtp_wgrad_reduce_scatter_rounds_bf16_on_the_wheel(tmp_path):
    """FINDINGS I on the wheel: bf16 params, fp32 main_grad, TP1 x GTP2 vs off: every GTP weight's
    wgrad is reduce-scattered in bf16, so each main_grad is exactly the GTP-off one rounded to
    bf16 (the linear weights and the word embedding alike); replicated params and loss bitwise.
    The script exits 1 because some main_grad is not bitwise."""
    ranks = _run("gtp_wgrad_rs_bf16.py", ["gtp-off", "gtp2"], tmp_path, returncode=1)
    for rank in ranks:
        assert len(set(rank["loss"].values())) == 1 and rank["replicated_bitwise"], rank["loss"]
        assert set(rank["groups"]) == {"linear", "embedding"}
        for group in rank["groups"].values():
            assert not group["bitwise"] and group["exact_extra_rounding"], group
        assert len(rank["groups"]["linear"]["weights"]) == 9  # 2 x (qkv, proj, fc1, fc2) + output layer
        bad = {n: w for n, w in rank["weights"].items() if not _rounded_once_more(w)}
        assert not bad, bad


@pytest.mark.slow
def test_gtp_wgrad_reduce_scatter_on_main_fixed_for_linears_only(tmp_path):
    """FINDINGS I on Megatron-LM main (d98e8a64dd): e5542e85f2 widens the linear layers' wgrad
    to main_grad's dtype (fp32 reduce-scatter, main_grad bitwise GTP off); the word embedding's
    wgrad (GTPEmbeddingWeight.backward) still reduce-scatters in bf16: rounded once more."""
    needs_repositories(MAIN_TREE)
    ranks = _run("gtp_wgrad_rs_bf16.py", ["gtp-off", "gtp2"], tmp_path, returncode=1,
                 extra=("--megatron", MAIN_TREE))
    for rank in ranks:
        assert rank["groups"]["linear"]["bitwise"], rank["groups"]["linear"]
        assert all(rank["weights"][n]["rs_dtype"] == "float32" for n in rank["groups"]["linear"]["weights"])
        assert rank["groups"]["embedding"]["exact_extra_rounding"]
        assert _rounded_once_more(rank["weights"]["embedding.word_embeddings.weight"])


def test_a_re_paired_collection_is_ignored_by_every_gtp_weight_on_the_wheel(tmp_path):
    """FINDINGS J on the wheel: under a collection pairing GTP peers [0, 2], [1, 3], every GTP
    weight still gathers over parallel_state's [0, 1], [2, 3], and the grad norm keeps replicated
    grads by parallel_state's GTP rank (wrong on ranks 1 and 2). Exit 1: nothing follows it."""
    ranks = _run("gtp_custom_process_groups.py", ["collection-permuted"], tmp_path, returncode=1)
    usual = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
    for r in ranks:
        assert r["collection_gtp_group"] == [[0, 2], [1, 3]][r["rank"] % 2]
        assert len(r["weights"]) == 10 and set(map(tuple, r["weights"].values())) == {tuple(usual[r["rank"]])}
        assert bool(r["replicated_miscounted"]) == (r["rank"] in (1, 2))


def test_muon_scales_a_padded_gtp_matrix_by_its_padded_shape_on_the_wheel(tmp_path):
    """FINDINGS K on the wheel: one Muon step, TP1 x GTP2 vs off, FFN 80 (linear_fc1 padded to 96
    rows): its update is sqrt(96/80) times GTP off's (Muon's spectral scale of the padded shape);
    every unpadded Muon matrix's update is bitwise GTP off's."""
    import math

    report = _run("gtp_muon_padding.py", ["duplicated"], tmp_path, flag="--modes")
    assert sum(r["pad_rows"] > 0 for r in report["duplicated"].values()) == 2  # both linear_fc1
    for name, r in report["duplicated"].items():
        if r["pad_rows"]:
            assert not r["bitwise"] and r["norm_ratio"] == pytest.approx(math.sqrt(96 / 80), rel=1e-4), (name,
                r)
        else:
            assert r["bitwise"], (name, r)


def test_gtp_with_mtp_raises_at_the_first_backward_on_the_wheel(tmp_path):
    """FINDINGS L on the wheel: one MTP depth, TP1 x GTP2: the embedding's backward for the
    depth's use finalizes decoder layer 0's reduce-scatter, which has not started: KeyError in
    wgrad_reduce_scatter's deferred finalize, on every rank. GTP off runs (exit status 1)."""
    ranks = _run("gtp_mtp_shared_weights.py", ["gtp-off-mtp1", "gtp2-mtp1"], tmp_path, returncode=1)
    for rank in ranks:
        assert rank["gtp2-mtp1"]["raised"] == "KeyError: None"
        assert "generalized_tensor_parallelism.py:wgrad_reduce_scatter:1646" in rank["gtp2-mtp1"]["where"]
        assert rank["gtp-off-mtp1"]["shared"]["output_layer.weight"]["finite"]


def test_a_tied_output_layer_under_gtp_raises_at_its_first_forward(tmp_path):
    """FINDINGS T on the wheel: GPTModel hands the tied output layer the embedding's GTP shard, and
    ColumnParallelLinear.forward refuses a supplied weight of another shape than the TP-local one."""
    ranks = _run("gtp_tied_embeddings.py", ["gtp-off-tied", "gtp2-tied"], tmp_path, returncode=1)
    for rank in ranks:
        assert rank["gtp2-tied"]["raised"] == ("RuntimeError: supplied weight's shape is (48, 64), "
                                               "not (72, 64) as expected")
        assert rank["gtp2-tied"]["where"].endswith("tensor_parallel/layers.py:forward:1132")
        assert "gpt_model.py:_postprocess" in rank["gtp2-tied"]["where"]
        assert rank["gtp-off-tied"]["loss"] > 0 and "raised" not in rank["gtp-off-tied"]


@pytest.mark.slow
@pytest.mark.parametrize(("rev", "embedding_finite"), [("79e6b6a7f5", False), ("d262dbed3d", True)])
def test_gtp_with_mtp_upstream_fixes(tmp_path, rev, embedding_finite):
    """FINDINGS L on Megatron-LM: 79e6b6a7f5 runs GTP + MTP, but DDP adds the embedding's unzeroed
    placeholder wgrad (its undefined content, NaN here) from the second pass on; from d262dbed3d
    every gradient is GTP off's up to summation order (GTP reduces each use's wgrad on its own)."""
    if not MAIN_TREE.startswith("git:"):
        pytest.skip(f"GTP_PARITY_MAIN_TREE={MAIN_TREE} names no repository (give git:<repository>@<rev>)")
    needs_repositories(MAIN_TREE)
    ranks = _run("gtp_mtp_shared_weights.py", ["gtp-off-mtp1", "gtp2-mtp1"], tmp_path,
                 returncode=0 if embedding_finite else 1, extra=("--megatron", at_revision(MAIN_TREE, rev)))
    for rank in ranks:
        side = rank["gtp2-mtp1"]
        assert side["shared"]["embedding.word_embeddings.weight"]["finite"] is embedding_finite
        # used once: bitwise
        assert side["shared"]["output_layer.weight"]["finite"] and side["others_max_rel_diff"] == 0.0
        if embedding_finite:
            assert side["loss"] == rank["gtp-off-mtp1"]["loss"]


def test_an_expert_parallel_checkpoint_loads_only_into_its_optimizer_chain(tmp_path):
    """FINDINGS N on the wheel: EP 2 x expert GTP 2 x GTP 2 keeps its experts in the dense optimizer
    (F drops their allreduce tag), so its checkpoint loads as is and at EP 1, and an EP 2 layout
    without expert GTP (experts in an optimizer of their own) raises in load_state_dict."""
    ranks = _run("ckpt_ep_optimizer_chain.py", ["ep2-egtp2-gtp2", "ep2-egtpoff-gtpoff", "ep1-egtpoff-gtpoff"],
                 tmp_path, flag="--loads")
    for rank in ranks:
        assert rank["saved"] == {"optimizers": 1, "expert_allreduce": "absent"}
        assert rank["ep2-egtp2-gtp2"]["load"] == rank["ep1-egtpoff-gtpoff"]["load"] == "loaded"
        assert rank["ep2-egtpoff-gtpoff"]["optimizers"] == 2
        assert (rank["ep2-egtpoff-gtpoff"]["load"] == "RuntimeError: Expected 2 entries in state dict, but "
                                                      "got 4.")


def test_the_distributed_optimizer_cannot_load_its_checkpoint_without_apex_or_te(tmp_path):
    """FINDINGS X on the wheel: torch's AdamW keeps a per-parameter step; a fresh optimizer's
    state_dict asserts on its empty state, and once filled (megatron-core's own dummy step) the
    fully_reshardable load asks the checkpoint for that step, which it does not hold."""
    ranks = _run("distopt_ckpt_torch_adam_step.py", ["fully_reshardable-fresh", "fully_reshardable-filled"],
                 tmp_path, flag="--loads")
    for rank in ranks:
        assert rank["have_apex_or_te"] is False and rank["inner_optimizer"] == "AdamW"
        assert "step" in rank["state_keys"]
        fresh, filled = rank["fully_reshardable-fresh"], rank["fully_reshardable-filled"]
        assert fresh["load"].startswith("AssertionError") and ":state_dict:" in fresh["where"]
        assert filled["load"] == "KeyError: 'step'"
        assert ":_set_main_param_and_optimizer_states:" in filled["where"]


@pytest.mark.slow
def test_an_expert_parallel_checkpoint_on_main_does_not_load_at_ep1(tmp_path):
    """FINDINGS N on Megatron-LM main: abf04f46e3 keeps the experts' tag, the saved run has two
    optimizers: EP 2 without expert GTP loads, EP 1 (one optimizer) raises."""
    needs_repositories(MAIN_TREE)
    ranks = _run("ckpt_ep_optimizer_chain.py", ["ep2-egtpoff-gtpoff", "ep1-egtpoff-gtpoff"], tmp_path,
                 flag="--loads", extra=("--megatron", MAIN_TREE))
    for rank in ranks:
        assert rank["saved"] == {"optimizers": 2, "expert_allreduce": "False"}
        assert rank["ep2-egtpoff-gtpoff"]["load"] == "loaded"
        assert rank["ep1-egtpoff-gtpoff"]["load"].startswith("ValueError: Could not find parameter group")


def _eval_sides(ranks: list) -> list[dict]:
    """Per rank, {label: that side's evaluate() result} of eval_loss_gtp_group.py."""
    return [{side["label"]: side for side in rank} for rank in ranks]


def _within_fp32_sum(a: float, b: float, terms: int) -> bool:
    """Two fp32 computations of one token mean: each micro-batch's sum rounded once, ``terms``
    added, one division: within (terms + 2) eps_fp32 of each other, relative."""
    return abs(a - b) <= (terms + 2) * 2.0**-23 * abs(b)


def test_megatron_lm_eval_loss_averages_each_ranks_own_samples_on_the_wheel(tmp_path):
    """FINDINGS M on the wheel: Megatron-LM's evaluate() at TP1 x GTP2 reports, on each rank, the
    mean over that rank's samples only (its reduction group leaves the GTP peer out); GTP off
    reports the whole batch's. Both sides compute the same per-micro-batch losses. Exit 1."""
    for rank in _eval_sides(_run("eval_loss_gtp_group.py", ["gtp-off", "gtp2"], tmp_path, returncode=1)):
        off, gtp2 = rank["gtp-off"], rank["gtp2"]
        assert (off["own"], off["batch"]) == (gtp2["own"], gtp2["batch"])  # the same samples and weights
        assert _within_fp32_sum(off["reported"], off["batch"], off["micro_batch_terms"])
        assert _within_fp32_sum(gtp2["reported"], gtp2["own"], gtp2["micro_batch_terms"])
        assert not _within_fp32_sum(gtp2["reported"], gtp2["batch"], gtp2["micro_batch_terms"])


@pytest.mark.slow
def test_megatron_lm_eval_loss_on_main_averages_the_whole_batch(tmp_path):
    """FINDINGS M on Megatron-LM main (d98e8a64dd): df197a816f reduces over the GTP-inclusive
    data-parallel group; every rank reports the whole batch's mean. Exit 0."""
    needs_repositories(MAIN_TREE)
    ranks = _run("eval_loss_gtp_group.py", ["gtp-off", "gtp2"], tmp_path, extra=("--megatron", MAIN_TREE))
    for rank in _eval_sides(ranks):
        for side in rank.values():
            assert _within_fp32_sum(side["reported"], side["batch"], side["micro_batch_terms"]), side


def test_the_learnable_softmax_offsets_count_in_the_grad_norm_on_tp_rank_0_only(tmp_path):
    """FINDINGS.md U: at TP 2 each rank holds its heads' offsets, untagged; megatron-core's duplicate
    filter keeps TP rank 0's alone, so its grad norm lacks exactly TP rank 1's offsets."""
    out = tmp_path / "softmax_offset.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "repro" / "softmax_offset_tp_grad_norm.py"), "--json",
                           str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = json.loads(out.read_text())
    assert [r["softmax_offset_shape"] for r in ranks] == [[2], [2]]
    assert [r["tensor_model_parallel"] for r in ranks] == ["absent", "absent"]
    assert [r["counted_in_grad_norm"] for r in ranks] == [True, False]
    r = ranks[0]
    assert r["tp_rank1_offset_grad_sq"] > 0
    # fp64 sums of the same squares, in another grouping: each rounds by at most terms x eps64 of the sum.
    eps64 = sys.float_info.epsilon
    gap = r["logical_grad_norm_sq"] - r["filtered_grad_norm_sq"]
    assert abs(gap - r["tp_rank1_offset_grad_sq"]) <= 2 * r["terms"] * eps64 * r["logical_grad_norm_sq"]
    # megatron-core's optimizer computes that filtered norm (in fp32: one rounding per term and sum).
    eps32 = 2.0 ** -23
    assert abs(r["megatron_grad_norm_sq"] - r["filtered_grad_norm_sq"]) <= (
        2 * r["terms"] * eps32 * r["filtered_grad_norm_sq"])
