"""The option declarations: every scenario key declared once, and what reads them.

The declarations are checked against the code they describe: each megatron-core argument an
option names exists in the installed megatron-core, each Megatron-LM flag in Megatron-LM's
parser (as do the flags a side's ``args`` may not carry), and docs/scenarios.md's tables are the
ones the declarations generate.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest

from harness import cli
from harness.scenario.mlm_args import FIXED_FLAGS, REFUSED, REFUSED_PREFIXES, flag_problem
from harness.scenario.options import (
    DOCS_BEGIN, DOCS_END, INHERIT, NEVER, OWN, declared, golden_side, key_tables, mlm_flags, value_problem,
)
from harness.scenario.schema import DataConfig, ModelConfig, Side

ROOT = Path(__file__).resolve().parents[1]
CLASSES = (ModelConfig, DataConfig, Side)
OPTIONS = [o for cls in CLASSES for o in declared(cls).values()]


def test_every_field_is_one_declared_option_with_a_valid_default():
    for cls in CLASSES:
        assert list(declared(cls)) == [f.name for f in dataclasses.fields(cls)]
    for o in OPTIONS:
        assert o.doc and o.group, o.name
        assert value_problem(o, o.default) is None, f"{o.section}.{o.name}: a default out of its own range"
        assert o.golden in (INHERIT, OWN, NEVER)
        if o.golden == OWN:
            assert value_problem(o, o.golden_value) is None


def test_docs_key_tables_are_generated_from_the_declarations():
    text = (ROOT / "docs" / "scenarios.md").read_text()
    assert DOCS_BEGIN in text and DOCS_END in text
    shown = text.split(DOCS_BEGIN, 1)[1].split(DOCS_END, 1)[0].strip()
    assert shown == key_tables(*CLASSES).strip(), "docs/scenarios.md's key tables: `gtp-parity options`"


def test_the_golden_takes_from_train_what_each_declaration_says():
    train = {"lr": 0.5, "gtp_pad_alignment": 32, "tp": 2, "precision": "bf16", "recompute": "full",
             "inject": ("gtp-rs-no-prescale",), "megatron_core": "git:megatron-lm@abc1234", "args": ("--x",)}
    golden = golden_side(train, Side)
    assert golden["lr"] == 0.5 and golden["gtp_pad_alignment"] == 32  # inherited
    assert golden["tp"] == 1 and golden["precision"] == "fp64" and golden["backend"] == "torch"  # its own
    for key in ("recompute", "inject", "megatron_core", "args"):  # never: code the golden does not run
        assert key not in golden


def _mcore_target(dest: str):
    """The megatron-core class or function an option's ``mcore`` entry names, and the argument."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.tensor_parallel import generalized_tensor_parallelism, gtp_api
    from megatron.core.transformer.transformer_config import TransformerConfig

    owners = {"TransformerConfig": TransformerConfig, "OptimizerConfig": OptimizerConfig,
              "DistributedDataParallelConfig": DistributedDataParallelConfig, "GPTModel": GPTModel,
              "parallel_state": parallel_state,
              "gtp": type("gtp", (), {**vars(generalized_tensor_parallelism), **vars(gtp_api)})}
    owner, _, rest = dest.split(" (")[0].partition(".")
    if "(" in rest:  # function(argument)
        func, arg = rest.rstrip(")").split("(")
        return getattr(owners[owner], func), arg
    return owners[owner], rest


@pytest.mark.slow
def test_every_megatron_core_argument_an_option_names_exists():
    missing = []
    for o in OPTIONS:
        for dest in o.mcore:
            target, arg = _mcore_target(dest)
            if dataclasses.is_dataclass(target):
                names = {f.name for f in dataclasses.fields(target)}
            elif target.__name__ == "update_gtp_config":  # **kwargs, each an attribute of GTP_CONFIG
                names = set(vars(target.__globals__["GTP_CONFIG"]))
            else:
                names = set(inspect.signature(target).parameters)
            if arg not in names:
                missing.append(f"{o.section}.{o.name}: {dest}")
    assert not missing, missing


@pytest.mark.slow
def test_every_megatron_lm_flag_the_declarations_and_the_args_rules_name_exists():
    from harness.backends.mlm.args import parser

    known = {s for a in parser()._actions for s in a.option_strings}
    named = {*mlm_flags(*CLASSES), *REFUSED, *(f for f in FIXED_FLAGS if f.startswith("--"))}
    assert not sorted(named - known), "flags Megatron-LM's parser does not know"
    for prefix in REFUSED_PREFIXES:
        assert any(f.startswith(prefix) for f in known), prefix


@pytest.mark.parametrize("arg, says", [
    ("--kv-channels", "shapes the model's parameters"),
    ("--softmax-type", "[model].softmax_type sets: set softmax_type instead"),
    ("--eval-iters=3", "[side].eval_iters sets: set eval_iters instead"),
    ("--bf16", "[side].precision"),
    ("--num-layers", "[model].num_layers"),
    ("--moe-router-topk", "[model].moe_topk"),
    ("--moe-shared-expert-intermediate-size", "[model].moe_shared_expert_intermediate_size"),
    ("--context-parallel-size", "parallel layout"),
    ("--make-vocab-size-divisible-by", "[model].make_vocab_size_divisible_by"),
    ("--swiglu", "[model].activation sets"),
    ("--squared-relu", "[model].activation = \"squared_relu\""),
    ("--quick-geglu", "the golden does not follow"),
])
def test_args_flags_that_keys_set_or_the_harness_cannot_assemble_are_refused(arg, says):
    assert says in flag_problem(arg)


def test_args_flags_that_change_nothing_compared_pass():
    for arg in ("--timing-log-level", "2", "--log-throughput", "--no-check-for-nan-in-loss-and-grad=1"):
        assert flag_problem(arg) is None


def test_validate_refuses_a_learnable_softmax_in_args_naming_its_key(tmp_path, capsys):
    text = (ROOT / "tests" / "assets" / "mlm_tiny.toml").read_text()
    path = tmp_path / "s.toml"
    path.write_text(text.replace("[candidate]\n", '[candidate]\nargs = ["--softmax-type", "learnable"]\n', 1))
    assert cli.main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "[candidate].args" in err and "--softmax-type is what the key [model].softmax_type sets" in err


def test_a_side_key_only_some_backends_honour_is_refused_elsewhere_by_its_declaration(tmp_path, capsys):
    path = tmp_path / "s.toml"
    tiny = (ROOT / "tests" / "assets" / "tiny.toml").read_text()
    path.write_text(tiny.replace("[golden]\n", '[golden]\nrecompute = "full"\n', 1))
    assert cli.main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "[golden].recompute: only the megatron backend takes this option (backend 'torch')" in err


@pytest.mark.slow
@pytest.mark.parametrize("bias, qkv, activation, norm, positions, qk_norm, softmax", [
    (False, False, "gelu", "LayerNorm", "learned_absolute", False, "vanilla"),
    (True, False, "swiglu", "RMSNorm", "rope", True, "learnable"),
    (False, True, "squared_relu", "LayerNorm", "none", False, "off-by-one"),
])  # the third also with 2 query groups
def test_the_architecture_switches_reach_megatron_lm_and_read_back(bias, qkv, activation, norm, positions,
                                                                   qk_norm, softmax):
    """The mlm side's command line carries the keys (``--disable-bias-linear`` where biases are
    off, ``--add-qkv-bias``, ``--swiglu`` / ``--squared-relu``, ``--normalization``, the positions'
    flags, ``--qk-layernorm``, ``--softmax-type``), Megatron-LM's parser reads those values, and
    ``gtp-parity mlm`` reads them back into the same model."""
    from harness.backends.mlm.args import check_flags, side_argv
    from harness.backends.mlm.command import scenario_of
    from harness.scenario.schema import DataConfig, ModelConfig, Side

    model = ModelConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, seq_length=8, vocab_size=64,
                        add_bias_linear=bias, add_qkv_bias=qkv, activation=activation,
                        normalization=norm, position_embedding_type=positions,
                        **({"rotary_percent": 0.5, "rotary_base": 500} if positions == "rope" else {}),
                        num_query_groups=2 if positions == "none" else None,
                        qk_layernorm=qk_norm, softmax_type=softmax)
    side = Side(backend="mlm", world_size=1, steps=2, lr_warmup_steps=0)
    argv = side_argv(model, DataConfig(global_batch_size=1), side)
    ns = check_flags(argv + ["--train-iters", "2", "--tensor-model-parallel-size", "1"], "test")
    assert (ns.add_bias_linear, ns.add_qkv_bias) == (bias, qkv)  # validate_args then sets qkv under bias
    assert (ns.swiglu, ns.squared_relu) == (activation == "swiglu", activation == "squared_relu")
    assert ns.normalization == norm and ns.position_embedding_type == positions
    assert (ns.rotary_percent, ns.rotary_base) == ((0.5, 500) if positions == "rope" else (1.0, 10000))
    groups = (True, 2) if positions == "none" else (False, 1)
    assert (ns.group_query_attention, ns.num_query_groups) == groups
    assert (ns.qk_layernorm, ns.softmax_type) == (qk_norm, softmax)
    back = scenario_of(argv + ["--train-iters", "2", "--tensor-model-parallel-size", "1"], 1).model
    read = (back.add_bias_linear, back.add_qkv_bias, back.activation, back.normalization)
    assert read == (bias, qkv, activation, norm) and back == model
