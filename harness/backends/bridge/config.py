"""A side as Megatron-Bridge's ``ConfigContainer``: the configuration ``pretrain`` runs.

It follows the Bridge PR's GTP functional test (``test_pretrain_with_generalized_tensor_parallelism``)
and the seed's scalar comparison: a ``GPTModelProvider`` with the harness's GPT (its architecture
switches as [model] sets them: biases, activation, norm, positions, query groups; dropout 0, FP32
softmax), the
optimizer and scheduler of the side, DDP with ``grad_reduce_in_fp32`` and no
``average_in_collective``, micro/global batch from the scenario. On CPU: gloo, the local layer
spec, CPU initialization and the fused kernels off (:data:`CPU_MODEL`), as the mlm backend's
``CPU_FLAGS``. The model is the provider of :mod:`.providers` (canonical weights after
construction); the data its dataset provider (synthetic samples) or Bridge's mock dataset.
"""

from __future__ import annotations

import torch

from harness.backends.megatron.arch import config_kwargs
from harness.run.job import Job
from harness.scenario.options import mcore_kwargs

# What runs the model on CPU: megatron-core's local layers (no Transformer Engine), CPU
# initialization, no fused kernels (none has a CPU build).
CPU_MODEL = {
    "use_cpu_initialization": True, "masked_softmax_fusion": False, "bias_activation_fusion": False,
    "bias_dropout_fusion": False, "persist_layer_norm": False, "apply_rope_fusion": False,
    "cross_entropy_loss_fusion": False, "gradient_accumulation_fusion": False,
}


def model_fields(job: Job, on_cpu: bool) -> dict:
    """The ``GPTModelProvider`` (a ``TransformerConfig``) fields of the side's GPT."""
    m, side = job.model, job.side
    dtype = torch.bfloat16 if side.precision == "bf16" else torch.float32
    fields = {
        **mcore_kwargs("TransformerConfig", m, side),  # the declared one-to-one fields (a provider is one)
        "seq_length": m.seq_length, "vocab_size": m.vocab_size, "make_vocab_size_divisible_by": 1,
        "share_embeddings_and_output_weights": not m.untie_embeddings,
        # the architecture switches: the one-to-one ones came with mcore_kwargs; the provider builds
        # the GPTModel, so it takes GPTModel's position arguments too
        **config_kwargs(m), "position_embedding_type": m.position_embedding_type,
        "rotary_percent": m.rotary_percent, "rotary_base": m.rotary_base,
        "pipeline_model_parallel_size": 1, "context_parallel_size": 1,
        "attention_dropout": 0.0, "hidden_dropout": 0.0, "attention_softmax_in_fp32": True,
        "bf16": side.precision == "bf16", "params_dtype": dtype, "pipeline_dtype": dtype,
        "gradient_accumulation_fusion": False,
    }
    if side.gtp > 1:  # the tree's TransformerConfig derives gtp_weight_remat_size from it
        fields["tensor_parallel_num_weight_shards"] = side.tp * side.gtp
    return {**fields, **(CPU_MODEL if on_cpu else {})}


def container(job: Job, model, dataset, on_cpu: bool):
    """The ``ConfigContainer`` of the side (``model``: the provider; ``dataset``: the data config)."""
    from megatron.bridge.training.config import (
        CheckpointConfig, ConfigContainer, DistributedDataParallelConfig, DistributedInitConfig, LoggerConfig,
        OptimizerConfig, RNGConfig, SchedulerConfig, TokenizerConfig, TrainingConfig, ValidationConfig,
    )

    side, data = job.side, job.data
    bf16 = side.precision == "bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    optimizer = OptimizerConfig(
        **mcore_kwargs("OptimizerConfig", side), bf16=bf16, fp16=False, params_dtype=dtype,
            log_num_zeros_in_grad=True,
    )
    scheduler = SchedulerConfig(
        start_weight_decay=side.weight_decay, end_weight_decay=side.weight_decay,
            weight_decay_incr_style="constant",
        lr_decay_style=side.lr_decay_style, lr_warmup_iters=side.lr_warmup_steps,
        lr_decay_iters=side.lr_decay_steps or side.steps, override_opt_param_scheduler=True,
    )
    ddp = DistributedDataParallelConfig(
        **mcore_kwargs("DistributedDataParallelConfig", side), check_for_nan_in_grad=True,
            average_in_collective=False,
    )
    return ConfigContainer(
        model=model,
        train=TrainingConfig(train_iters=side.steps, global_batch_size=data.global_batch_size,
                             micro_batch_size=data.micro_batch_size),
        validation=ValidationConfig(eval_interval=side.steps + 100, eval_iters=0),
        optimizer=optimizer, scheduler=scheduler, ddp=ddp, dataset=dataset,
        logger=LoggerConfig(log_interval=1),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=job.model.vocab_size),
        checkpoint=CheckpointConfig(save=None, load=None),
        rng=RNGConfig(seed=side.seed),
        dist=DistributedInitConfig(distributed_backend="gloo" if on_cpu else "nccl"),
    )
