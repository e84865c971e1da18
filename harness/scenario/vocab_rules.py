"""The rules of the vocabulary and the loss ([model]'s ``make_vocab_size_divisible_by``,
``parallel_output``, ``label_smoothing``), checked before anything is launched, and the padded
vocabulary every backend builds.

A model's vocabulary is ``vocab_size`` padded to a multiple of ``make_vocab_size_divisible_by x TP``
(Megatron-LM's ``vocab_size_with_padding``). The padded rows are parameters megatron-core trains: the
output layer's take part in the vocab-parallel cross entropy's softmax denominator, so two padded
sizes are two models. The harness compares one model: every side holds the padded size of TP 1 (the
golden's), and a side whose TP pads to another size is refused.
"""

from __future__ import annotations

from harness.common.errors import BadInput
from harness.scenario.schema import ModelConfig, Scenario, Side

# Why label smoothing is refused: no switch reaches megatron-core's.
NO_SMOOTHING = (
    "no switch reaches it: megatron-core 0.19.2's LanguageModule.compute_language_model_loss "
    "(models/common/language_module/language_module.py, l.194) calls vocab_parallel_cross_entropy "
    "without its label_smoothing argument, and Megatron-LM has no flag for it")
# Why parallel_output = false is refused at TP > 1, and on megatron-core in fp32
# (repro/gpt_parallel_output_loss.py).
GATHERED_LOSS = (
    "megatron-core 0.19.2's LanguageModule.compute_language_model_loss (language_module.py, l.194) "
    "runs vocab_parallel_cross_entropy over the TP group on the gathered logits: each rank takes the "
    "whole vocabulary for its partition and the softmax denominator is summed over TP (the loss is "
    "off by log TP, its gradient wrong); GPTModel's parallel_output = False serves inference")
GATHER_RAISES = (
    "megatron-core 0.19.2 raises in fp32: the output layer's gather over one TP rank hands its input "
    "back as-is (tensor_parallel/mappings.py, _gather_along_last_dim l.89-90, in "
    "_GatherFromModelParallelRegion.forward), vocab_parallel_cross_entropy turns those logits into the "
    "softmax in place (cross_entropy.py l.42, l.62; bf16 logits are copied by .float() first) and its "
    "backward's ctx.saved_tensors (l.190) refuses the modified view")


def padded_vocab_size(m: ModelConfig, tp: int = 1) -> int:
    """``vocab_size`` padded to a multiple of ``make_vocab_size_divisible_by x tp`` (Megatron-LM's
    ``vocab_size_with_padding``)."""
    multiple = m.make_vocab_size_divisible_by * tp
    return -(-m.vocab_size // multiple) * multiple


def validate_vocab_model(s: Scenario) -> None:
    m, src = s.model, s.source
    if m.label_smoothing:
        raise BadInput(f"{src}: [model].label_smoothing", NO_SMOOTHING)


def validate_vocab_side(s: Scenario, side: Side, where: str) -> None:
    m = s.model
    padded, here = padded_vocab_size(m), padded_vocab_size(m, side.tp)
    if here != padded:
        raise BadInput(
            f"{where}.tp",
            f"[model].vocab_size = {m.vocab_size} padded to a multiple of make_vocab_size_divisible_by x "
            f"TP = {m.make_vocab_size_divisible_by} x {side.tp} is {here} rows, {padded} at TP 1 (the "
            "golden's): "
            "the padded rows take part in the softmax denominator, so the two are other models; choose "
            "make_vocab_size_divisible_by so that both pad alike")
    if padded != m.vocab_size and side.backend == "bridge":
        raise BadInput(f"{where}.backend", f"a padded vocabulary ({m.vocab_size} rows padded to {padded}) is "
                       "not covered yet on the bridge backend")
    if not m.parallel_output:
        if side.backend == "mlm":
            raise BadInput(f"{s.source}: [model].parallel_output", "Megatron-LM builds GPTModel with "
                           f"parallel_output = True and has no flag for it ({where})")
        if side.tp > 1:
            raise BadInput(f"{where}.tp",
                           f"[model].parallel_output = false at TP {side.tp}: {GATHERED_LOSS}")
        if side.backend == "megatron" and side.precision == "fp32":
            raise BadInput(f"{where}.precision", f"[model].parallel_output = false: {GATHER_RAISES}")
