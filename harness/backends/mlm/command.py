"""``gtp-parity mlm -- <pretrain_gpt.py flags>``: a user's Megatron-LM command as an mlm side
(the scenario; :func:`harness.session.run_mlm_command` runs it).

The flags are parsed by Megatron-LM's own parser (a flag it refuses is bad input, exit 2);
the side, model and data the harness records them under are read back from the parsed
values, and the flags themselves are the side's ``args`` (they come last on the command
line, so they are what runs), but for the evaluation's, which the side's keys carry. The
run starts from the canonical weights, so its trace compares with any side of the same model.
"""

from __future__ import annotations

import argparse

from harness.scenario import rules
from harness.backends.mlm.args import check_flags
from harness.common.errors import BadInput
from harness.scenario.schema import CapturePolicy, ComparePolicy, DataConfig, ModelConfig, Scenario, Side

WHERE = "gtp-parity mlm"


def _side(ns: argparse.Namespace, flags: list[str], nproc: int) -> Side:
    if ns.fp16:
        raise BadInput(f"{WHERE}: --fp16", "the harness records fp32 and bf16 runs; use --bf16 or neither")
    if ns.data_path or ns.train_data_path:
        raise BadInput(f"{WHERE}: --data-path", "runs read --mock-data or, without it, the harness's synthetic samples")
    if ns.train_iters is None:
        raise BadInput(f"{WHERE}: --train-iters", "required (the harness records a number of steps)")
    for flag in ("eval_global_batch_size", "eval_micro_batch_size", "start_eval_at_iter"):
        if getattr(ns, flag, None) is not None:
            raise BadInput(f"{WHERE}: --{flag.replace('_', '-')}", "the harness evaluates global batches of "
                                                                   "the training size from the first interval on")  # fmt: skip
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
        adam_beta1=ns.adam_beta1, adam_beta2=ns.adam_beta2, adam_eps=ns.adam_eps, sgd_momentum=ns.sgd_momentum,
        args=_without(flags, EVAL_FLAGS), data="mock" if ns.mock_data else "synthetic",
        eval_interval=(ns.eval_interval or ns.train_iters + 100) if evaluates else 0,
        eval_iters=ns.eval_iters if evaluates else 1,
    )  # fmt: skip


EVAL_FLAGS = ("--eval-interval", "--eval-iters")
"""Flags the side's own keys carry (``eval_interval``, ``eval_iters``): its command line writes them."""


def _without(flags: list[str], valued: tuple[str, ...]) -> tuple[str, ...]:
    """``flags`` without the ``valued`` flags and their values (``--flag V`` or ``--flag=V``)."""
    out, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag in valued:
            skip = True
        elif flag.split("=", 1)[0] not in valued:
            out.append(flag)
    return tuple(out)


def scenario_of(flags: list[str], nproc: int) -> Scenario:
    """The scenario whose reference is the command (candidate: the same; golden: fp64)."""
    ns = check_flags(flags, WHERE)
    side = _side(ns, flags, nproc)
    model = ModelConfig(
        num_layers=ns.num_layers, hidden_size=ns.hidden_size,
        ffn_hidden_size=ns.ffn_hidden_size or 4 * ns.hidden_size, num_attention_heads=ns.num_attention_heads,
        seq_length=ns.seq_length, vocab_size=ns.vocab_size or 0,
        untie_embeddings=ns.untie_embeddings_and_output_weights, init_std=ns.init_method_std,
    )  # fmt: skip
    data_ranks = nproc // side.tp
    data = DataConfig(seed=ns.seed, micro_batch_size=ns.micro_batch_size,
                      global_batch_size=ns.global_batch_size or ns.micro_batch_size * data_ranks)  # fmt: skip
    golden = Side(backend="torch", precision="fp64", steps=side.steps, seed=side.seed,
                  eval_interval=side.eval_interval, eval_iters=side.eval_iters)  # fmt: skip
    s = Scenario(name="mlm-command", source=WHERE, model=model, data=data, reference=side, candidate=side,
                 golden=golden, capture=CapturePolicy(), compare=ComparePolicy())  # fmt: skip
    rules.validate(s)
    return s
