"""``gtp-parity mlm -- <pretrain_gpt.py flags>``: a user's Megatron-LM command as an mlm side
(the scenario; :func:`harness.session.run_mlm_command` runs it).

The flags are parsed by Megatron-LM's own parser (a flag it refuses is bad input, exit 2);
the side, model and data the harness records them under are read back from the parsed
values. The flags those keys carry, and the harness's fixed flags at their fixed values, are
dropped; the rest are the side's ``args``, judged by ``validate`` as any side's are (a flag
the harness cannot assemble exits 2 before launch). The run starts from the canonical
weights, so its trace compares with any side of the same model.
"""

from __future__ import annotations

import argparse

from harness.scenario import rules
from harness.backends.mlm.args import check_flags
from harness.common.errors import BadInput
from harness.scenario.mlm_args import FIXED_FLAGS
from harness.scenario.schema import CapturePolicy, ComparePolicy, DataConfig, ModelConfig, Scenario, Side

WHERE = "gtp-parity mlm"


def _side(ns: argparse.Namespace, flags: list[str], nproc: int) -> Side:
    if ns.fp16:
        raise BadInput(f"{WHERE}: --fp16", "the harness records fp32 and bf16 runs; use --bf16 or neither")
    if ns.data_path or ns.train_data_path:
        raise BadInput(f"{WHERE}: --data-path",
                       "runs read --mock-data or, without it, the harness's synthetic samples")
    if ns.train_iters is None:
        raise BadInput(f"{WHERE}: --train-iters", "required (the harness records a number of steps)")
    for flag in ("eval_global_batch_size", "eval_micro_batch_size", "start_eval_at_iter"):
        if getattr(ns, flag, None) is not None:
            raise BadInput(f"{WHERE}: --{flag.replace('_', '-')}", "the harness evaluates global batches of "
                                                                   "the training size from the first "
                                                                   "interval on")
    tp = ns.tensor_model_parallel_size
    shards = getattr(ns, "tensor_parallel_num_weight_shards", None) or tp
    # Megatron-LM evaluates after every --eval-interval steps (none given: only after the last)
    # and after the last step, --eval-iters iterations each; with no iterations, never.
    evaluates = (ns.eval_iters or 0) > 0
    return Side(
        backend="mlm", world_size=nproc, tp=tp, gtp=shards // tp, precision="bf16" if ns.bf16 else "fp32",
        steps=ns.train_iters, seed=ns.seed, optimizer=ns.optimizer, lr=ns.lr,
        min_lr=ns.min_lr, lr_warmup_steps=ns.lr_warmup_iters, lr_decay_steps=ns.lr_decay_iters,
        lr_decay_style=ns.lr_decay_style, weight_decay=ns.weight_decay, clip_grad=ns.clip_grad,
        adam_beta1=ns.adam_beta1, adam_beta2=ns.adam_beta2, adam_eps=ns.adam_eps,
            sgd_momentum=ns.sgd_momentum,
        args=_args_of(flags, ns), data="mock" if ns.mock_data else "synthetic",
        eval_interval=(ns.eval_interval or ns.train_iters + 100) if evaluates else 0,
        eval_iters=ns.eval_iters if evaluates else 1,
    )


# The valued flags and the switches the scenario's keys carry (read back from the parsed command
# by _side and scenario_of): the side's command line writes them from the keys.
READ_BACK = (
    "--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--seq-length",
    "--vocab-size", "--init-method-std", "--micro-batch-size", "--global-batch-size",
    "--tensor-model-parallel-size", "--tensor-parallel-num-weight-shards", "--train-iters", "--seed",
    "--optimizer", "--lr", "--min-lr", "--lr-warmup-iters", "--lr-decay-iters", "--lr-decay-style",
    "--weight-decay", "--clip-grad", "--adam-beta1", "--adam-beta2", "--adam-eps", "--sgd-momentum",
    "--eval-interval", "--eval-iters", "--normalization", "--position-embedding-type", "--rotary-percent",
    "--rotary-base", "--num-query-groups", "--make-vocab-size-divisible-by", "--softmax-type",
)
READ_BACK_SWITCHES = ("--bf16", "--mock-data", "--untie-embeddings-and-output-weights",
                      "--disable-bias-linear", "--add-qkv-bias", "--swiglu", "--squared-relu",
                      "--group-query-attention", "--qk-layernorm")


def fixed_values() -> dict[str, str | None]:
    """:data:`FIXED_FLAGS` as ``{flag: value}`` (None for a switch)."""
    out: dict[str, str | None] = {}
    for i, flag in enumerate(FIXED_FLAGS):
        if flag.startswith("--"):
            value = FIXED_FLAGS[i + 1] if i + 1 < len(FIXED_FLAGS) else None
            out[flag] = None if value is None or value.startswith("--") else value
    return out


def _same(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


def _args_of(flags: list[str], ns: argparse.Namespace) -> tuple[str, ...]:
    """The command's flags less those the scenario's keys carry and those the harness fixes (at
    the value it fixes; another value is refused): the side's ``args``, which ``validate`` judges."""
    fixed = fixed_values()
    fixed["--max-position-embeddings"] = str(ns.seq_length)  # the harness's: one position per token
    out, i = [], 0
    while i < len(flags):
        flag, eq, value = flags[i].partition("=")
        valued = flag in READ_BACK or fixed.get(flag) is not None
        width = 2 if valued and not eq else 1
        if valued and not eq:
            value = flags[i + 1] if i + 1 < len(flags) else ""
        if flag in fixed and fixed[flag] is not None and not _same(value, fixed[flag]):
            raise BadInput(f"{WHERE}: {flag}", f"the harness runs every mlm side with {flag} {fixed[flag]}")
        if flag in READ_BACK or flag in READ_BACK_SWITCHES or flag in fixed:
            i += width
            continue
        out.append(flags[i])
        i += 1
    return tuple(out)


def scenario_of(flags: list[str], nproc: int) -> Scenario:
    """The scenario whose reference is the command (candidate: the same; golden: fp64)."""
    ns = check_flags(flags, WHERE)
    side = _side(ns, flags, nproc)
    model = ModelConfig(
        num_layers=ns.num_layers, hidden_size=ns.hidden_size,
        ffn_hidden_size=ns.ffn_hidden_size or 4 * ns.hidden_size, num_attention_heads=ns.num_attention_heads,
        seq_length=ns.seq_length, vocab_size=ns.vocab_size or 0,
        make_vocab_size_divisible_by=ns.make_vocab_size_divisible_by,
        untie_embeddings=ns.untie_embeddings_and_output_weights, init_std=ns.init_method_std,
        add_bias_linear=ns.add_bias_linear, add_qkv_bias=ns.add_qkv_bias and not ns.add_bias_linear,
        activation="swiglu" if ns.swiglu else "squared_relu" if ns.squared_relu else "gelu",
        normalization=ns.normalization, position_embedding_type=ns.position_embedding_type,
        rotary_percent=ns.rotary_percent, rotary_base=ns.rotary_base,
        num_query_groups=ns.num_query_groups if ns.group_query_attention else None,
        qk_layernorm=ns.qk_layernorm, softmax_type=ns.softmax_type,
    )
    data_ranks = nproc // side.tp
    data = DataConfig(seed=ns.seed, micro_batch_size=ns.micro_batch_size,
                      global_batch_size=ns.global_batch_size or ns.micro_batch_size * data_ranks)
    golden = Side(backend="torch", precision="fp64", steps=side.steps, seed=side.seed,
                  eval_interval=side.eval_interval, eval_iters=side.eval_iters)
    s = Scenario(name="mlm-command", source=WHERE, model=model, data=data, reference=side, candidate=side,
                 golden=golden, capture=CapturePolicy(), compare=ComparePolicy())
    rules.validate(s)
    return s
