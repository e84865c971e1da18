"""The scenario schema: what a scenario file may say, as dataclasses with documented fields.

A scenario is one model and data configuration, a reference side and a candidate side (the
two implementations under comparison, e.g. GTP off vs GTP 2) and a golden side (the ``torch``
backend in one process, fp64 or fp32) that both are measured against. Choices are ``Literal``
types; sizes one machine can run are :data:`LIMITS`. Parsing is :mod:`harness.scenario.parse`, the
rules between keys :mod:`harness.scenario.rules`, matrices :mod:`harness.scenario.matrix`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal, get_args

from harness.common.errors import shown
# The policies are part of the schema: parsing resolves their fields' types in this namespace.
from harness.scenario.policies import (  # noqa: F401
    CAPTURE_KINDS, CAPTURE_MODES, POLICIES, CaptureKind, CaptureMode, CapturePolicy, ComparePolicy, Expectation,
    Expected, PolicyName,
)  # fmt: skip

class Role(StrEnum):
    """What a side is for in a scenario. A str: role-keyed dicts and JSON read as before."""

    REFERENCE = "reference"
    CANDIDATE = "candidate"
    GOLDEN = "golden"
    SAVER = "saver"
    """A checkpoint scenario's saving side: it trains and saves, and is not compared."""


COMPARED_ROLES = (Role.REFERENCE, Role.CANDIDATE, Role.GOLDEN)
"""The roles whose traces a compare reads, in this order."""


# The choices of every key, as types (the dataclasses below read as the schema) and as sets.
Backend = Literal["megatron", "torch", "mlm", "bridge"]
Precision = Literal["fp64", "fp32", "bf16"]
# "none" or a key of harness.quant.RECIPES (kept literal here: parsing needs no torch).
Recipe = Literal["none", "delayed", "float8_current_scaling", "mxfp8", "float8_block_scaling", "nvfp4"]
Optimizer = Literal["adam", "sgd", "muon"]
# megatron-core's Muon ``tp_mode``: how a TP- (and GTP-) sharded matrix is orthogonalized.
MuonTpMode = Literal["blockwise", "duplicated", "distributed"]
DecayStyle = Literal["constant", "linear", "cosine"]
Recompute = Literal["none", "selective", "full"]
PerTokenLoss = Literal["none", "transformer-config", "both"]
Collectives = Literal["async", "eager", "lagging"]
LossMask = Literal["none", "variable"]
ProcessGroups = Literal["parallel-state", "collection", "collection-permuted"]

BACKENDS = frozenset(get_args(Backend))
PRECISIONS = {"megatron": frozenset({"fp32", "bf16"}), "torch": frozenset(get_args(Precision)),
              "mlm": frozenset({"fp32", "bf16"}), "bridge": frozenset({"fp32", "bf16"})}
# The mlm backend's data: Megatron-LM's --mock-data pipeline, or the harness's synthetic samples.
MlmData = Literal["synthetic", "mock"]
MLM_DATA = frozenset(get_args(MlmData))
OPTIMIZERS = frozenset(get_args(Optimizer))
MUON_TP_MODES = frozenset(get_args(MuonTpMode))
RECIPE_NAMES = frozenset(get_args(Recipe))
LR_DECAY_STYLES = frozenset(get_args(DecayStyle))
RECOMPUTES = frozenset(get_args(Recompute))
PER_TOKEN_LOSSES = frozenset(get_args(PerTokenLoss))
COLLECTIVES = frozenset(get_args(Collectives))
LOSS_MASKS = frozenset(get_args(LossMask))
PROCESS_GROUPS = frozenset(get_args(ProcessGroups))

# The top-level keys of a scenario file (a matrix file adds [matrix]).
TOP_KEYS = frozenset({
    "name", "description", "timeout_s", "model", "data", "train", "reference", "candidate",
    "golden", "capture", "compare", "axes", "expect", "checkpoint",
})  # fmt: skip
# Any integer beyond this is a typo or an attack whatever the machine (sizes, seeds, steps).
HARD_INT_LIMIT = 2**31
# What one CPU machine of this project's kind can run; `--no-limits` lifts them.
LIMITS = {
    "num_layers": 64, "hidden_size": 8192, "ffn_hidden_size": 32768, "num_attention_heads": 256,
    "seq_length": 8192, "vocab_size": 262144, "micro_batch_size": 1024, "global_batch_size": 65536,
    "steps": 10000, "world_size": 64, "timeout_s": 7 * 86400.0,
    "parameters": 200_000_000,  # an fp64 golden with Adam keeps 4 copies: 6.4 GB
    "tokens_per_step": 4_194_304,  # activations of a step, per layer, scale with it
}  # fmt: skip
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


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """The GPT architecture. Fixed choices (no linear bias, LayerNorm, GeLU MLP, learned
    absolute positions, dropout 0, fp32 softmax, causal mask) match the GTP seed comparison."""

    num_layers: int = 2
    """Transformer layers."""
    hidden_size: int = 128
    """Model width."""
    ffn_hidden_size: int = 256
    """MLP inner width."""
    num_attention_heads: int = 4
    """Attention heads (query groups equal heads: plain multi-head attention)."""
    seq_length: int = 64
    """Tokens per sample."""
    vocab_size: int = 128
    """Vocabulary size (not padded: TP must divide it)."""
    untie_embeddings: bool = True
    """Separate output layer weight. GTP does not support tied embeddings."""
    init_std: float = 0.02
    """Std of the normal initialization; output projections use std / sqrt(2 * num_layers)."""
    num_experts: int = 0
    """Routed experts per layer (0: a dense MLP). megatron-core's MoE layer on the local spec:
    ``TopKRouter`` (softmax over the top-k logits), the alltoall dispatcher, ``SequentialMLP``."""
    moe_topk: int = 2
    """Experts each token is routed to."""
    moe_aux_loss_coeff: float = 0.01
    """Coefficient of the load-balancing (``aux_loss``) loss, per layer and micro-batch."""
    mtp_num_layers: int = 0
    """Multi-token prediction depths D (0: none): megatron-core's MTP block on the local spec,
    depth d predicting the token d + 1 places ahead with the shared embedding and output layer."""
    mtp_use_repeated_layer: bool = False
    """One MTP layer applied at every depth (``mtp_use_repeated_layer``) instead of D layers."""
    mtp_loss_scaling_factor: float = 0.1
    """Weight of the MTP loss: the mean of the D depths' losses times this joins the objective."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    """Synthetic token data, generated from (seed, global sample id)."""

    seed: int = 1234
    """Seed of the token generator."""
    micro_batch_size: int = 1
    """Samples per micro-batch per data rank."""
    global_batch_size: int = 2
    """Samples per optimizer step across all data ranks and micro-batches."""
    loss_mask: LossMask = "none"
    """``variable``: each sample counts only its first n tokens in the loss (n drawn from
    (seed, sample id) in 1..seq_length; the rest is padding), so token counts differ per sample
    and micro-batch and only the global token count normalizes the loss right."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Side:
    """One implementation under comparison: backend, topology, precision and training."""

    backend: Backend = "megatron"
    """``megatron`` (megatron-core's own GTP in the harness's loop), ``mlm`` (Megatron-LM's
    ``pretrain`` loop over megatron-core) or ``torch`` (the harness's plain PyTorch GPT)."""
    world_size: int = 1
    """Processes launched for this side."""
    megatron_core: str = "installed"
    """The megatron-core this side imports (megatron and mlm backends): ``installed`` (the
    venv's), a folder holding ``megatron/`` (a Megatron-LM checkout), or
    ``git:<repo folder>@<rev>`` (that revision's ``megatron/``, cached by commit id)."""
    bridge: str = "installed"
    """The Megatron-Bridge a ``bridge`` side runs (``installed``, a checkout, or
    ``git:<repo folder>@<rev>``: that revision's ``src/megatron/bridge``)."""
    tp: int = 1
    """Tensor-parallel size."""
    gtp: int = 1
    """GTP rematerialization degree G = num_weight_shards / TP (1 = GTP off)."""
    dp: int | None = None
    """Replicate data-parallel size; derived as world / (TP * G) when omitted."""
    precision: Precision = "fp32"
    """Parameter and compute precision: fp32 or bf16 (megatron); fp64, fp32 or bf16 (torch)."""
    recipe: Recipe = "none"
    """Quantization recipe of the linear GEMMs: none, delayed, float8_current_scaling, mxfp8,
    float8_block_scaling or nvfp4 (Transformer Engine's recipes). The megatron backend needs
    Transformer Engine for any recipe; the torch backend emulates them (harness.quant)."""
    gtp_pad_alignment: int = 16
    """GTP pads dim 0 to a multiple of alignment * G (MCore's ``pad_for_alignment``)."""
    steps: int = 3
    """Optimizer steps."""
    seed: int = 1234
    """Seed of the canonical initial weights."""
    optimizer: Optimizer = "adam"
    """adam (decoupled weight decay, as megatron-core's Adam), sgd, or muon (megatron-core's
    ``TensorParallelMuon`` from ``emerging-optimizers`` on 2-D weights, Adam on embeddings, the
    output layer and 1-D params, as megatron-core splits them)."""
    muon_tp_mode: MuonTpMode = "duplicated"
    """muon: megatron-core's ``muon_tp_mode``: ``duplicated`` (each rank orthogonalizes the whole
    gathered matrix), ``distributed`` (Newton-Schulz with its Gram matrices all-reduced over
    the sharding group) or ``blockwise`` (each TP shard alone; under GTP, see docs/muon.md)."""
    muon_blocks: int = 1
    """muon, the golden: orthogonalize each matrix in this many blocks along its TP dim, as the
    blockwise mode at that TP does (set from the reference's TP for a blockwise scenario)."""
    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: float = 3e-5
    """Learning rate at the end of decay."""
    lr_warmup_steps: int = 1
    """Linear warmup steps."""
    lr_decay_steps: int | None = None
    """Steps over which the LR decays (default: steps)."""
    lr_decay_style: DecayStyle = "cosine"
    """constant, linear or cosine."""
    weight_decay: float = 0.01
    """Weight decay on matrices (not on biases and norms)."""
    clip_grad: float = 1.0
    """Global grad-norm clip; 0 disables."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.0
    """SGD momentum (0: plain SGD, which exposes gradient scaling faults)."""
    eval_interval: int = 0
    """Evaluate after every this many steps and after the last (Megatron-LM's
    ``--eval-interval`` and final validation; :mod:`harness.backends.evaluation`); 0: never."""
    eval_iters: int = 1
    """Forward-only iterations of one global batch of validation samples per evaluation."""
    # --- GTP's other code paths (megatron backend; the golden does not inherit them) ---
    gtp_weight_prefetch: bool = True
    """GTP's weight prefetch chains (megatron-core's default): ``update_gtp_config(weight_prefetch=)``."""
    gtp_collectives: Collectives = "async"
    """``async``: GTP's collectives overlap compute as megatron-core issues them; ``eager``: each
    completes when it is issued, the schedule of a communication stream running ahead of the
    GEMMs, which makes a GEMM that reads a reused gather buffer read it deterministically;
    ``lagging``: an async collective's output lands only when its handle (or a later one of its
    group) is waited, the schedule of a communication stream running behind the GEMMs, under
    which a read without its wait reads the buffer's previous content every time."""
    recompute: Recompute = "none"
    """Activation recompute: ``selective`` (core attention) or ``full`` (uniform, one layer per
    checkpoint): TransformerConfig ``recompute_granularity`` / ``recompute_method``."""
    per_token_loss: PerTokenLoss = "none"
    """Loss summed over tokens and normalized by the global token count:
    ``transformer-config`` sets TransformerConfig ``calculate_per_token_loss`` alone (as a user
    of the API would); ``both`` also ``configure_gtp_remat_from_recipe(calculate_per_token_loss=)``
    (as Megatron-LM's arguments do)."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (TP > 1): activations outside the TP regions are sharded
    over TP along the sequence; LayerNorm grads are all-reduced over TP in finalize."""
    overlap_grad_reduce: bool = False
    """DDP overlaps its grad reduce-scatters / all-reduces with backward (bucketed)."""
    grad_reduce_in_fp32: bool = True
    """DDP's main_grad and its reductions in fp32; false: in bf16 (``--grad-reduce-in-bf16``)."""
    bucket_size: int | None = None
    """DDP bucket size in elements (small: several buckets); None: megatron-core's default."""
    overlap_param_gather: bool = False
    """The distributed optimizer's param all-gather waits for the next forward (DDP's forward
    pre-hooks, enabled after the first step as Megatron-LM's ``train()`` does)."""
    distributed_optimizer: bool = False
    """megatron-core's DistributedOptimizer: grads reduce-scattered over the data-parallel
    group, each rank steps its range of every buffer, params all-gathered after the step."""
    process_groups: ProcessGroups = "parallel-state"
    """Where megatron-core's layers, DDP, finalize, optimizer and schedule take their groups:
    ``parallel-state`` (its globals), ``collection`` (a ``ProcessGroupCollection`` of the same
    groups, passed explicitly) or ``collection-permuted`` (one whose GTP peers are paired across
    replicate DP instead: the same sizes, another pairing; :class:`harness.common.mesh.Mesh`)."""
    args: tuple[str, ...] = ()
    """mlm backend: extra pretrain_gpt.py flags, after the side's own (checked by Megatron-LM's parser)."""
    data: MlmData = "synthetic"
    """mlm and bridge backends: ``synthetic`` (the harness's samples by global sample id, comparable with
    every other backend) or ``mock`` (Megatron-LM's ``--mock-data`` pipeline)."""
    inject: tuple[str, ...] = ()
    """Planted faults (names from ``gtp-parity inject --list``), for the harness's self-test."""
    mutant: str = ""
    """A mutant of megatron-core's GTP code (an id from ``gtp-parity mutate``) this side runs
    with (megatron backend; the mutation campaign sets it)."""
    ep: int = 1
    """Expert-parallel size (``expert_model_parallel_size``): the experts are split over EP ranks."""
    expert_gtp: int = 1
    """Expert GTP degree EG = ``expert_tensor_parallel_num_weight_shards`` / expert TP (1 = off)."""
    pipeline_parallel: int = 1
    """Pipeline stages (megatron backend): layers split evenly, embedding on the first stage,
    output layer and loss on the last; megatron-core's 1F1B schedule over the micro-batches."""
    virtual_pipeline: int | None = None
    """Model chunks per stage (megatron-core's interleaved schedule); None: not interleaved."""
    # --- checkpoint topology (megatron backend; set by a scenario's [checkpoint] table) ---
    save_step: int = 0
    """Train to this step, save a ``torch_dist`` checkpoint, stop (0: no checkpoint)."""
    load_step: int = 0
    """Load the checkpoint of this step (saved by ``resume_from``) and train on from it (0: none)."""
    resume_from: str = ""
    """The key of the side whose checkpoint this side loads (part of this side's key)."""

    @property
    def data_ranks(self) -> int:
        """Ranks that read distinct samples: GTP peers are data ranks (world / (TP x PP))."""
        return self.world_size // (self.tp * self.pipeline_parallel)

    @property
    def replicate_dp(self) -> int:
        return self.world_size // (self.tp * self.gtp * self.pipeline_parallel)

    def num_microbatches(self, data: DataConfig) -> int:
        return data.global_batch_size // (data.micro_batch_size * self.data_ranks)

    def key(self, model: ModelConfig, data: DataConfig) -> str:
        """A short hash identifying what this side computes; equal sides share one run."""
        docs = [dataclasses.asdict(self), dataclasses.asdict(model), dataclasses.asdict(data)]
        for doc, later in zip(docs, _ADDED_LATER):
            for k, default in later.items():  # at its default, a key added later leaves the key as it was
                if doc[k] == default:
                    del doc[k]
        blob = json.dumps(docs, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def label(self) -> str:
        gtp = f"gtp{self.gtp}" if self.gtp > 1 else "gtpoff"
        recipe = "" if self.recipe == "none" else f"-{self.recipe}"
        experts = f"-ep{self.ep}-egtp{self.expert_gtp}" if self.ep * self.expert_gtp > 1 else ""
        pp = "" if self.pipeline_parallel == 1 else f"-pp{self.pipeline_parallel}"
        pp += f"v{self.virtual_pipeline}" if self.virtual_pipeline else ""
        return f"{self.backend}-w{self.world_size}-tp{self.tp}{pp}-{gtp}{experts}-{self.precision}{recipe}"

    def paths(self) -> dict[str, Any]:
        """The code paths this side takes off the plainest one (what a report says was exercised)."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        keys = (*MEGATRON_PATH_OPTIONS, "grad_reduce_in_fp32")
        return {k: getattr(self, k) for k in keys if getattr(self, k) != defaults[k]}


# Keys of (side, model, data) added after traces were first keyed, with their defaults: a side
# that leaves them at the default keeps the key it had before (its traces stay reusable).
_ADDED_LATER = (
    {"megatron_core": "installed", "mutant": "", "save_step": 0, "load_step": 0, "resume_from": "", "ep": 1, "expert_gtp": 1,
     "pipeline_parallel": 1, "virtual_pipeline": None, "grad_reduce_in_fp32": True,
     "process_groups": "parallel-state", "muon_tp_mode": "duplicated", "muon_blocks": 1,
     "eval_interval": 0, "eval_iters": 1, "bridge": "installed"},
    {"num_experts": 0, "moe_topk": 2, "moe_aux_loss_coeff": 0.01, "mtp_num_layers": 0,
     "mtp_use_repeated_layer": False, "mtp_loss_scaling_factor": 0.1},
    {"loss_mask": "none"},
)  # fmt: skip


# Keys of a side that only the megatron backend reads; the golden side does not inherit them.
MEGATRON_PATH_OPTIONS = ("gtp_weight_prefetch", "gtp_collectives", "recompute", "per_token_loss",
                         "sequence_parallel", "overlap_grad_reduce", "bucket_size", "distributed_optimizer",
                         "overlap_param_gather", "pipeline_parallel", "virtual_pipeline",
                         "save_step", "load_step", "resume_from", "process_groups", "muon_tp_mode")  # fmt: skip


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
    expect: Expectation | None = None
    """A known divergence (``[expect]``), or None: parity is expected."""
    saver: Side | None = None
    """A checkpoint scenario's saving side: trains to the candidate's ``load_step`` and saves."""

    @property
    def sides(self) -> dict[Role, Side]:
        return {Role.REFERENCE: self.reference, Role.CANDIDATE: self.candidate, Role.GOLDEN: self.golden}
