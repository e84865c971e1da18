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
from harness.scenario.mlm_args import FIXED_FLAGS
from harness.scenario.options import declared
from harness.scenario.schema import DataConfig, ModelConfig, Side

CPU_FLAGS = (
    "--distributed-backend", "gloo", "--transformer-impl", "local", "--use-cpu-initialization",
    "--no-persist-layer-norm", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
    "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
)


def declared_flags(*objects) -> list[str]:
    """The flags of the options declared to reach a Megatron-LM flag one to one (a flag with a
    note in its declaration is derived by :func:`side_argv`), for the mlm backend's keys only."""
    argv = []
    for obj in objects:
        for o in declared(type(obj)).values():
            value = getattr(obj, o.name)
            if not o.mlm or " (" in o.mlm or "mlm" not in o.backends or value is None:
                continue
            if isinstance(value, bool):
                argv += [o.mlm] if value else []
            else:
                argv += [o.mlm, repr(value) if isinstance(value, float) else str(value)]
    return argv


def side_argv(model: ModelConfig, data: DataConfig, side: Side) -> list[str]:
    """The pretrain_gpt.py flags of ``side`` (then the side's own ``args``)."""
    argv = [
        *FIXED_FLAGS, *declared_flags(model, data, side), *model_flags(model),
        "--max-position-embeddings", str(model.seq_length),  # learned positions, one per token
        "--lr-decay-iters", str(side.lr_decay_steps or side.steps), *_eval_flags(side),
        "--tensor-parallel-num-weight-shards", str(side.tp * side.gtp),
    ]
    if side.precision == "bf16":
        argv.append("--bf16")
        if not side.grad_reduce_in_fp32:
            argv.append("--grad-reduce-in-bf16")
    if side.data == "mock":
        argv.append("--mock-data")
    return argv + list(side.args)


def model_flags(model: ModelConfig) -> list[str]:
    """The flags of the model's keys whose Megatron-LM flag is derived (negated, or a choice)."""
    flags = [] if model.add_bias_linear else ["--disable-bias-linear"]
    flags += {"swiglu": ["--swiglu"], "squared_relu": ["--squared-relu"]}.get(model.activation, [])
    flags += ["--normalization", model.normalization] if model.normalization != "LayerNorm" else []
    if model.num_query_groups is not None:
        flags += ["--group-query-attention", "--num-query-groups", str(model.num_query_groups)]
    if model.position_embedding_type != "learned_absolute":
        flags += ["--position-embedding-type", model.position_embedding_type]
    if model.position_embedding_type == "rope":
        flags += ["--rotary-percent", repr(model.rotary_percent), "--rotary-base", str(model.rotary_base)]
    if model.softmax_type != "vanilla":
        flags += ["--softmax-type", model.softmax_type]
    return flags


def _eval_flags(side: Side) -> list[str]:
    """Megatron-LM evaluates every ``--eval-interval`` steps and after the last, ``--eval-iters``
    iterations each; a side that does not evaluate runs no iteration (an interval past the end)."""
    if side.eval_interval <= 0:
        return ["--eval-interval", str(side.steps + 100), "--eval-iters", "0"]
    return ["--eval-interval", str(side.eval_interval), "--eval-iters", str(side.eval_iters)]


def parser() -> argparse.ArgumentParser:
    """Megatron-LM's own argument parser (importing it costs megatron.training's import)."""
    from megatron.training.arguments import add_megatron_arguments

    return add_megatron_arguments(argparse.ArgumentParser(description="Megatron-LM Arguments",
                                                          allow_abbrev=False))


def check_flags(argv: list[str], where: str) -> argparse.Namespace:
    """Parse ``argv`` with Megatron-LM's parser; a flag it refuses is BadInput naming it."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser().parse_args(argv)
    except SystemExit:
        lines = [ln for ln in err.getvalue().splitlines() if "error:" in ln]
        raise BadInput(where, lines[-1].split("error:", 1)[1].strip() if lines
                       else f"refused: {argv}") from None
