"""The planted faults' catalogue: names, bug classes and where each should be localized.

Free of torch and of the scenario schema so both the scenario checks and the command line
can name faults; :mod:`harness.backends.faults` implements them.
"""

from __future__ import annotations

from harness.scenario.arch_faults import ARCH_FAULTS, arch_reach
from harness.scenario.fault import Fault
from harness.scenario.feature_faults import (
    EVAL_FAULTS, GROUP_FAULTS, MTP_FAULTS, MUON_FAULTS, PRECISION_FAULTS, VERDICT_FAULTS, feature_reach,
)


CATALOG: dict[str, Fault] = {
    f.name: f
    for f in [
        Fault(
            "gtp-rs-no-prescale", "gradient mean vs sum",
            "GTP wgrad reduce-scatter without the 1/G pre-scale: GTP weights get the SUM over peers",
            {"step": 1, "kind": "main_grad", "tensor": "*.weight", "signature": "ratio-G"},
        ),
        Fault(
            "gtp-ag-swap-shards", "shard ordering",
            "GTP all-gather assembles the shards in reverse rank order",
            {"step": 1, "kind": "materialized", "tensor": "embedding.word_embeddings.weight",
             "signature": "permuted-blocks"},
        ),
        Fault(
            "gtp-ln-grad-not-reduced", "missing reduction of a partial gradient",
            "replicated (non-GTP) params' grads are not averaged over the GTP group in finalize",
            {"step": 1, "kind": "main_grad", "tensor": "*", "signature": "replica-drift"},
        ),
        Fault(
            "gtp-peers-same-sample", "misrouted data",
            "GTP peers read the same micro-batch (every peer reads GTP rank 0's samples)",
            {"step": 1, "kind": "input", "tensor": "sample_ids", "signature": "misrouted-samples"},
        ),
        Fault(
            "gtp-pad-leak", "padding",
            "pad rows of GTP main_grad shards receive gradient on the last GTP rank",
            {"step": 1, "kind": "main_grad", "tensor": "*", "signature": "pad-rows"},
        ),
        Fault(
            "optimizer-skips-weight", "stale or clobbered buffer",
            "the optimizer update does not reach decoder.layers.0.mlp.linear_fc1.weight",
            {"step": 1, "kind": "param", "tensor": "decoder.layers.0.mlp.linear_fc1.weight",
             "signature": "stale-update"},
        ),
        Fault(
            "loss-report-wrong-group", "loss reporting",
            "the logged loss is averaged over the replicate-DP group, leaving out GTP peers",
            {"step": 1, "kind": "scalar", "tensor": "reduced_loss", "signature": "loss-report-only"},
        ),
        Fault(
            "grad-norm-double-count", "double counting",
            "replicated params are counted on every GTP peer in the grad norm",
            {"step": 1, "kind": "scalar", "tensor": "grad_norm", "signature": "grad-norm-only"},
        ),
        Fault(
            "gtp-prescale-under-per-token-loss", "gradient mean vs sum",
            "GTP pre-scales its wgrads by 1/G although the loss is per-token (the GTP axis then sums "
            "like the DP axis): GTP weights get 1/G of their gradient",
            {"step": 1, "kind": "main_grad", "tensor": "*.weight", "signature": "ratio-1/G"},
        ),
        Fault(
            "microbatch-grad-overwrite", "stale or clobbered buffer",
            "each micro-batch's gradient overwrites main_grad instead of adding to it: only the "
            "step's last micro-batch counts",
            {"step": 1, "kind": "main_grad", "tensor": "*", "signature": "beyond-sum-bound"},
        ),
        Fault(
            "gtp-update-no-weight-decay", "optimizer param groups",
            "the optimizer's param groups holding GTP weights apply no weight decay",
            {"step": 1, "kind": "param", "tensor": "*.weight", "signature": "update-term"},
        ),
        Fault(
            "gtp-update-lr-mult", "optimizer param groups",
            "the optimizer's param groups holding GTP weights step with half the LR",
            {"step": 1, "kind": "param", "tensor": "*.weight", "signature": "update-term"},
        ),
        Fault(
            "token-count-without-gtp-peers", "loss normalization",
            "under per-token loss finalize_model_grads all-reduces the token count over the "
            "replicate-DP group, leaving out GTP peers' tokens: each GTP peer normalizes by its own "
            "share of the global count",
            # Each GTP peer's shard is scaled by (global tokens / its own): a per-rank factor.
            {"step": 1, "phase": "backward", "kind": "main_grad", "tensor": "output_layer.weight",
             "signature": "mismatch"},
        ),
        Fault(
            "gtp-prefetch-missing-wait", "missing wait on an async collective",
            "the forward consumer of one prefetched GTP weight reads its gather buffer without "
            "waiting on the all-gather: its GEMM reads the weight the shared buffer held before",
            {"step": 1, "phase": "forward", "kind": "activation", "tensor": "decoder.layers.1.self_attention",
             "signature": "gemm-consumed-foreign-weight"},
            target="decoder.layers.1.self_attention.linear_qkv.weight",
        ),
        Fault(
            "gtp-wgrad-rs-finalized-twice", "double counting",
            "one weight's async wgrad reduce-scatter is finalized twice: the chain's finalizing drain "
            "adds it to main_grad and the deferred path adds it again",
            {"step": 1, "phase": "backward", "kind": "main_grad",
             "tensor": "decoder.layers.1.mlp.linear_fc1.weight", "signature": "ratio-G"},  # 2 x at G = 2
            target="decoder.layers.1.mlp.linear_fc1.weight",
        ),
        Fault(
            "distopt-offsets-ignore-gtp-pad", "padding",
            "the distributed optimizer places parameters in the buffer as if GTP shards had no pad "
            "rows: after a padded shard every parameter's update is written pad rows early",
            # The optimizer's view of the gradient is misplaced first: the captured main_grad is
            # put together from the ranges the optimizer owns.
            {"step": 1, "phase": "backward", "kind": "main_grad",
             "tensor": "decoder.layers.0.mlp.linear_fc1.weight",
             "signature": "beyond-sum-bound"},
        ),
        Fault(
            "ckpt-pad-rows-as-data", "padding",
            "a checkpoint's GTP shards of embedding.word_embeddings.weight are saved with alignment pad "
            "rows counted as data (saved shape off by the padding); planted on a [checkpoint] "
            "scenario's candidate, it acts where the checkpoint is saved",
            {"step": None, "kind": "param", "tensor": "embedding.word_embeddings.weight",
             "signature": "pad-rows-as-data"},
        ),
        Fault(
            "ckpt-expert-index-shifted", "shard ordering",
            "a checkpoint's routed experts are saved under the next EP rank's expert indices (global "
            "expert r * E/EP + i counted from EP rank r + 1), weights and Adam moments alike; planted on "
            "a [checkpoint] scenario's candidate, it acts where the checkpoint is saved",
            {"step": None, "kind": "exp_avg", "tensor": "decoder.layers.0.mlp.experts.local_experts.0.*",
             "signature": "permuted-tensors"},
        ),
        Fault(
            "ckpt-stage-layers-mirrored", "shard ordering",
            "a pipelined run's checkpoint saves each stage's layers under the mirrored stage's layer "
            "numbers (stage p of P at offset (P - 1 - p) x L/P), weights and Adam moments alike; planted "
            "on a [checkpoint] scenario's candidate, it acts where the checkpoint is saved",
            {"step": None, "kind": "exp_avg", "tensor": "decoder.layers.0.*",
             "signature": "permuted-tensors"},
        ),
        Fault(
            "fp8-unreduced-amax", "precision loss",
            "FP8 quantized all-gather of GTP weights (torch backend): each shard is quantized with "
            "its own per-tensor amax, not the amax reduced over the GTP group, and the gathered "
            "weight is decoded with the local scale (TE assumes the scales are equal)",
            {"step": 1, "kind": "activation", "tensor": "decoder.layers.0.self_attention",
             "signature": "precision-loss"},
        ),
        Fault(
            "pp-swap-microbatch-grads", "micro-batch ordering",
            "the first pipeline stage backpropagates micro-batches 0 and 1 each with the other's "
            "output gradient received from the next stage (pipeline_parallel > 1)",
            {"step": 1, "kind": "main_grad", "tensor": "decoder.layers.0.*", "signature": "mismatch"},
        ),
    ]
}


# --- launcher self-test: a rank that dies or hangs (``exit:RANK:STEP``, ``hang:RANK:STEP``) ---

RANK_FAULTS = ("exit", "hang", "raise")


def check_name(name: str) -> str | None:
    """None if ``name`` is a known fault, else why not."""
    if name in CATALOG:
        return None
    parts = name.split(":")
    if len(parts) == 3 and parts[0] in RANK_FAULTS and parts[1].isdigit() and parts[2].isdigit():
        return None
    return f"unknown fault {name!r}; known: {', '.join(CATALOG)}, or exit|hang|raise:RANK:STEP"


# Faults that act on GTP's collectives, buffers or groups: on a side without GTP they never fire.
_NEEDS_GTP = frozenset({"gtp-rs-no-prescale", "gtp-ag-swap-shards", "gtp-ln-grad-not-reduced",
                        "gtp-peers-same-sample", "gtp-pad-leak", "loss-report-wrong-group",
                        "grad-norm-double-count", "fp8-unreduced-amax", "gtp-update-no-weight-decay",
                        "gtp-update-lr-mult", "gtp-prescale-under-per-token-loss",
                            "token-count-without-gtp-peers",
                        "gtp-prefetch-missing-wait", "gtp-wgrad-rs-finalized-twice",
                        "distopt-offsets-ignore-gtp-pad"})
# What the torch backend can plant (the others patch megatron-core's own functions).
TORCH_FAULTS = frozenset({"fp8-unreduced-amax", "gtp-peers-same-sample", "gtp-pad-leak",
                          "optimizer-skips-weight"})
# What Megatron-LM's loop (the mlm backend) can plant: its sampler hands out the samples and
# its schedule the micro-batches (no routing or micro-batch hook), per-token loss is a megatron
# side option, and FP8 needs Transformer Engine.
MLM_FAULTS = frozenset(CATALOG) - {"gtp-peers-same-sample", "fp8-unreduced-amax", "microbatch-grad-overwrite",
                                    "gtp-prescale-under-per-token-loss", "token-count-without-gtp-peers",
                                    "gtp-prefetch-missing-wait", "gtp-wgrad-rs-finalized-twice",
                                    "distopt-offsets-ignore-gtp-pad", "pp-swap-microbatch-grads",
                                    "ckpt-pad-rows-as-data", "ckpt-expert-index-shifted",
                                    "ckpt-stage-layers-mirrored"}
# Of the evaluation's faults the mlm backend plants the stale gather, inside megatron-core's GTP.
MLM_FAULTS = MLM_FAULTS | {"gtp-eval-stale-gather"}


def check_reach(name: str, side, data=None) -> str | None:
    """None if the (known) fault ``name`` can fire on ``side`` (reading ``data``), else why it
    never would: a planted fault that cannot fire would make a clean run look like a caught
    fault's miss."""
    parts = name.split(":")
    if len(parts) == 3 and parts[0] in RANK_FAULTS:
        rank, step = int(parts[1]), int(parts[2])
        if rank >= side.world_size:
            return (f"{name!r} never fires: rank {rank} is not in 0..{side.world_size - 1} (world_size "
                    f"{side.world_size})")
        if not 1 <= step <= side.steps:
            return f"{name!r} never fires: step {step} is not in 1..{side.steps} (the side's steps)"
        return None
    if name in ("moe-expert-gather-wrong-buffer", "moe-expert-wgrad-dense-group") and side.expert_gtp == 1:
        return f"{name!r} never fires on a side without expert GTP (expert_gtp = 1)"
    if name == "moe-expert-wgrad-dense-group" and (side.gtp == 1 or side.ep == 1):
        # The dense and expert GTP groups are the same ranks unless both GTPs and EP are on.
        return f"{name!r} never fires unless gtp > 1 and ep > 1 (the dense and expert GTP groups differ)"
    if name in _NEEDS_GTP and side.gtp == 1:
        return f"{name!r} never fires on a side without GTP (gtp = 1)"
    if name == "gtp-prescale-under-per-token-loss" and side.per_token_loss != "both":
        return f"{name!r} never fires unless GTP is told the loss is per-token (per_token_loss = \"both\")"
    if name == "token-count-without-gtp-peers" and side.per_token_loss == "none":
        return f"{name!r} never fires without per-token loss (per_token_loss)"
    if name == "gtp-prefetch-missing-wait" and not (side.gtp_weight_prefetch
                                                    and side.gtp_collectives == "lagging"):
        return (f"{name!r} needs the prefetch chain (gtp_weight_prefetch) and gtp_collectives = \"lagging\": "
                "with collectives that complete on gloo's timing the skipped wait may read the right weight")
    one_forward = data is not None and side.num_microbatches(data) * side.steps < 2
    if name == "gtp-prefetch-missing-wait" and one_forward:
        return f"{name!r} never fires in one forward: the first forward links the prefetch chain"
    if name == "distopt-offsets-ignore-gtp-pad" and not (side.distributed_optimizer
                                                         and side.precision == "bf16"):
        # In fp32 the optimizer steps views of the params themselves: the misplaced copy then
        # overlaps its own source and torch raises instead of diverging.
        return f"{name!r} needs the distributed optimizer (distributed_optimizer) in bf16"
    if name in ("ckpt-pad-rows-as-data", "ckpt-expert-index-shifted",
                "ckpt-stage-layers-mirrored") and not side.load_step:
        return (f"{name!r} never fires outside a [checkpoint] scenario's candidate (it acts where the "
                f"checkpoint is saved)")
    if name == "microbatch-grad-overwrite" and data is not None and side.num_microbatches(data) < 2:
        return f"{name!r} never fires with one micro-batch per step"
    if name == "pp-swap-microbatch-grads" and (getattr(side, "pipeline_parallel", 1) == 1 or (
            data is not None and side.num_microbatches(data) < 2)):
        return f"{name!r} never fires without pipeline stages and two micro-batches per step"
    if name == "pp-swap-microbatch-grads" and getattr(side, "virtual_pipeline", None):
        # Interleaved, the first stage's later model chunks send input gradients back: holding a
        # backward would hold the schedule's p2p.
        return f"{name!r} is planted on the 1F1B schedule only (virtual_pipeline unset)"
    if (problem := feature_reach(name, side, data)) is not None:
        return problem
    if side.backend == "torch" and name not in TORCH_FAULTS:
        return f"{name!r} is not implemented by the torch backend; it implements {sorted(TORCH_FAULTS)}"
    if side.backend == "mlm" and name not in MLM_FAULTS:
        return f"{name!r} is not implemented by the mlm backend; it implements {sorted(MLM_FAULTS)}"
    return None


def model_reach(name: str, side, model) -> str | None:
    """Why fault ``name`` cannot fire on ``side`` of a scenario of ``model``: the MoE faults need
    experts, the architectures' faults their switch of [model] (None: it can)."""
    if name in MOE_FAULTS and not model.num_experts:
        return f"{name!r} never fires on a dense model ([model].num_experts = 0)"
    return arch_reach(name, side, model)


def fault_reach(name: str, side, data, model) -> str | None:
    """Everything the rules ask of a fault planted on ``side`` of a scenario of ``model`` and
    ``data`` but a checkpoint's save (:mod:`harness.fuzz.reach` aims a self-test's draws with it)."""
    return check_reach(name, side, data) or model_reach(name, side, model)


# Faults of MoE models (expert GTP, routing): planted on megatron sides with [model].num_experts > 0.
MOE_FAULTS: dict[str, Fault] = {
    f.name: f
    for f in [
        Fault(
            "moe-aux-loss-wrong-group", "reduction over the wrong group",
            "the router's per-expert token counts for the load-balancing loss are summed over the "
            "data-parallel group instead of the tensor x context group",
            {"step": 1, "kind": "activation", "tensor": "decoder.layers.0.mlp.router.aux_loss",
             "signature": "ratio-1/G"},  # world 2: the data group doubles tokens and counts
        ),
        Fault(
            "moe-expert-gather-wrong-buffer", "stale or clobbered buffer",
            "the gathered weight of layer 0's routed expert 0 fc1 is taken from expert 1's buffer",
            {"step": 1, "kind": "materialized",
             "tensor": "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight",
             "signature": "gemm-consumed-foreign-weight"},
        ),
        Fault(
            "moe-expert-wgrad-dense-group", "reduction over the wrong group",
            "routed experts' wgrads are reduce-scattered over the dense GTP group instead of the expert "
            "GTP group",
            {"step": 1, "kind": "main_grad", "tensor": "*.local_experts.*", "signature": "pad-rows"},
        ),
    ]
}
CATALOG.update(MOE_FAULTS)


# The catalogues of the features GTP is combined with (harness.scenario.feature_faults).
CATALOG.update(MUON_FAULTS)
CATALOG.update(PRECISION_FAULTS)
CATALOG.update(GROUP_FAULTS)
CATALOG.update(MTP_FAULTS)
CATALOG.update(EVAL_FAULTS)
CATALOG.update(VERDICT_FAULTS)
CATALOG.update(ARCH_FAULTS)
