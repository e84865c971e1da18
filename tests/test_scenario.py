"""Scenario validation: every rule gives one message naming the file, the key and the rule."""

import textwrap
from pathlib import Path

import pytest

from harness import cli
from harness import scenario
from harness.scenario import schema
from harness.common.errors import BadInput

BASE = """
name = "s"
[model]
num_layers = 2
hidden_size = 64
ffn_hidden_size = 80
num_attention_heads = 4
seq_length = 16
vocab_size = 72
[data]
global_batch_size = 4
[train]
world_size = 2
steps = 2
[reference]
gtp = 1
[candidate]
gtp = 2
"""


def write(tmp_path, text, name="s.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def with_lines(**tables):
    """BASE with `key = value` lines set in the named tables (replacing a line of the same key)."""
    out, table = [], None
    for line in BASE.splitlines():
        if line.startswith("["):
            table = line.strip("[]")
        elif table in tables and "=" in line:
            new_keys = {new.split("=")[0].strip() for new in tables[table].splitlines()}
            if line.split("=")[0].strip() in new_keys:
                continue
        out.append(line)
        if line.startswith("[") and table in tables:
            out.append(tables[table])
    return "\n".join(out) + "\n"


def test_base_is_valid(tmp_path):
    (s,) = scenario.load(write(tmp_path, BASE))
    assert s.candidate.gtp == 2 and s.reference.gtp == 1
    assert s.golden.backend == "torch" and s.golden.world_size == 1 and s.golden.precision == "fp64"
    assert s.candidate.steps == 2 and s.golden.steps == 2  # [train] defaults reach every side


@pytest.mark.parametrize(
    "text, where, rule",
    [
        (BASE + "bogus = 1\n", "bogus", "unknown key"),
        (with_lines(model="depth = 3"), "[model].depth", "unknown key"),
        (with_lines(candidate="gtp_size = 2"), "[candidate].gtp_size", "unknown key"),
        (with_lines(train="tp = 3\nworld_size = 6"), "[reference].tp",
         "TP 3 must divide [model].num_attention_heads"),
        (with_lines(candidate="tp = 2", model="num_attention_heads = 3"), "[model].hidden_size",
         "multiple of num_attention_heads"),
        (with_lines(candidate="tp = 2\nworld_size = 4", model="ffn_hidden_size = 81"), "[candidate].tp",
         "[model].ffn_hidden_size"),
        (with_lines(candidate="tp = 2\nworld_size = 4", model="vocab_size = 71"), "[candidate].tp",
         "[model].vocab_size"),
        (with_lines(candidate="gtp_pad_alignment = 0", model="vocab_size = 71"), "[candidate].gtp",
         "must divide dim 0 of word_embeddings"),
        (with_lines(candidate="world_size = 3"), "[candidate].world_size", "multiple of TP x G"),
        # found by gtp-parity fuzz: TP x PP beyond the world divided by zero data ranks
        (with_lines(candidate="tp = 2\ngtp = 1\npipeline_parallel = 2", train="world_size = 2"),
         "[candidate].world_size", "multiple of TP x G x PP = 2 x 1 x 2"),
        (with_lines(model="untie_embeddings = false", candidate="backend = \"torch\""),
         "[model].untie_embeddings", "tied embedding/output weights under GTP are not covered by the torch"),
        (with_lines(model="preset = \"falcon\""), "[model].preset", "must be one of 'gpt', 'llama'"),
        (with_lines(train="steps = 0"), "[reference].steps", "must be >= 1"),
        (with_lines(candidate="lr_warmup_steps = 2"), "[candidate].lr_warmup_steps",
         "< lr_decay_steps (or steps) = 2"),
        (BASE + "[golden]\nworld_size = 2\n", "[golden].world_size", "single process"),
        (with_lines(candidate="backend = \"jax\""), "[candidate].backend", "unknown backend"),
        (with_lines(candidate="precision = \"fp64\""), "[candidate].precision",
         "not supported by the megatron backend"),
        (with_lines(candidate="optimizer = \"lion\""), "[candidate].optimizer", "unknown optimizer"),
        (with_lines(data="global_batch_size = 3"), "[data].global_batch_size",
         "multiple of micro_batch_size x data ranks"),
        (with_lines(candidate="steps = 3"), "steps", "same number of steps"),
        (with_lines(candidate="dp = 2"), "[candidate].dp", "world_size / (TP x G)"),
        (with_lines(candidate="inject = [\"no-such-fault\"]"), "[candidate].inject", "unknown fault"),
        (with_lines(candidate="tp = \"two\""), "[candidate].tp", "must be int"),
        (BASE + "[compare]\nk_first_step = -1.25\n", "[compare].k_first_step", "must be >= 0"),
        (BASE + "[compare]\nk = nan\n", "[compare].k", "must be a finite number"),
    ],
)
def test_rule_violations_name_file_key_and_rule(tmp_path, text, where, rule):
    path = write(tmp_path, text)
    with pytest.raises(BadInput) as err:
        scenario.load(path)
    message = str(err.value)
    assert str(path) in message
    assert where in message
    assert rule in message


def test_cli_exit_code_2_and_one_message(tmp_path, capsys):
    path = write(tmp_path, with_lines(candidate="world_size = 3"))
    assert cli.main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "[candidate].world_size" in err[0] and str(path) in err[0]


def test_cli_bad_arguments_exit_2(capsys):
    assert cli.main(["validate", "/no/such/file.toml"]) == 2
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["frobnicate"])
    assert e.value.code == 2


def test_invalid_toml_names_file(tmp_path):
    path = write(tmp_path, "name = \n")
    with pytest.raises(BadInput, match="invalid TOML"):
        scenario.load(path)


def test_matrix_expands_product_of_axes(tmp_path):
    write(tmp_path, BASE, "base.toml")
    path = write(tmp_path, """
        [matrix]
        base = "base.toml"
        name = "{topo}-{train.precision}"
        [matrix.axes]
        topo = [{label = "g2", candidate = {gtp = 2}}, {label = "tp2", candidate = {tp = 2, gtp = 1}}]
        "train.precision" = ["fp32", "bf16"]
        "reference.seed,candidate.seed" = [5]
    """, "m.toml")
    scenarios = scenario.load(path)
    assert [s.name for s in scenarios] == ["g2-fp32", "g2-bf16", "tp2-fp32", "tp2-bf16"]
    assert scenarios[2].candidate.tp == 2 and scenarios[2].candidate.gtp == 1
    assert all(s.reference.seed == 5 and s.candidate.seed == 5 for s in scenarios)
    assert scenarios[1].reference.precision == "bf16" and scenarios[1].golden.precision == "fp64"
    assert scenarios[0].axes == {"topo": "g2", "train.precision": "fp32",
                                 "reference.seed,candidate.seed": "5"}


def test_matrix_rule_violation_names_the_expanded_scenario(tmp_path):
    write(tmp_path, BASE, "base.toml")
    path = write(tmp_path, """
        [matrix]
        base = "base.toml"
        [matrix.axes]
        "candidate.world_size" = [2, 3]
    """, "m.toml")
    with pytest.raises(BadInput, match=r"\(3\).*\[candidate\]\.world_size"):
        scenario.load(path)


def test_matrix_unknown_template_axis(tmp_path):
    write(tmp_path, BASE, "base.toml")
    path = write(tmp_path,
                 '[matrix]\nbase = "base.toml"\nname = "{nope}"\n[matrix.axes]\n"train.seed" = [1]\n',
                     "m.toml")
    with pytest.raises(BadInput, match="unknown axis 'nope'"):
        scenario.load(path)


def test_shipped_scenarios_are_valid():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    seed = scenario.load(root / "scenarios/bridge_seed_bf16.toml")[0]
    m, d, c = seed.model, seed.data, seed.candidate
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.seq_length,
            m.vocab_size) == (2, 128, 256, 4, 64, 128)
    assert (c.tp, c.gtp, c.precision, c.optimizer, d.micro_batch_size, d.global_batch_size, d.seed) == (1, 2,
        "bf16", "adam", 1, 2, 1234)
    assert (c.lr, c.min_lr, c.lr_warmup_steps, c.steps, c.lr_decay_style, c.weight_decay,
            c.clip_grad) == (3e-4, 3e-5, 1, 3, "cosine", 0.01, 1.0)
    default = scenario.load(root / "scenarios/default.toml")
    topo = {(s.candidate.tp, s.candidate.gtp) for s in default}
    assert {(1, 2), (1, 4), (2, 1), (2, 2), (2, 4)} <= topo
    assert {s.candidate.precision for s in default} == {"fp32", "bf16"}
    assert {s.candidate.optimizer for s in default} == {"adam", "sgd"}


def test_recipe_names_match_the_emulated_recipes():
    from harness.quant import RECIPES

    assert schema.RECIPE_NAMES == {"none", *RECIPES}


def test_megatron_recipe_without_te_is_skipped_with_the_reason(tmp_path):
    import json

    from harness.session import run_scenarios

    (s,) = scenario.load(write(tmp_path, with_lines(candidate='recipe = "float8_current_scaling"')))
    assert run_scenarios([s], tmp_path / "out") == 0
    doc = json.loads((tmp_path / "out" / "summary.json").read_text())
    (only,) = doc["scenarios"]
    assert doc["verdict"] == "skip" and only["verdict"] == "skip"
    assert "Transformer Engine is not importable" in only["reason"]
    assert not (tmp_path / "out" / "traces").exists()  # nothing was launched


@pytest.mark.parametrize("lines, where, rule", [
    ({"candidate": 'backend = "torch"\nrecipe = "mxfp8"'}, "[candidate].recipe",
     "mxfp8 needs linear_fc1 (80) to be a multiple of 32"),
    ({"candidate": 'inject = ["fp8-unreduced-amax"]'}, "[candidate].inject",
     "needs the torch backend with a recipe"),
])
def test_recipe_rules(tmp_path, lines, where, rule):
    with pytest.raises(BadInput) as err:
        scenario.load(write(tmp_path, with_lines(**lines)))
    assert where in str(err.value) and rule in str(err.value)


def test_golden_never_inherits_a_recipe(tmp_path):
    text = with_lines(train='backend = "torch"\nrecipe = "float8_current_scaling"',
                      model="ffn_hidden_size = 64")
    (s,) = scenario.load(write(tmp_path, text))
    assert s.candidate.recipe == "float8_current_scaling" and s.golden.recipe == "none"


def test_every_file_in_scenarios_is_a_valid_scenario(capsys):
    """``gtp-parity validate scenarios/*.toml``, the first thing a user tries, exits 0: the
    folder holds scenarios only (the mutation triage lives beside its campaign)."""
    files = sorted(str(p) for p in (Path(__file__).resolve().parents[1] / "scenarios").glob("*.toml"))
    assert len(files) > 10
    assert cli.main(["validate", *files]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert out.count("ok  ") >= len(files)
