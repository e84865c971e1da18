"""The scenario schema: what a scenario file may say, as dataclasses whose fields are declared
options (:mod:`harness.scenario.options`).

A scenario is one model and data configuration, a reference side and a candidate side (the
two implementations under comparison, e.g. GTP off vs GTP 2) and a golden side (the ``torch``
backend in one process, fp64 or fp32) that both are measured against. A side's keys are
:class:`~harness.scenario.side.Side`; sizes one machine can run are :data:`LIMITS`. Parsing is
:mod:`harness.scenario.parse`, the rules between keys :mod:`harness.scenario.rules`, matrices
:mod:`harness.scenario.matrix`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

from harness.common.errors import shown
from harness.scenario.choices import (  # noqa: F401
    BACKENDS, GATED, PRECISIONS, RECIPE_NAMES, Activation, Backend, LossMask, MlmData, Normalization,
    PositionEmbedding, Precision, Preset, Recipe, RouterScore, SoftmaxType,
)
from harness.scenario.options import option
# The policies are part of the schema: parsing resolves their fields' types in this namespace.
from harness.scenario.policies import (  # noqa: F401
    CAPTURE_KINDS, CAPTURE_MODES, POLICIES, CaptureKind, CaptureMode, CapturePolicy, ComparePolicy, Expected,
    KnownDivergence, PolicyName,
)
from harness.scenario.side import Side  # noqa: F401


class Role(StrEnum):
    """What a side is for in a scenario. A str: role-keyed dicts and JSON read as before."""

    REFERENCE = "reference"
    CANDIDATE = "candidate"
    GOLDEN = "golden"
    SAVER = "saver"
    """A checkpoint scenario's saving side: it trains and saves, and is not compared."""


COMPARED_ROLES = (Role.REFERENCE, Role.CANDIDATE, Role.GOLDEN)
"""The roles whose traces a compare reads, in this order."""


# The top-level keys of a scenario file (a matrix file adds [matrix]).
TOP_KEYS = frozenset({
    "name", "description", "timeout_s", "model", "data", "train", "reference", "candidate",
    "golden", "capture", "compare", "axes", "expect", "checkpoint",
})
# Any integer beyond this is a typo or an attack whatever the machine (sizes, seeds, steps).
HARD_INT_LIMIT = 2**31
# What one CPU machine of this project's kind can run; `--no-limits` lifts them.
LIMITS = {
    "num_layers": 64, "hidden_size": 8192, "ffn_hidden_size": 32768, "num_attention_heads": 256,
    "seq_length": 8192, "vocab_size": 262144, "micro_batch_size": 1024, "global_batch_size": 65536,
    "steps": 10000, "world_size": 64, "timeout_s": 7 * 86400.0,
    "parameters": 200_000_000,  # an fp64 golden with Adam keeps 4 copies: 6.4 GB
    "tokens_per_step": 4_194_304,  # activations of a step, per layer, scale with it
}
# Scenario names become file and folder names: one strict rule, checked before any is used.
NAME_RULE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=,@-]{0,127}")


def check_scenario_name(name: Any) -> str | None:
    """None if ``name`` is a safe scenario name (a single path component), else why not."""
    if not isinstance(name, str) or not name:
        return f"must be a non-empty string, got {shown(name)}"
    if not NAME_RULE.fullmatch(name) or ".." in name:
        return (f"{shown(name)} is not a valid name: 1-128 characters of letters, digits and . _ + = , @ -, "
                "starting with a letter or digit, without '..' (names become file names)")
    return None


# Routed experts and MTP: megatron-core's, and the golden's.
MOE_BACKENDS = frozenset({"megatron", "torch"})
# The architecture switches: megatron-core's, Megatron-LM's (through its flags), and the golden's.
ARCH_BACKENDS = frozenset({"megatron", "mlm", "torch"})
# The switches Megatron-Bridge's GPTModelProvider (a TransformerConfig) takes as well.
PROVIDER_BACKENDS = ARCH_BACKENDS | {"bridge"}


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """The GPT architecture. Defaults (no linear bias, LayerNorm, GeLU MLP, learned absolute
    positions) match the GTP seed comparison; dropout 0, fp32 softmax and the causal mask are fixed."""

    SECTION: ClassVar[str] = "model"

    preset: Preset | None = option(
        None, "architecture", """a model family's switches at tiny sizes (harness/scenario/presets.py says
        which); every other key of [model] set beside it overrides the preset's value""", added_later=True)
    num_layers: int = option(2, "architecture", "transformer layers", low=1,
                             mcore=("TransformerConfig.num_layers",), mlm="--num-layers")
    hidden_size: int = option(128, "architecture", "model width", low=1,
                              mcore=("TransformerConfig.hidden_size",), mlm="--hidden-size")
    ffn_hidden_size: int = option(256, "architecture", "MLP inner width", low=1,
                                  mcore=("TransformerConfig.ffn_hidden_size",), mlm="--ffn-hidden-size")
    num_attention_heads: int = option(
        4, "architecture", "attention heads (query heads where num_query_groups is set)", low=1,
        mcore=("TransformerConfig.num_attention_heads",), mlm="--num-attention-heads")
    seq_length: int = option(64, "architecture", "tokens per sample", low=1,
                             mcore=("GPTModel.max_sequence_length",), mlm="--seq-length")
    vocab_size: int = option(
        128, "architecture", """vocabulary size: the data draws its tokens from it; the model's word embedding
        and output layer hold it padded (make_vocab_size_divisible_by)""", low=1,
        mcore=("GPTModel.vocab_size (padded)",), mlm="--vocab-size")
    make_vocab_size_divisible_by: int = option(
        1, "architecture", """the model's vocabulary is vocab_size padded to a multiple of this x TP, as
        Megatron-LM pads it (1: padded only where TP does not divide vocab_size). The padded rows are
        parameters as the others (initialized, trained; the output layer's take part in the softmax
        denominator); no token reaches them. Every side and the golden must hold the same padded size""",
        low=1, backends=ARCH_BACKENDS, added_later=True,
        mcore=("GPTModel.vocab_size (vocab_size padded to a multiple of this x TP)",),
        mlm="--make-vocab-size-divisible-by")
    untie_embeddings: bool = option(
        True, "architecture", """a separate output layer weight; false: the output layer computes with the
        word embedding's (tied); under GTP megatron-core's sides run it (the torch backend's GTP does not)""",
        mcore=("GPTModel.share_embeddings_and_output_weights (negated)",),
        mlm="--untie-embeddings-and-output-weights")
    add_bias_linear: bool = option(
        False, "architecture", """a bias on every linear layer (fused QKV, attention projection, fc1, fc2):
        a column-parallel layer's bias is cut with its weight's rows over TP, a row-parallel layer's is
        whole, and under GTP every bias is replicated over the GTP group (never GTP-sharded)""",
        backends=PROVIDER_BACKENDS, added_later=True, mcore=("TransformerConfig.add_bias_linear",),
        mlm="--disable-bias-linear (negated)")
    add_qkv_bias: bool = option(
        False, "architecture", """a bias on the fused QKV projection alone (Qwen's); add_bias_linear
        implies it""",
        backends=PROVIDER_BACKENDS, added_later=True, mcore=("TransformerConfig.add_qkv_bias",),
        mlm="--add-qkv-bias")
    activation: Activation = option(
        "gelu", "architecture", """the MLP's activation. ``swiglu`` (silu) and ``geglu`` (gelu) gate it: fc1
        holds [gate; up], 2 x ffn_hidden_size rows, and TP cuts each half (rank r holds [gate_r; up_r],
        megatron-core's partition_stride 2), GTP the TP-local block; ``gelu``, ``relu`` and ``squared_relu``
        are plain""", backends=PROVIDER_BACKENDS, added_later=True,
        mcore=("TransformerConfig.gated_linear_unit (swiglu, geglu)",
               "TransformerConfig.activation_func (derived)"),
        mlm="--swiglu (swiglu; --squared-relu: squared_relu)")
    normalization: Normalization = option(
        "LayerNorm", "architecture", """every norm of the model (the layers' two, the final one, MTP's):
        torch's ``LayerNorm`` (weight and bias) or ``RMSNorm`` (weight only), eps 1e-5; replicated over
        TP and GTP""",
        backends=PROVIDER_BACKENDS, added_later=True, mcore=("TransformerConfig.normalization",),
        mlm="--normalization (RMSNorm)")
    num_query_groups: int | None = option(
        None, "architecture", """key/value heads, each shared by num_attention_heads / num_query_groups query
        heads (grouped-query attention; 1: multi-query; none: one per head, multi-head attention). The fused
        QKV holds per group its query heads, its key, its value; TP cuts whole groups""", low=1,
        backends=PROVIDER_BACKENDS, added_later=True, mcore=("TransformerConfig.num_query_groups",),
        mlm="--num-query-groups (with --group-query-attention)")
    position_embedding_type: PositionEmbedding = option(
        "learned_absolute", "architecture", """``learned_absolute``: a position embedding table (replicated
        over TP and GTP) added to the word embedding; ``rope``: rotary embeddings on the queries and keys (no
        parameters); ``none``: no positions""", backends=PROVIDER_BACKENDS, added_later=True,
        mcore=("GPTModel.position_embedding_type",), mlm="--position-embedding-type (rope, none)")
    rotary_percent: float = option(
        1.0, "architecture", """the share of each head's channels RoPE rotates (the first int(head dim x
        rotary_percent), an even count); with ``rope`` only""", low=0.0, high=1.0, high_inclusive=True,
        backends=PROVIDER_BACKENDS, added_later=True, mcore=("GPTModel.rotary_percent",),
        mlm="--rotary-percent (with rope)")
    rotary_base: int = option(
        10000, "architecture", "RoPE's base: the inverse frequencies are base^(-2i / rotary dim); with "
        "``rope`` only", low=1, backends=PROVIDER_BACKENDS, added_later=True, mcore=("GPTModel.rotary_base",),
        mlm="--rotary-base (with rope)")
    parallel_output: bool = option(
        True, "loss", """the logits stay cut over TP into the vocab-parallel cross entropy; false: the output
        layer gathers them over TP first. TP 1 only, and bf16 on megatron: megatron-core's loss runs the
        vocab-parallel cross entropy over TP on the gathered logits (off by log TP), and in fp32 its backward
        raises (validate says where)""", backends=frozenset({"megatron", "torch"}), added_later=True,
        mcore=("GPTModel.parallel_output",))
    label_smoothing: float = option(
        0.0, "loss", """the cross entropy's label smoothing: refused, as no switch of megatron-core or
        Megatron-LM reaches vocab_parallel_cross_entropy's""", low=0.0, high=1.0,
        backends=frozenset(), added_later=True)
    qk_layernorm: bool = option(
        False, "architecture", """a norm (of ``normalization``'s type, eps 1e-5) over each query head and
        each key head (the head dim) after the QKV split, before RoPE: ``self_attention.q_layernorm`` and
        ``k_layernorm``, replicated over TP and GTP; their grads are summed over TP (each TP rank's heads
        give a part); the local layer spec's q_layernorm / k_layernorm with it""",
        backends=PROVIDER_BACKENDS, added_later=True, mcore=("TransformerConfig.qk_layernorm",),
        mlm="--qk-layernorm")
    softmax_type: SoftmaxType = option(
        "vanilla", "architecture", """the attention softmax: ``off-by-one`` adds a zero logit to each
        row's denominator, ``learnable`` a logit per head, ``self_attention.core_attention.softmax_offset``
        (cut over TP with the heads, replicated over GTP)""", backends=ARCH_BACKENDS, added_later=True,
        mcore=("TransformerConfig.softmax_type",), mlm="--softmax-type (off-by-one, learnable)")
    init_std: float = option(
        0.02, "architecture", "std of the normal initialization; output projections use std / sqrt(2 x "
        "num_layers)", mcore=("TransformerConfig.init_method_std",), mlm="--init-method-std")
    num_experts: int = option(
        0, "MoE", """routed experts per layer (0: a dense MLP): megatron-core's MoE layer on the local spec,
        ``TopKRouter``, the alltoall dispatcher, ``SequentialMLP``""", low=0, backends=MOE_BACKENDS,
        added_later=True, mcore=("TransformerConfig.num_moe_experts (with experts)",), mlm="--num-experts")
    moe_topk: int = option(2, "MoE", "experts each token is routed to", backends=MOE_BACKENDS,
                           added_later=True, mcore=("TransformerConfig.moe_router_topk (with experts)",),
                           mlm="--moe-router-topk")
    moe_aux_loss_coeff: float = option(
        0.01, "MoE", "coefficient of the load-balancing (``aux_loss``) loss, per layer and micro-batch",
        low=0.0, backends=MOE_BACKENDS, added_later=True,
        mcore=("TransformerConfig.moe_aux_loss_coeff (with experts)",),
        mlm="--moe-aux-loss-coeff")
    moe_shared_expert_intermediate_size: int | None = option(
        None, "MoE", """FFN size of the shared experts every token also passes (none: no shared experts):
        megatron-core's ``SharedExpertMLP`` (no gate, no overlap), a dense MLP (gated as ``activation``)
        cut by TP and dense GTP as the dense MLP is; its output is added to the routed experts'""",
        low=1, backends=MOE_BACKENDS, added_later=True,
        mcore=("TransformerConfig.moe_shared_expert_intermediate_size (with experts)",),
        mlm="--moe-shared-expert-intermediate-size")
    moe_router_score_function: RouterScore = option(
        "softmax", "MoE", """the router's score: ``softmax`` over the top-k logits, or ``sigmoid`` of the
        logits, the top-k normalized to sum 1 (k > 1); the load-balancing loss's scores likewise (softmax, or
        the sigmoids normalized over all experts)""", backends=MOE_BACKENDS, added_later=True,
        mcore=("TransformerConfig.moe_router_score_function (with experts)",),
        mlm="--moe-router-score-function")
    moe_router_num_groups: int | None = option(
        None, "MoE", """expert groups of group-limited routing (with moe_router_group_topk): experts are cut
        into this many equal groups, in index order""", low=1, backends=MOE_BACKENDS, added_later=True,
        mcore=("TransformerConfig.moe_router_num_groups (with experts)",), mlm="--moe-router-num-groups")
    moe_router_group_topk: int | None = option(
        None, "MoE", """groups each token may route to (group-limited top-k): the groups with the largest
        sums of their top (moe_topk / this) scores; the top-k experts are then taken from those groups""",
        low=1, backends=MOE_BACKENDS, added_later=True,
        mcore=("TransformerConfig.moe_router_group_topk (with experts)",), mlm="--moe-router-group-topk")
    moe_router_padding_mask: bool = option(
        False, "MoE", """hand megatron-core's GPTModel.forward the tokens the variable loss mask drops as
        its ``padding_mask`` (True = padding): the router leaves them out of the load-balancing loss (its
        scores, token counts and token total) and, under per-token loss, out of the token count its value
        is weighted by; the routing itself is unchanged. With experts, ``[data].loss_mask = "variable"``
        and a non-zero moe_aux_loss_coeff only (else it changes nothing). Not on mlm: Megatron-LM's
        pretrain_gpt hands the model no padding_mask (its packed-sequence batches alone build one)""",
        backends=MOE_BACKENDS, added_later=True,
        mcore=("GPTModel.forward(padding_mask) (the loss mask's dropped tokens)",))
    mtp_num_layers: int = option(
        0, "MTP", """multi-token prediction depths D (0: none): depth d predicts the token d + 1 places
        ahead with the shared embedding and output layer""", low=0, backends=MOE_BACKENDS, added_later=True,
        mcore=("TransformerConfig.mtp_num_layers (with MTP)",), mlm="--mtp-num-layers")
    mtp_use_repeated_layer: bool = option(
        False, "MTP", "one MTP layer applied at every depth instead of D layers", backends=MOE_BACKENDS,
        added_later=True, mcore=("TransformerConfig.mtp_use_repeated_layer (with MTP)",),
        mlm="--mtp-use-repeated-layer")
    mtp_loss_scaling_factor: float = option(
        0.1, "MTP", "weight of the MTP loss: the mean of the D depths' losses times this joins the objective",
        low=0.0, backends=MOE_BACKENDS, added_later=True,
        mcore=("TransformerConfig.mtp_loss_scaling_factor (with MTP)",),
        mlm="--mtp-loss-scaling-factor")


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    """Synthetic token data, generated from (seed, global sample id)."""

    SECTION: ClassVar[str] = "data"

    seed: int = option(1234, "data", "seed of the token generator", low=0)
    micro_batch_size: int = option(1, "data", "samples per micro-batch per data rank", low=1,
                                   mlm="--micro-batch-size")
    global_batch_size: int = option(2, "data", "samples per optimizer step across all data ranks and "
                                    "micro-batches", low=1, mlm="--global-batch-size")
    loss_mask: LossMask = option(
        "none", "data", """``variable``: each sample counts only its first n tokens in the loss (n drawn
        from (seed, sample id) in 1..seq_length), so token counts differ per sample and micro-batch and
        only the global token count normalizes the loss right""", added_later=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class Scenario:
    """A reference and a candidate, measured against a golden, on one model and data."""

    name: str
    source: str
    model: ModelConfig
    data: DataConfig
    reference: Side
    candidate: Side
    golden: Side
    capture: CapturePolicy = field(default_factory=CapturePolicy)
    compare: ComparePolicy = field(default_factory=ComparePolicy)
    description: str = ""
    timeout_s: float = 600.0
    axes: dict = field(default_factory=dict)
    """Matrix axis -> value label this scenario was expanded with (empty outside a matrix)."""
    expect: KnownDivergence | None = None
    """A known divergence (``[expect]``), or None: parity is expected."""
    saver: Side | None = None
    """A checkpoint scenario's saving side: trains to the candidate's ``load_step`` and saves."""

    @property
    def sides(self) -> dict[Role, Side]:
        return {Role.REFERENCE: self.reference, Role.CANDIDATE: self.candidate, Role.GOLDEN: self.golden}
