"""The padded vocabulary and the loss options (harness.scenario.vocab_rules): the padded size is
Megatron-LM's, every side holds the same, the golden counts the padded rows in the softmax as
megatron-core does, the data never reaches them, and the combinations no backend computes right are
refused naming why."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import pytest
import torch

from harness import scenario
from harness.backends import data as data_mod
from harness.backends.gpt import canonical_state, layout_of, param_specs
from harness.backends.mlm.args import side_argv
from harness.common.errors import BadInput
from harness.common.layout import Layout
from harness.scenario.rules import validate
from harness.scenario.vocab_rules import padded_vocab_size
from tests.helpers import ROOT

PADDED = {"vocab_size": 71, "make_vocab_size_divisible_by": 4}


@functools.cache
def _matrix() -> dict[str, scenario.Scenario]:
    return {x.name: x for x in scenario.load(ROOT / "scenarios" / "architectures.toml")}


def _case(name: str = "bias-tp1-gtp2-fp32", train: dict | None = None, **model) -> scenario.Scenario:
    s = _matrix()[name]
    s = dataclasses.replace(s, model=dataclasses.replace(s.model, add_bias_linear=False, **model))
    if train:
        s = dataclasses.replace(s, reference=dataclasses.replace(s.reference, **train),
                                candidate=dataclasses.replace(s.candidate, **train))
    return s


def test_the_padded_size_is_megatron_lms():
    from megatron.training.vocab_utils import calculate_padded_vocab_size

    for vocab, multiple, tp in itertools.product([1, 50, 71, 72, 127, 128, 50257], [1, 4, 128], [1, 2, 8]):
        m = dataclasses.replace(_case().model, vocab_size=vocab, make_vocab_size_divisible_by=multiple)
        want = calculate_padded_vocab_size(vocab, multiple, tp, logging_enabled=False)
        assert padded_vocab_size(m, tp) == want, (vocab, multiple, tp)


def test_the_default_keeps_every_model_whose_vocabulary_tp_divides():
    for s in scenario.load(ROOT / "scenarios" / "default.toml"):
        for side in s.sides.values():
            assert padded_vocab_size(s.model, side.tp) == s.model.vocab_size


def test_the_tables_hold_the_padded_rows_and_the_layout_names_them():
    m = _case(**PADDED).model
    specs = {s.name: s for s in param_specs(m)}
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert specs[name].shape == (72, 64)
        side = dataclasses.replace(_case().candidate, tp=2, world_size=4)
        layout = layout_of(specs[name], side)
        doc = layout.to_json()
        assert doc["vocab_padding"] == 1 and doc["pads"] == {"gtp": 28}  # 36 rows a TP block, to 64
        assert Layout.from_json(doc) == layout and layout.local_shape() == (32, 64)
    plain = layout_of(param_specs(_case().model)[0], _case().candidate).to_json()
    assert "vocab_padding" not in plain  # traces of unpadded models are as they were


def test_the_data_draws_from_the_raw_vocabulary():
    m = _case(**PADDED).model
    tokens, labels = data_mod.batch(1234, list(range(64)), m)
    assert int(tokens.max()) <= 70 and int(labels.max()) <= 70 and int(tokens.max()) > 60


def test_the_goldens_loss_counts_the_padded_row_in_the_softmax():
    """The golden's cross entropy over the padded logits is log(sum over all 72 of exp) - logit[y],
    as megatron-core's vocab_parallel_cross_entropy sums its partition's every column."""
    from harness.backends.torch.model import GPT, token_losses

    m = _case(**PADDED).model
    model = GPT(m).double()
    state = canonical_state(m, 1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(state[name])
    assert model.output_layer.weight.shape == (72, 64) == model.embedding.word_embeddings.weight.shape
    tokens, labels = data_mod.batch(1234, [0, 1], m)
    logits = model(tokens)  # [s, b, 72]
    got = token_losses(logits, labels)
    target = logits.gather(-1, labels.t().unsqueeze(-1)).squeeze(-1).t()  # [b, s]
    want = torch.logsumexp(logits, -1).t() - target
    # two fp64 reductions over 72 terms of size ~1: a few ulp of log 72 each
    bound = 4 * 72 * torch.finfo(torch.float64).eps
    assert logits.shape[-1] == 72 and torch.allclose(got, want, rtol=0, atol=bound)
    without = torch.logsumexp(logits[..., :71], -1).t() - target
    assert bool((got > without).all())  # the padded row's share of the denominator


def test_the_mlm_side_passes_the_multiple():
    s = _case(**PADDED)
    argv = side_argv(s.model, s.data, s.candidate)
    assert argv[argv.index("--make-vocab-size-divisible-by") + 1] == "4"
    assert argv.count("--make-vocab-size-divisible-by") == 1


@pytest.mark.parametrize(("model", "train", "where", "says"), [
    # 71 at TP 1 is 71 rows, at TP 2 72: two models
    ({"vocab_size": 71}, {"tp": 2, "world_size": 4}, "[reference].tp", "is 72 rows, 71 at TP 1"),
    ({"vocab_size": 71, "make_vocab_size_divisible_by": 4}, {"tp": 4, "world_size": 4}, "[reference].tp",
     "is 80 rows, 72 at TP 1"),
    ({"label_smoothing": 0.1}, {}, "[model].label_smoothing", "compute_language_model_loss"),
    ({"parallel_output": False}, {}, "[reference].precision", "ctx.saved_tensors"),
    ({"parallel_output": False}, {"tp": 2, "world_size": 4, "precision": "bf16"}, "[reference].tp",
     "off by log TP"),
    ({"parallel_output": False}, {"backend": "mlm", "precision": "bf16"}, "[model].parallel_output",
     "Megatron-LM builds GPTModel with parallel_output = True"),
    ({"vocab_size": 71, "make_vocab_size_divisible_by": 4}, {"backend": "bridge"}, "[reference].backend",
     "not covered yet on the bridge backend"),
])
def test_what_no_backend_computes_right_is_refused_naming_why(model, train, where, says):
    with pytest.raises(BadInput) as e:
        validate(_case(train=train, **model))
    assert where in e.value.where and says in str(e.value), str(e.value)


def test_parallel_output_off_runs_at_tp_1_in_bf16_and_a_padded_pair_of_tp_1_and_2():
    validate(_case(train={"precision": "bf16"}, parallel_output=False))
    s = _case(**PADDED)
    validate(dataclasses.replace(s, candidate=dataclasses.replace(s.candidate, tp=2, world_size=4)))
    assert math.isclose(padded_vocab_size(s.model, 2), padded_vocab_size(s.model, 1))


def test_validate_exits_2_naming_the_key_and_the_reason(tmp_path, capsys):
    from harness.cli import main

    text = (ROOT / "tests" / "assets" / "mlm_tiny.toml").read_text()
    path = tmp_path / "s.toml"
    path.write_text(text.replace("vocab_size = 72\n", "vocab_size = 72\nlabel_smoothing = 0.1\n", 1))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "[model].label_smoothing" in err and "no switch reaches it" in err
