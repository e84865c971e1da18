"""What a side's ``args`` (extra Megatron-LM flags of the mlm backend) may say.

The harness assembles, compares and measures against its golden only the models and layouts
its keys describe. A flag that sets a declared key would bypass the key (and the golden, which
reads the key): it is refused, naming the key. A flag that shapes the model's parameters, its
computation or the parallel layout beyond the keys is refused with what it changes, until a key
supports it; so are the flags the harness fixes for every mlm side (:data:`FIXED_FLAGS`). Other
flags (logging, timing, kernels' implementation switches) pass to Megatron-LM's own parser.
"""

from __future__ import annotations

from harness.scenario.options import Option, mlm_flags
from harness.scenario.schema import DataConfig, ModelConfig, Side

# What the harness fixes for every mlm side: the model's fixed choices (no dropout), the data
# loader and the logging the hooks read.
FIXED_FLAGS = (
    "--tokenizer-type", "NullTokenizer", "--weight-decay-incr-style", "constant",
    "--no-gradient-accumulation-fusion",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--attention-softmax-in-fp32",
    "--pipeline-model-parallel-size", "1", "--log-interval", "1", "--dataloader-type", "single",
    "--num-workers", "0", "--log-num-zeros-in-grad",
)

_PARAMETERS = "shapes the model's parameters beyond the scenario's keys (the harness could not assemble them)"
_COMPUTATION = "changes the model's computation, which the golden does not follow"
_LAYOUT = "changes the parallel layout beyond the scenario's keys (the harness could not assemble it)"
_DATA = ("changes what the side reads or evaluates: the scenario's [data] keys and eval_interval / "
         "eval_iters say it")
_PRECISION = "changes the side's precision: the precision and recipe keys say it"

# Megatron-LM's flags (megatron/training/arguments.py) a side's args may not set, by what they change.
REFUSED = {
    **dict.fromkeys((
        "--kv-channels", "--qk-l2-norm", "--apply-layernorm-1p",
        "--use-rotary-position-embeddings", "--no-position-embedding",
        "--max-position-embeddings", "--multi-latent-attention", "--attention-output-gate",
        "--experimental-attention-variant", "--encoder-num-layers", "--decoder-num-layers",
        "--is-hybrid-model", "--padded-vocab-size", "--heterogeneous-layers-config-path",
        "--heterogeneous-layers-config-encoded-json",
    ), _PARAMETERS),
    **dict.fromkeys((
        "--quick-geglu", "--openai-gelu", "--glu-linear-offset",
        "--fp32-residual-connection", "--apply-residual-connection-post-layernorm", "--use-mup",
        "--apply-query-key-layer-scaling", "--window-size", "--qk-clip", "--activation-func-clamp-value",
    ), _COMPUTATION),
    **dict.fromkeys((
        "--context-parallel-size", "--hierarchical-context-parallel-sizes", "--expert-tensor-parallel-size",
        "--num-layers-per-virtual-pipeline-stage", "--decoder-first-pipeline-num-layers",
        "--decoder-last-pipeline-num-layers", "--pipeline-model-parallel-layout", "--use-megatron-fsdp",
        "--use-torch-fsdp2", "--num-distributed-optimizer-instances", "--data-parallel-sharding-strategy",
        "--use-tp-pp-dp-mapping", "--model-parallel-size",
    ), _LAYOUT),
    **dict.fromkeys((
        "--data-path", "--split", "--train-data-path", "--valid-data-path", "--test-data-path",
        "--eval-global-batch-size", "--eval-micro-batch-size", "--start-eval-at-iter", "--full-validation",
        "--skip-train", "--multiple-validation-sets", "--train-samples",
    ), _DATA),
    **dict.fromkeys(("--fp16",), _PRECISION),
    "--squared-relu": "is what the key [model].activation = \"squared_relu\" sets: set activation instead",
}
# Families of flags, by prefix.
REFUSED_PREFIXES = {
    "--moe-": _PARAMETERS, "--mtp-": _PARAMETERS, "--mamba-": _PARAMETERS, "--dsa-": _PARAMETERS,
    "--linear-": _PARAMETERS, "--rotary-": _PARAMETERS, "--rope-": _PARAMETERS, "--yarn-": _PARAMETERS,
    "--fp8-": _PRECISION, "--fp4-": _PRECISION,
}


def flag_problem(arg: str, declared: dict[str, Option] | None = None) -> str | None:
    """Why ``arg`` (a flag, ``--flag=value`` or a value) may not be in a side's ``args``, or None."""
    if not arg.startswith("--"):
        return None  # a value of the flag before it
    flag = arg.split("=", 1)[0]
    declared = mlm_flags(ModelConfig, DataConfig, Side) if declared is None else declared
    if (o := declared.get(flag)) is not None:
        return f"{flag} is what the key [{o.section}].{o.name} sets: set {o.name} instead"
    if flag in FIXED_FLAGS:
        return (f"{flag} is fixed by the harness for every mlm side (the model's fixed choices, its loader "
                "and the log line its hooks read)")
    if flag in REFUSED:
        return f"{flag} {REFUSED[flag]}"
    prefix = next((p for p in REFUSED_PREFIXES if flag.startswith(p)), None)
    return f"{flag} {REFUSED_PREFIXES[prefix]}" if prefix else None

