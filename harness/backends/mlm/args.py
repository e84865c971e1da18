"""A side as Megatron-LM's ``pretrain_gpt.py`` command line, and Megatron-LM's own parser.

:func:`side_argv` writes the flags of the seed's MLM command for a scenario's model, data and
side; the side's ``args`` come last (argparse keeps the last value of a repeated flag).
:data:`CPU_FLAGS` are what runs it on CPU over gloo: the local (non-TE) layers, CPU
initialization, and the fused kernels off.
"""

from __future__ import annotations

import argparse
import contextlib
import io

from harness.common.errors import BadInput
from harness.scenario.parse import DataConfig, ModelConfig, Side

CPU_FLAGS = (
    "--distributed-backend", "gloo", "--transformer-impl", "local", "--use-cpu-initialization",
    "--no-persist-layer-norm", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
    "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
)  # fmt: skip


def side_argv(model: ModelConfig, data: DataConfig, side: Side) -> list[str]:
    """The pretrain_gpt.py flags of ``side`` (then the side's own ``args``)."""
    m = model
    argv = [
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(m.vocab_size),
        "--num-layers", str(m.num_layers), "--hidden-size", str(m.hidden_size),
        "--ffn-hidden-size", str(m.ffn_hidden_size), "--num-attention-heads", str(m.num_attention_heads),
        "--seq-length", str(m.seq_length), "--max-position-embeddings", str(m.seq_length),
        "--init-method-std", repr(m.init_std),
        "--micro-batch-size", str(data.micro_batch_size), "--global-batch-size", str(data.global_batch_size),
        "--train-iters", str(side.steps), *_eval_flags(side),
        "--optimizer", side.optimizer, "--lr", repr(side.lr), "--min-lr", repr(side.min_lr),
        "--lr-warmup-iters", str(side.lr_warmup_steps),
        "--lr-decay-iters", str(side.lr_decay_steps or side.steps), "--lr-decay-style", side.lr_decay_style,
        "--weight-decay", repr(side.weight_decay), "--weight-decay-incr-style", "constant",
        "--clip-grad", repr(side.clip_grad), "--adam-beta1", repr(side.adam_beta1),
        "--adam-beta2", repr(side.adam_beta2), "--adam-eps", repr(side.adam_eps),
        "--sgd-momentum", repr(side.sgd_momentum),
        "--disable-bias-linear", "--no-gradient-accumulation-fusion",
        "--attention-dropout", "0", "--hidden-dropout", "0", "--attention-softmax-in-fp32",
        "--tensor-model-parallel-size", str(side.tp), "--pipeline-model-parallel-size", "1",
        "--tensor-parallel-num-weight-shards", str(side.tp * side.gtp),
        "--seed", str(side.seed), "--log-interval", "1", "--dataloader-type", "single", "--num-workers", "0",
        "--log-num-zeros-in-grad", "--make-vocab-size-divisible-by", "1",
    ]  # fmt: skip
    if m.untie_embeddings:
        argv.append("--untie-embeddings-and-output-weights")
    if side.precision == "bf16":
        argv.append("--bf16")
        if not side.grad_reduce_in_fp32:
            argv.append("--grad-reduce-in-bf16")
    if side.data == "mock":
        argv.append("--mock-data")
    return argv + list(side.args)


def _eval_flags(side: Side) -> list[str]:
    """Megatron-LM evaluates every ``--eval-interval`` steps and after the last, ``--eval-iters``
    iterations each; a side that does not evaluate runs no iteration (an interval past the end)."""
    if side.eval_interval <= 0:
        return ["--eval-interval", str(side.steps + 100), "--eval-iters", "0"]
    return ["--eval-interval", str(side.eval_interval), "--eval-iters", str(side.eval_iters)]


def parser() -> argparse.ArgumentParser:
    """Megatron-LM's own argument parser (importing it costs megatron.training's import)."""
    from megatron.training.arguments import add_megatron_arguments

    return add_megatron_arguments(argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False))


def check_flags(argv: list[str], where: str) -> argparse.Namespace:
    """Parse ``argv`` with Megatron-LM's parser; a flag it refuses is BadInput naming it."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser().parse_args(argv)
    except SystemExit:
        lines = [ln for ln in err.getvalue().splitlines() if "error:" in ln]
        raise BadInput(where, lines[-1].split("error:", 1)[1].strip() if lines else f"refused: {argv}") from None
