"""A side's keys, declared once each (:func:`~harness.scenario.options.option`): one implementation
under comparison, its backend and code, topology, precision, optimizer and schedule, evaluation,
GTP's other code paths, checkpoint topology and the harness's self-test keys.

A side is ``[train]`` with ``[reference]`` / ``[candidate]`` / ``[golden]`` merged over it; the
golden's column of each declaration says what it inherits (:func:`~harness.scenario.options.golden_side`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any, ClassVar

from harness.scenario.choices import (
    Backend, Collectives, DecayStyle, MlmData, MuonTpMode, Optimizer, PerTokenLoss, Precision, ProcessGroups,
    Recipe, Recompute,
)
from harness.scenario.options import NEVER, OWN, Need, declared, keyed_later, option

MEGATRON = frozenset({"megatron"})
TREES = frozenset({"megatron", "mlm", "bridge"})  # the backends that import a megatron-core


def _needs(key: str, test, says: str, when=lambda value: True) -> tuple[Need, ...]:
    """One rule: where the option is off its default (and its value satisfies ``when``), ``key``
    must pass ``test``."""
    return (Need(applies=when, holds=lambda side: test(getattr(side, key)), says=says),)


@dataclass(frozen=True, kw_only=True, slots=True)
class Side:
    """One implementation under comparison: backend, topology, precision and training."""

    SECTION: ClassVar[str] = "side"

    # --- backend and the code under test ---
    backend: Backend = option(
        "megatron", "backend", """``megatron`` (megatron-core's own GTP in the harness's loop), ``mlm``
        (Megatron-LM's ``pretrain`` loop), ``bridge`` (Megatron-Bridge's) or ``torch`` (the harness's
        plain PyTorch GPT; the golden)""", golden=OWN, golden_value="torch", carried=True)
    megatron_core: str = option(
        "installed", "backend", """the megatron-core a side imports: ``installed`` (the venv's), a folder
        holding ``megatron/``, or ``git:<repository>@<rev>`` (a configured name, a git URL or a folder)""",
        backends=TREES, golden=NEVER, placement_only=True, added_later=True)
    bridge: str = option(
        "installed", "backend", """the Megatron-Bridge a ``bridge`` side runs (``installed``, a checkout,
        or ``git:<repository>@<rev>``)""", backends=frozenset({"bridge"}), golden=NEVER, added_later=True)
    args: tuple[str, ...] = option(
        (), "backend", """extra ``pretrain_gpt.py`` flags after the side's own, checked by Megatron-LM's
        parser; a flag a declared key sets, or one that shapes parameters or the parallel layout, is
        refused""", backends=frozenset({"mlm"}), golden=NEVER)
    data: MlmData = option(
        "synthetic", "backend", """``synthetic`` (the harness's samples by global sample id) or ``mock``
        (the frontend's ``--mock-data`` pipeline)""", backends=frozenset({"mlm", "bridge"}), golden=NEVER,
        mlm="--mock-data (mock)")

    # --- topology ---
    world_size: int = option(1, "topology", "processes launched for this side", low=1, golden=OWN,
                             golden_value=1)
    tp: int = option(
        1, "topology", "tensor-parallel size", low=1, golden=OWN, golden_value=1,
        mcore=("TransformerConfig.tensor_model_parallel_size",), mlm="--tensor-model-parallel-size")
    gtp: int = option(
        1, "topology", "GTP degree G = num_weight_shards / TP (1 = GTP off)", low=1, golden=OWN,
        golden_value=1, placement_only=True,
        mcore=("TransformerConfig.tensor_parallel_num_weight_shards (TP x G)",),
        mlm="--tensor-parallel-num-weight-shards (TP x G)")
    dp: int | None = option(
        None, "topology", "replicate data-parallel size; derived as world / (TP x G) when omitted", low=1,
        golden=NEVER, placement_only=True)
    gtp_pad_alignment: int = option(
        16, "topology", "GTP pads dim 0 to a multiple of alignment x G", low=0, placement_only=True,
        carried=True, mcore=("gtp.update_gtp_config(pad_for_alignment)",))
    ep: int = option(
        1, "topology", "expert-parallel size: the experts are split over EP ranks", low=1, backends=MEGATRON,
        golden=OWN, golden_value=1, added_later=True,
        mcore=("parallel_state.initialize_model_parallel(expert_model_parallel_size)",),
        mlm="--expert-model-parallel-size")
    expert_gtp: int = option(
        1, "topology", "expert GTP degree EG = expert num_weight_shards / expert TP (1 = off)", low=1,
        backends=MEGATRON, golden=OWN, golden_value=1, added_later=True,
        mcore=("TransformerConfig.expert_tensor_parallel_num_weight_shards (expert TP x EG)",),
        mlm="--expert-tensor-parallel-num-weight-shards (expert TP x EG)")
    expert_tp: int | None = option(
        None, "topology", """the experts' own tensor-parallel size ETP (none: TP, as megatron-core defaults
        it); 1 or TP""", low=1, backends=MEGATRON, golden=NEVER, added_later=True,
        mcore=("parallel_state.initialize_model_parallel(expert_tensor_parallel_size) (none: TP)",
               "TransformerConfig.expert_tensor_parallel_size (none: TP)"),
        mlm="--expert-tensor-parallel-size")
    pipeline_parallel: int = option(
        1, "topology", """pipeline stages: layers split evenly, megatron-core's 1F1B schedule over the
        micro-batches""", low=1, backends=MEGATRON, golden=NEVER, path=True, added_later=True,
        mcore=("TransformerConfig.pipeline_model_parallel_size (PP > 1)",),
        mlm="--pipeline-model-parallel-size")
    virtual_pipeline: int | None = option(
        None, "topology", "model chunks per stage (the interleaved schedule); none: not interleaved", low=2,
        backends=MEGATRON, golden=NEVER, path=True, added_later=True,
        mcore=("TransformerConfig.virtual_pipeline_model_parallel_size (PP > 1)",),
        mlm="--num-virtual-stages-per-pipeline-rank",
        needs=_needs("pipeline_parallel", lambda pp: pp >= 2, "needs pipeline_parallel >= 2"))

    # --- precision ---
    precision: Precision = option(
        "fp32", "precision", "parameter and compute precision: fp32 or bf16 (megatron, mlm, bridge); fp64, "
        "fp32 or bf16 (torch)", golden=OWN, golden_value="fp64", carried=True,
        mcore=("TransformerConfig.bf16 (bf16)", "TransformerConfig.params_dtype (its dtype)"),
        mlm="--bf16 (bf16)")
    recipe: Recipe = option(
        "none", "precision", """quantization recipe of the linear GEMMs (Transformer Engine's recipes; the
        torch backend emulates them, the megatron backend needs Transformer Engine)""",
        backends=frozenset({"megatron", "torch"}), golden=OWN, golden_value="none", carried=True,
        mlm="--fp8-recipe")
    grad_reduce_in_fp32: bool = option(
        True, "precision", "DDP's main_grad and its reductions in fp32; false: in bf16",
        backends=frozenset({"megatron", "mlm"}), golden=NEVER, path=True, added_later=True,
        mcore=("DistributedDataParallelConfig.grad_reduce_in_fp32",), mlm="--grad-reduce-in-bf16 (false)",
        # fp32 params keep fp32 main_grads either way: the option would change nothing.
        needs=_needs("precision", lambda p: p == "bf16", "false takes effect only with precision bf16"))

    # --- training: steps, seed, optimizer, schedule ---
    steps: int = option(3, "training", "optimizer steps", low=1, carried=True, mlm="--train-iters")
    seed: int = option(1234, "training", "seed of the canonical initial weights", low=0, carried=True,
                       mlm="--seed")
    optimizer: Optimizer = option(
        "adam", "optimizer", """``adam`` (decoupled weight decay, as megatron-core's Adam), ``sgd``, or
        ``muon`` (megatron-core's Muon on 2-D weights, Adam on the rest)""", carried=True,
        mcore=("OptimizerConfig.optimizer",), mlm="--optimizer")
    muon_tp_mode: MuonTpMode = option(
        "duplicated", "optimizer", """muon: how a TP- and GTP-sharded matrix is orthogonalized:
        ``duplicated``, ``distributed`` or ``blockwise``""", backends=MEGATRON, golden=NEVER, path=True,
        added_later=True,
        mcore=("OptimizerConfig.muon_tp_mode (muon)",), mlm="--muon-tp-mode",
        needs=_needs("optimizer", lambda o: o == "muon", 'takes effect only with optimizer = "muon"'))
    muon_blocks: int = option(
        1, "optimizer", """muon, the golden: orthogonalize each matrix in this many blocks along its TP dim,
        as the blockwise mode at that TP does (set from the reference's TP for a blockwise scenario)""",
        low=1, backends=frozenset({"torch"}), added_later=True)
    lr: float = option(3e-4, "optimizer", "peak learning rate", low=0.0, carried=True,
                       mcore=("OptimizerConfig.lr",), mlm="--lr")
    min_lr: float = option(3e-5, "optimizer", "learning rate at the end of decay", low=0.0, carried=True,
                           mcore=("OptimizerConfig.min_lr",), mlm="--min-lr")
    lr_warmup_steps: int = option(1, "optimizer", "linear warmup steps", low=0, carried=True,
                                  mlm="--lr-warmup-iters")
    lr_decay_steps: int | None = option(None, "optimizer", "steps over which the LR decays (none: steps)",
                                        low=1, carried=True, mlm="--lr-decay-iters (none: steps)")
    lr_decay_style: DecayStyle = option("cosine", "optimizer", "constant, linear or cosine", carried=True,
                                        mlm="--lr-decay-style")
    weight_decay: float = option(0.01, "optimizer", "weight decay on matrices (not on biases and norms)",
                                 low=0.0, carried=True, mcore=("OptimizerConfig.weight_decay",),
                                 mlm="--weight-decay")
    clip_grad: float = option(1.0, "optimizer", "global grad-norm clip; 0 disables", low=0.0, carried=True,
                              mcore=("OptimizerConfig.clip_grad",), mlm="--clip-grad")
    adam_beta1: float = option(0.9, "optimizer", "Adam's beta1", low=0.0, high=1.0, carried=True,
                               mcore=("OptimizerConfig.adam_beta1",), mlm="--adam-beta1")
    adam_beta2: float = option(0.999, "optimizer", "Adam's beta2", low=0.0, high=1.0, carried=True,
                               mcore=("OptimizerConfig.adam_beta2",), mlm="--adam-beta2")
    adam_eps: float = option(1e-8, "optimizer", "Adam's epsilon", low=0.0, carried=True,
                             mcore=("OptimizerConfig.adam_eps",), mlm="--adam-eps")
    sgd_momentum: float = option(0.0, "optimizer", "SGD momentum (0: plain SGD, which exposes gradient "
                                 "scaling faults)", low=0.0, high=1.0, carried=True,
                                 mcore=("OptimizerConfig.sgd_momentum",), mlm="--sgd-momentum")
    # --- evaluation ---
    eval_interval: int = option(
        0, "evaluation", "evaluate after every this many steps and after the last; 0: never", low=0,
        added_later=True, mlm="--eval-interval (0: past the last step)")
    eval_iters: int = option(
        1, "evaluation", "forward-only iterations of one global batch of validation samples per evaluation",
        low=1, added_later=True, mlm="--eval-iters (0 without evaluation)")

    # --- GTP's other code paths (megatron backend; the golden runs none of them) ---
    gtp_weight_prefetch: bool = option(
        True, "code paths", "GTP's weight prefetch chains (megatron-core's default)", backends=MEGATRON,
        golden=NEVER, placement_only=True, path=True, mcore=("gtp.update_gtp_config(weight_prefetch)",))
    gtp_collectives: Collectives = option(
        "async", "code paths", """``async``: GTP's collectives overlap compute as megatron-core issues them;
        ``eager``: each completes when issued (a communication stream ahead of the GEMMs); ``lagging``: an
        async collective lands only when its handle is waited (a stream behind them)""", backends=MEGATRON,
        golden=NEVER, placement_only=True, path=True)
    recompute: Recompute = option(
        "none", "code paths", "activation recompute: ``selective`` (core attention) or ``full`` (uniform, "
        "one layer per checkpoint)", backends=MEGATRON, golden=NEVER, placement_only=True, path=True,
        mcore=("TransformerConfig.recompute_granularity (not none)",
               "TransformerConfig.recompute_method (full)"),
        mlm="--recompute-granularity")
    per_token_loss: PerTokenLoss = option(
        "none", "code paths", """loss summed over tokens, normalized by the global token count:
        ``transformer-config`` sets TransformerConfig's switch alone, ``both`` also GTP's
        (``configure_gtp_remat_from_recipe``)""", backends=MEGATRON, golden=NEVER, path=True, carried=True,
        mcore=("TransformerConfig.calculate_per_token_loss (not none)",
               "gtp.configure_gtp_remat_from_recipe(calculate_per_token_loss) (both)"),
        mlm="--calculate-per-token-loss")
    sequence_parallel: bool = option(
        False, "code paths", "Megatron's sequence parallelism: activations outside the TP regions sharded "
        "over TP along the sequence", backends=MEGATRON, golden=NEVER, path=True,
        mcore=("TransformerConfig.sequence_parallel",), mlm="--sequence-parallel",
        needs=_needs("tp", lambda tp: tp > 1, "needs TP > 1 (it shards the sequence over TP)"))
    overlap_grad_reduce: bool = option(
        False, "code paths", "DDP overlaps its grad reductions with backward (bucketed)", backends=MEGATRON,
        golden=NEVER, path=True, mcore=("DistributedDataParallelConfig.overlap_grad_reduce",),
        mlm="--overlap-grad-reduce")
    bucket_size: int | None = option(
        None, "code paths", "DDP bucket size in elements (small: several buckets)", low=1, backends=MEGATRON,
        golden=NEVER, path=True, tree_default=True, mcore=("DistributedDataParallelConfig.bucket_size",),
        mlm="--ddp-bucket-size",
        # megatron-core buckets only when it overlaps (DistributedDataParallel's bucket_size rule).
        needs=_needs("overlap_grad_reduce", bool, "takes effect only with overlap_grad_reduce = true",
))
    distributed_optimizer: bool = option(
        False, "code paths", """megatron-core's DistributedOptimizer: grads reduce-scattered over the
        data-parallel group, each rank steps its range, params all-gathered after the step""",
        backends=MEGATRON, golden=NEVER, path=True,
        mcore=("DistributedDataParallelConfig.use_distributed_optimizer",
               "OptimizerConfig.use_distributed_optimizer"),
        mlm="--use-distributed-optimizer",
        # megatron-core 0.19.2, optimizer/distrib_optimizer.py, DistributedOptimizer.__init__ (l.688-694).
        needs=_needs("optimizer", lambda o: o == "adam", "megatron-core's DistributedOptimizer takes Adam "
                     "only (it asserts Adam or an init_state_fn, for its checkpoint format)"))

    overlap_param_gather: bool = option(
        False, "code paths", """the distributed optimizer's param all-gather waits for the next forward
        (DDP's forward pre-hooks, enabled after the first step)""", backends=MEGATRON, golden=NEVER,
        path=True, mcore=("DistributedDataParallelConfig.overlap_param_gather",
                          "OptimizerConfig.overlap_param_gather"), mlm="--overlap-param-gather",
        # Megatron-LM's arguments.py: the param gather it overlaps is the distributed optimizer's,
        # and it "must use --overlap-param-gather with --overlap-grad-reduce".
        needs=(*_needs("distributed_optimizer", bool, "needs distributed_optimizer and overlap_grad_reduce"),
               *_needs("overlap_grad_reduce", bool, "needs distributed_optimizer and overlap_grad_reduce")))
    process_groups: ProcessGroups = option(
        "parallel-state", "code paths", """where megatron-core takes its groups: ``parallel-state`` (its
        globals), ``collection`` (a ``ProcessGroupCollection`` of the same groups) or
        ``collection-permuted`` (GTP peers paired across replicate DP)""", backends=MEGATRON, golden=NEVER,
        placement_only=True, path=True, added_later=True)

    # --- checkpoint topology (set by a scenario's [checkpoint] table) ---
    save_step: int = option(0, "checkpoint", "train to this step, save a ``torch_dist`` checkpoint, stop",
                            low=0, backends=MEGATRON, golden=NEVER, path=True, added_later=True)
    load_step: int = option(0, "checkpoint", "load the checkpoint of this step and train on from it", low=0,
                            backends=MEGATRON, golden=NEVER, path=True, added_later=True)
    resume_from: str = option("", "checkpoint", "the key of the side whose checkpoint this side loads",
                              backends=MEGATRON, golden=NEVER, path=True, added_later=True)

    # --- the harness's self-test ---
    inject: tuple[str, ...] = option(
        (), "self-test", "planted faults (``gtp-parity inject --list``)",
        backends=frozenset({"megatron", "mlm", "torch"}), golden=NEVER, placement_only=True)
    mutant: str = option("", "self-test", "a mutant of megatron-core's GTP code (``gtp-parity mutate``)",
                         backends=MEGATRON, golden=NEVER, placement_only=True, added_later=True)

    @property
    def data_ranks(self) -> int:
        """Ranks that read distinct samples: GTP peers are data ranks (world / (TP x PP))."""
        return self.world_size // (self.tp * self.pipeline_parallel)

    @property
    def etp(self) -> int:
        """The experts' tensor-parallel size: ``expert_tp``, or TP where it is none."""
        return self.tp if self.expert_tp is None else self.expert_tp

    @property
    def replicate_dp(self) -> int:
        return self.world_size // (self.tp * self.gtp * self.pipeline_parallel)

    def num_microbatches(self, data) -> int:
        return data.global_batch_size // (data.micro_batch_size * self.data_ranks)

    def key(self, model, data) -> str:
        """A short hash identifying what this side computes; equal sides share one run."""
        docs = [dataclasses.asdict(self), dataclasses.asdict(model), dataclasses.asdict(data)]
        for doc, cls in zip(docs, (Side, type(model), type(data))):
            # at its default, a key added later leaves the key as it was
            for k, default in keyed_later(cls).items():
                if doc[k] == default:
                    del doc[k]
        blob = json.dumps(docs, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def label(self) -> str:
        gtp = f"gtp{self.gtp}" if self.gtp > 1 else "gtpoff"
        recipe = "" if self.recipe == "none" else f"-{self.recipe}"
        experts = f"-ep{self.ep}-egtp{self.expert_gtp}" if self.ep * self.expert_gtp > 1 else ""
        experts += f"-etp{self.etp}" if self.etp != self.tp else ""
        pp = "" if self.pipeline_parallel == 1 else f"-pp{self.pipeline_parallel}"
        pp += f"v{self.virtual_pipeline}" if self.virtual_pipeline else ""
        return f"{self.backend}-w{self.world_size}-tp{self.tp}{pp}-{gtp}{experts}-{self.precision}{recipe}"

    def paths(self) -> dict[str, Any]:
        """The code paths this side takes off the plainest one (what a report says was exercised)."""
        return {o.name: getattr(self, o.name) for o in declared(Side).values()
                if o.path and o.off_default(getattr(self, o.name))}
