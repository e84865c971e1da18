"""The planted faults of the features GTP is combined with: Muon, the precision bug class,
caller-supplied process groups, multi-token prediction, evaluation; and those at a verdict's edges
(a NaN, a crash of the code under test). Part of the catalogue
(:mod:`harness.scenario.faults` merges them into ``CATALOG``); torch-free."""

from __future__ import annotations

from harness.scenario.fault import Fault


# Muon under GTP (megatron backend, optimizer = "muon"): tests/test_muon.py plants it.
MUON_FAULTS: dict[str, Fault] = {
    f.name: f
    for f in [
        Fault(
            "muon-gtp-gather-tp-group", "right size, wrong group",
            "Muon's all-gather of a GTP-sharded momentum before Newton-Schulz (and its reshard) runs over "
            "the TP group instead of the GTP group: at TP = G the matrix is put together from other "
            "TP blocks' rows",
            {"step": 1, "phase": "optimizer", "kind": "param", "tensor": "decoder.layers.*",
             "signature": "not-bitwise"},
        ),
        Fault(
            "muon-update-padded-scale", "padding counted",
            "Muon's orthogonalized update of decoder.layers.0.mlp.linear_fc1.weight scaled by sqrt(96/80), "
            "the spectral scale of its 80 rows padded to 96 (GTP's alignment rows counted in Newton-Schulz)",
            {"step": 1, "phase": "optimizer", "kind": "param",
             "tensor": "decoder.layers.0.mlp.linear_fc1.weight",
             "signature": "update-term"},
        ),
    ]
}


# The precision bug class: one bf16 rounding where megatron-core keeps fp32 (megatron backend).
# ``backport-gtp-wgrad-fp32`` and ``patch-gtp-embedding-wgrad-fp32`` are no faults: Megatron-LM's fix and the
# embedding's proposed one, the baseline the precision faults show against on the 0.19.2 wheel.
PRECISION_FAULTS: dict[str, Fault] = {
    f.name: f
    for f in [
        Fault(
            "backport-gtp-wgrad-fp32", "backport",
            "Megatron-LM e5542e85f2 (#6624) on an older tree: GTP's wgrad is reduce-scattered in main_grad's "
            "dtype",
            # planted: bitwise
            {"step": None, "kind": "main_grad", "tensor": "*.weight", "signature": "none"},
        ),
        Fault(
            "patch-gtp-embedding-wgrad-fp32", "proposed fix",
            "the word embedding's GTP wgrad reduce-scattered in main_grad's dtype, as repro/FINDINGS.md (I) "
            "proposes (still bf16 on Megatron-LM main d98e8a64dd)",
            {"step": None, "kind": "main_grad", "tensor": "embedding.word_embeddings.weight",
             "signature": "none"},
        ),
        Fault(
            "gtp-rs-bf16", "extra rounding",
            "GTP's wgrad reduce-scatter runs in bf16 although main_grad is fp32 (the 0.19.2 wheel's own "
            "behaviour for bf16 params: planted on top of backport-gtp-wgrad-fp32)",
            {"step": 1, "phase": "backward", "kind": "main_grad", "tensor": "*.weight",
             "signature": "extra-rounding"},
        ),
        Fault(
            "distopt-grad-rs-bf16", "extra rounding",
            "the distributed optimizer's DDP grad reduce-scatter runs in bf16 although grad_reduce_in_fp32 "
            "keeps the buffer fp32",
            {"step": 1, "phase": "backward", "kind": "main_grad", "tensor": "*",
             "signature": "extra-rounding"},
        ),
        Fault(
            "microbatch-accum-bf16", "extra rounding",
            "the fp32 micro-batch accumulation of main_grad rounds to bf16 after each micro-batch's add",
            {"step": 1, "phase": "backward", "kind": "main_grad", "tensor": "*",
             "signature": "extra-rounding"},
        ),
        Fault(
            "grad-reduce-bf16-ignored", "extra rounding",
            "a side's grad_reduce_in_fp32 = false does not reach DDP: main_grad and its reductions stay "
            "fp32, so "
            "the configured run rounds to bf16 where this one does not",
            # GTP's own weights first (backward order): on the 0.19.2 wheel their RS is bf16 either way, so
            # the values agree and the buffer's dtype is what differs; the replicated params' fp32 sums
            # show the rounding (the reference rounded once more).
            {"step": 1, "phase": "backward", "kind": "main_grad", "tensor": "output_layer.weight",
             "signature": "dtype-changed"},
        ),
        Fault(
            "adam-exp-avg-sq-bf16-gtp", "extra rounding",
            "Adam's second moment of GTP-sharded params is kept in bf16 (rounded after each step)",
            {"step": 1, "phase": "optimizer", "kind": "exp_avg_sq", "tensor": "*.weight",
             "signature": "extra-rounding"},
        ),
    ]
}


def _precision_reach(name: str, side, data) -> str | None:
    if side.backend != "megatron":
        return f"{name!r} is planted on the megatron backend only"
    if side.gtp == 1 and name in ("backport-gtp-wgrad-fp32", "patch-gtp-embedding-wgrad-fp32", "gtp-rs-bf16",
                                  "adam-exp-avg-sq-bf16-gtp"):
        return f"{name!r} never fires on a side without GTP (gtp = 1)"
    if name == "gtp-rs-bf16" and side.precision == "bf16" and (not side.grad_reduce_in_fp32 or (
            "backport-gtp-wgrad-fp32" not in side.inject and side.megatron_core == "installed")):
        # The installed 0.19.2 wheel's local linears hand GTP a bf16 wgrad: the RS is bf16 already.
        return (f"{name!r} never fires in bf16 unless main_grad is fp32 and the wgrad is too "
                f"(backport-gtp-wgrad-fp32)")
    if name == "distopt-grad-rs-bf16" and not side.distributed_optimizer:
        return f"{name!r} needs the distributed optimizer (distributed_optimizer)"
    if name == "microbatch-accum-bf16" and data is not None and side.num_microbatches(data) < 2:
        return f"{name!r} never fires with one micro-batch per step"
    if name == "grad-reduce-bf16-ignored" and (side.precision != "bf16" or side.grad_reduce_in_fp32):
        return (f"{name!r} acts where main_grad is configured bf16 (precision bf16, grad_reduce_in_fp32 = "
                f"false)")
    if name == "adam-exp-avg-sq-bf16-gtp" and side.optimizer != "adam":
        return f"{name!r} needs Adam (optimizer = \"adam\")"
    return None


# A caller-supplied process-group collection (Side.process_groups). ``patch-pgc-gtp-reads``
# is no fault: the change repro/FINDINGS.md (J) proposes for Megatron-LM main.
GROUP_FAULTS: dict[str, Fault] = {
    f.name: f
    for f in [
        Fault(
            "pgc-grad-norm-without-gtp", "reduction over the wrong group",
            "the caller's collection holds the TP group alone as its model-parallel group (mp): the "
            "optimizer's grad norm leaves out the other GTP peers' shards",
            {"step": 1, "phase": "reduce", "kind": "scalar", "tensor": "grad_norm",
             "signature": "grad-norm-only"},
        ),
        Fault(
            "patch-pgc-gtp-reads", "proposed fix",
            "GPTModel hands its pg_collection to the word embedding and the output layer, and the grad "
            "norm's "
            "duplicate filter reads the collection's GTP rank (Megatron-LM main d98e8a64dd reads "
            "parallel_state's "
            "in both)",
            {"step": None, "kind": "materialized", "tensor": "*", "signature": "none"},
        ),
    ]
}


def _groups_reach(name: str, side) -> str | None:
    if side.backend != "megatron" or side.process_groups == "parallel-state":
        return (f"{name!r} acts on a caller-supplied collection (process_groups = \"collection\" or "
                f"\"collection-permuted\")")
    if side.gtp == 1:
        return f"{name!r} never fires on a side without GTP (gtp = 1)"
    if name == "patch-pgc-gtp-reads" and side.megatron_core == "installed":
        # 0.19.2's layers read parallel_state's GTP group whatever they are handed (9f3fe8c925 changed that).
        return (f"{name!r} needs a megatron-core whose LanguageModelEmbedding takes pg_collection "
                f"(Megatron-LM 9f3fe8c925 on)")
    return None


# Faults of multi-token prediction (megatron backend, [model].mtp_num_layers > 0; MTP's own rules
# refuse them without MTP). ``backport-gtp-mtp`` is no fault: Megatron-LM's two GTP + MTP fixes
# on the 0.19.2 wheel, whose GTP raises at MTP's first backward without them.
MTP_FAULTS: dict[str, Fault] = {
    f.name: f
    for f in [
        Fault(
            "backport-gtp-mtp", "backport",
            "Megatron-LM 79e6b6a7f5 (#6242) and d262dbed3d (#6565) on the 0.19.2 wheel: a use of a GTP "
            "weight "
            "with no all-gather of its own gathers on demand, a weight's in-flight wgrad reduce-scatter is "
            "accumulated before its next one starts, the chain's deferred finalize runs only on a "
            "reduce-scatter in flight, and the placeholder wgrad of a zero_out_wgrad weight is zeroed",
            {"step": None, "kind": "main_grad", "tensor": "*", "signature": "none"},  # planted: parity
        ),
        Fault(
            "mtp-output-wgrad-dropped", "a weight used more than once per step",
            "the wgrad of the output layer's use by the last MTP depth is dropped before GTP reduce-scatters "
            "it: output_layer.weight's main_grad misses that depth's loss",
            {"step": 1, "phase": "backward", "kind": "main_grad", "tensor": "output_layer.weight",
             "signature": "shared-weight-only"},
            target="output_layer.weight",
        ),
        Fault(
            "mtp-labels-not-shifted", "misrouted data",
            "MTP depth 0 is scored against the main head's labels: process_mtp_loss skips its first roll "
            "of the labels (the loss mask still rolls)",
            {"step": 1, "phase": "loss", "kind": "mtp_loss", "tensor": "mtp.layers.0.loss",
             "signature": "labels-misaligned"},
        ),
        Fault(
            "mtp-stage-embedding-grads-not-reduced", "missing reduction of a partial gradient",
            "under pipelining finalize_model_grads skips the all-reduce of the word embedding's grads "
            "between the first stage and the MTP stage (_allreduce_word_embedding_grads): each copy keeps "
            "its own uses' gradient",
            # The MTP stage's position embeddings drift as well (FINDINGS V): either is first.
            {"step": 1, "phase": "backward", "kind": "main_grad", "tensor": "embedding.*_embeddings.weight",
             "signature": "replica-drift"},
        ),
    ]
}


def _mtp_reach(name: str, side) -> str | None:
    if side.backend != "megatron":
        return f"{name!r} is planted on the megatron backend only"
    if name in ("backport-gtp-mtp", "mtp-output-wgrad-dropped") and side.gtp == 1:
        return f"{name!r} never fires on a side without GTP (gtp = 1)"
    if name == "mtp-stage-embedding-grads-not-reduced" and side.pipeline_parallel == 1:
        return f"{name!r} never fires without pipelining (pipeline_parallel = 1: one embedding)"
    if name == "backport-gtp-mtp" and side.megatron_core != "installed":
        return (f"{name!r} is planted on the installed 0.19.2 wheel only (Megatron-LM holds the fixes since "
                f"d262dbed3d)")
    if (name == "mtp-output-wgrad-dropped" and side.megatron_core == "installed"
            and "backport-gtp-mtp" not in side.inject):
        # The wheel's GTP raises at MTP's first backward (repro/FINDINGS.md, L) before the fault could show.
        return (f"{name!r} needs a tree whose GTP runs MTP: on the installed wheel plant it with "
                f"backport-gtp-mtp")
    return None


# Faults only an evaluation exposes (sides with eval_interval > 0; tests/test_eval.py plants them).
EVAL_FAULTS: dict[str, Fault] = {
    f.name: f
    for f in [
        Fault(
            "gtp-eval-stale-gather", "stale or clobbered buffer",
            "in eval mode (an evaluation's forward-only passes) decoder.layers.0.mlp.linear_fc1.weight's "
            "consumer is handed the weight GTP gathered at the last training forward, which the optimizer "
            "step does not invalidate: the evaluation reads that weight as it was before the step",
            # tensor: an fnmatch pattern, "[[]" a literal "["
            {"step": 1, "phase": "eval", "kind": "eval", "tensor": "eval_loss[[]sample *]",
             "signature": "gemm-consumed-foreign-weight"},
            target="decoder.layers.0.mlp.linear_fc1.weight",
        ),
        Fault(
            "eval-loss-wrong-group", "loss reporting",
            "the evaluation's loss is all-reduced over the replicate-DP group, leaving out GTP peers: "
            "each rank reports the mean over its replicate group's samples (megatron backend's loop)",
            {"step": 1, "phase": "eval", "kind": "eval", "tensor": "eval_loss[[]eval 0]",
             "signature": "partial-average"},
        ),
    ]
}


def _eval_reach(name: str, side) -> str | None:
    if side.gtp == 1:
        return f"{name!r} never fires on a side without GTP (gtp = 1)"
    if getattr(side, "eval_interval", 0) <= 0:
        return f"{name!r} never fires on a side that does not evaluate (eval_interval = 0)"
    if name == "eval-loss-wrong-group" and side.backend != "megatron":
        # Megatron-LM's evaluate() picks its own group (on 0.19.2 the replicate one already).
        return f"{name!r} is planted on the megatron backend's loop only"
    if side.backend not in ("megatron", "mlm"):
        return f"{name!r} is planted on the megatron and mlm backends only"
    return None


# Faults at the edges of a verdict (tests/test_verdict_edges.py plants them): a value that is not a
# number, a crash of the code under test.
VERDICT_FAULTS: dict[str, Fault] = {
    f.name: f
    for f in [
        Fault(
            "gtp-main-grad-nan", "non-finite value",
            "after finalize at step 2 the last GTP rank writes a NaN into the first element of its shard "
            "of decoder.layers.1.mlp.linear_fc1.weight's main_grad (an overflow or an uninitialized read)",
            {"step": 2, "phase": "backward", "kind": "main_grad",
             "tensor": "decoder.layers.1.mlp.linear_fc1.weight", "signature": "non-finite"},
            target="decoder.layers.1.mlp.linear_fc1.weight",
        ),
        Fault(
            "gtp-backward-raises", "crash of the code under test",
            "GTP's wgrad reduce-scatter raises at the first backward (a KeyError inside megatron-core's "
            "GTPShardedParam.wgrad_reduce_scatter, on every rank of the side)",
            {"step": 1, "phase": "forward_backward", "kind": "raised", "tensor": "*", "signature": "raised"},
        ),
        Fault(
            "adam-update-scaled", "optimizer update",
            "the optimizer's update of decoder.layers.0.pre_mlp_layernorm.weight (its fp32 master, then the "
            "weight) is 1.05 times what the optimizer computed, from step 1 on",
            {"step": 1, "phase": "optimizer", "kind": "master",
             "tensor": "decoder.layers.0.pre_mlp_layernorm.weight", "signature": "update-term"},
            target="decoder.layers.0.pre_mlp_layernorm.weight",
        ),
    ]
}


def _verdict_reach(name: str, side) -> str | None:
    if side.backend != "megatron" or side.gtp == 1:
        return f"{name!r} is planted on a megatron side with GTP (gtp > 1)"
    if name == "gtp-main-grad-nan" and side.steps < 2:
        return f"{name!r} never fires before step 2 (steps = {side.steps})"
    if name == "adam-update-scaled" and (side.optimizer != "adam" or side.distributed_optimizer):
        return f"{name!r} needs Adam (optimizer = \"adam\") without the distributed optimizer"
    return None


def feature_reach(name: str, side, data=None) -> str | None:
    """Why fault ``name`` of one of these catalogues cannot fire on ``side`` (None: it can, or it is
    not one of them); :func:`harness.scenario.faults.check_reach` asks this first."""
    if name in MUON_FAULTS and (side.optimizer != "muon" or side.gtp == 1 or side.backend != "megatron"):
        return f"{name!r} never fires but on a megatron side with optimizer = \"muon\" and GTP (gtp > 1)"
    if name in PRECISION_FAULTS:
        return _precision_reach(name, side, data)
    if name in GROUP_FAULTS:
        return _groups_reach(name, side)
    if name in MTP_FAULTS:
        return _mtp_reach(name, side)
    if name in EVAL_FAULTS:
        return _eval_reach(name, side)
    if name in VERDICT_FAULTS:
        return _verdict_reach(name, side)
    return None
