"""Hostile and careless inputs: every one ends with exit 2 and one line naming what and where.

Each case runs the real command line in-process: scenario files (unreadable, mistyped,
non-finite, absurd, names that are paths, faults that can never fire), and arguments (counts,
output folders that are files, traces that are not traces). None may print a traceback, and
none may launch anything.
"""

from __future__ import annotations

import json

import pytest

from harness.cli import main

BASE = """\
name = "bad-input-base"
timeout_s = 60

[model]
num_layers = 1
hidden_size = 32
ffn_hidden_size = 64
num_attention_heads = 4
seq_length = 8
vocab_size = 64

[data]
global_batch_size = 4

[train]
backend = "megatron"
world_size = 2
steps = 2
lr_warmup_steps = 0

[reference]
gtp = 1

[candidate]
gtp = 2

[golden]
precision = "fp64"
"""


def edit(section: str | None = None, line: str = "", drop: str | None = None, text: str = BASE) -> str:
    """BASE with ``line`` added at the top of ``[section]`` (or at the top of the file)."""
    if drop is not None:
        text = "\n".join(x for x in text.splitlines() if not x.startswith(drop)) + "\n"
    if section is None:
        return line + "\n" + text
    header = f"[{section}]\n"
    if header not in text:
        return text + "\n" + header + line + "\n"
    return text.replace(header, header + line + "\n", 1)


MATRIX = 'base = "base.toml"\n'

# (id, scenario text, where the message must point, the rule it must state)
SCENARIOS = [
    # [matrix] tables of the wrong shape
    ("matrix-int", "matrix = 5\n" + BASE, "[matrix]", "must be a table"),
    ("matrix-base-int", "[matrix]\nbase = 5\n[matrix.axes]\nx = [1]\n", "[matrix].base",
     "must be a file name"),
    ("matrix-axes-str", '[matrix]\nbase = "base.toml"\naxes = "x"\n', "[matrix.axes]", "must be a table"),
    ("matrix-axes-empty", '[matrix]\nbase = "base.toml"\n[matrix.axes]\n', "[matrix.axes]",
     "at least one axis"),
    ("matrix-axis-int", '[matrix]\nbase = "base.toml"\n[matrix.axes]\n"train.lr" = 5\n', "train.lr",
     "non-empty list"),
    ("matrix-axis-empty", '[matrix]\nbase = "base.toml"\n[matrix.axes]\n"train.lr" = []\n', "train.lr",
     "non-empty list"),
    ("matrix-name-int", '[matrix]\nbase = "base.toml"\nname = 5\n[matrix.axes]\n"train.lr" = [0.1]\n',
     "[matrix].name", "string template"),
    ("matrix-name-unknown-axis",
     '[matrix]\nbase = "base.toml"\nname = "{nope}"\n[matrix.axes]\n"train.lr" = [0.1]\n',
     "[matrix].name", "unknown axis"),
    ("matrix-base-missing", '[matrix]\nbase = "nope.toml"\n[matrix.axes]\n"train.lr" = [0.1]\n', "nope.toml",
     "no such file"),
    ("matrix-base-self", '[matrix]\nbase = "s.toml"\n[matrix.axes]\n"train.lr" = [0.1]\n', "[matrix].base",
     "itself"),
    ("matrix-axis-through-scalar", '[matrix]\nbase = "base.toml"\n[matrix.axes]\n"name.x" = ["a"]\n',
     "name.x", "not a table"),
    ("matrix-axis-bad-path", '[matrix]\nbase = "base.toml"\n[matrix.axes]\n"train..lr" = [0.1]\n',
     "train..lr", "not a path into the scenario"),
    ("matrix-duplicate-names",
     '[matrix]\nbase = "base.toml"\nname = "same"\n[matrix.axes]\n"train.lr" = [0.1, 0.2]\n',
     "[matrix].name", "duplicate name"),
    ("matrix-when-not-list", '[matrix]\nbase = "base.toml"\nwhen = 5\n[matrix.axes]\n"train.lr" = [0.1]\n',
     "[[matrix.when]]", "list of tables"),
    ("matrix-when-unknown-axis", '[matrix]\nbase = "base.toml"\n[matrix.axes]\n"train.lr" = [0.1]\n'
     '[[matrix.when]]\naxes = { "train.seed" = "1" }\nexpect = { signature = "mismatch" }\n',
     "[[matrix.when]][0].axes.train.seed", "not an axis"),
    ("matrix-when-unknown-label", '[matrix]\nbase = "base.toml"\n[matrix.axes]\n"train.lr" = [0.1]\n'
     '[[matrix.when]]\naxes = { "train.lr" = "0.2" }\nexpect = { signature = "mismatch" }\n',
     "[[matrix.when]][0].axes.train.lr", "labels must be among"),
    ("matrix-when-sets-nothing", '[matrix]\nbase = "base.toml"\n[matrix.axes]\n"train.lr" = [0.1]\n'
     '[[matrix.when]]\naxes = { "train.lr" = "0.1" }\n', "[[matrix.when]][0]", "must set scenario tables"),
    ("matrix-unknown-key", '[matrix]\nbase = "base.toml"\nbases = 1\n[matrix.axes]\n"train.lr" = [0.1]\n',
     "[matrix].bases", "unknown key"),
    ("matrix-name-is-path", '[matrix]\nbase = "base.toml"\nname = "{x}"\n[matrix.axes]\n'
     'x = [{ label = "../../evil" }]\n', "name", "not a valid name"),
    ("matrix-too-large", '[matrix]\nbase = "base.toml"\n[matrix.axes]\n'
     + "".join(f'"model.init_std,x{i}" = [{", ".join(["0.02"] * 10)}]\n' for i in range(5)),
     "[matrix.axes]", "more than"),
    # top-level keys
    ("timeout-str", edit(None, 'timeout_s = "soon"', drop="timeout_s"), "timeout_s", "must be float"),
    ("timeout-list", edit(None, "timeout_s = [1]", drop="timeout_s"), "timeout_s", "must be float"),
    ("timeout-nan", edit(None, "timeout_s = nan", drop="timeout_s"), "timeout_s", "finite"),
    ("timeout-inf", edit(None, "timeout_s = inf", drop="timeout_s"), "timeout_s", "finite"),
    ("timeout-negative", edit(None, "timeout_s = -1", drop="timeout_s"), "timeout_s", "must be > 0"),
    ("timeout-bool", edit(None, "timeout_s = true", drop="timeout_s"), "timeout_s", "must be float"),
    ("timeout-huge", edit(None, "timeout_s = 1e9", drop="timeout_s"), "timeout_s", "exceeds the limit"),
    ("name-empty", edit(None, 'name = ""', drop="name"), "name", "non-empty"),
    ("name-parent-path", edit(None, 'name = "../../x"', drop="name"), "name", "not a valid name"),
    ("name-slash", edit(None, 'name = "a/b"', drop="name"), "name", "not a valid name"),
    ("name-absolute", edit(None, 'name = "/tmp/x"', drop="name"), "name", "not a valid name"),
    ("name-int", edit(None, "name = 5", drop="name"), "name", "non-empty string"),
    ("name-missing", edit(drop="name"), "name", "needs a name"),
    ("unknown-top-key", edit(None, "steps = 2"), "steps", "unknown key"),
    ("model-not-table", 'name = "m"\nmodel = 5\n' + BASE[BASE.index("[data]"):], "[model]",
     "must be a table"),
    ("description-int", edit(None, "description = 5"), "description", "must be a string"),
    ("no-candidate", BASE.replace("[candidate]\ngtp = 2\n", ""), "[candidate]", "missing table"),
    # model sizes and values
    ("hidden-1e9", BASE.replace("hidden_size = 32", "hidden_size = 1000000000"), "[model].hidden_size",
     "exceeds the limit"),
    ("seq-1e9", BASE.replace("seq_length = 8", "seq_length = 1000000000"), "[model].seq_length",
     "exceeds the limit"),
    ("vocab-1e23", BASE.replace("vocab_size = 64", "vocab_size = 100000000000000000000000"),
     "[model].vocab_size",
     "2**31"),
    ("layers-zero", BASE.replace("num_layers = 1", "num_layers = 0"), "[model].num_layers", ">= 1"),
    ("hidden-float", BASE.replace("hidden_size = 32", "hidden_size = 32.0"), "[model].hidden_size",
     "must be int"),
    ("hidden-bool", BASE.replace("hidden_size = 32", "hidden_size = true"), "[model].hidden_size",
     "must be int"),
    ("init-std-nan", edit("model", "init_std = nan"), "[model].init_std", "finite"),
    ("init-std-negative", edit("model", "init_std = -0.02"), "[model].init_std", "> 0"),
    ("init-std-zero", edit("model", "init_std = 0"), "[model].init_std", "> 0"),
    ("parameters-too-many",
     BASE.replace("hidden_size = 32", "hidden_size = 8192").replace("num_layers = 1", "num_layers = 64"),
     "[model]", "parameters"),
    ("heads-not-dividing", BASE.replace("num_attention_heads = 4", "num_attention_heads = 5"),
     "[model].hidden_size",
     "multiple of num_attention_heads"),
    # data
    ("data-seed-negative", edit("data", "seed = -1"), "[data].seed", ">= 0"),
    ("micro-batch-zero", edit("data", "micro_batch_size = 0"), "[data]", ">= 1"),
    ("global-batch-huge", BASE.replace("global_batch_size = 4", "global_batch_size = 131072"),
     "[data].global_batch_size", "exceeds the limit"),
    ("data-unknown-key", edit("data", "sed = 1"), "[data].sed", "unknown key"),
    # training values
    ("lr-nan", edit("candidate", "lr = nan"), "[candidate].lr", "finite"),
    ("lr-inf", edit("candidate", "lr = inf"), "[candidate].lr", "finite"),
    ("lr-negative", edit("candidate", "lr = -1.0"), "[candidate].lr", ">= 0"),
    ("lr-bool", edit("candidate", "lr = true"), "[candidate].lr", "must be float"),
    ("min-lr-negative", edit("train", "min_lr = -1.0"), "[reference].min_lr", ">= 0"),
    ("min-lr-above-lr", edit("train", "min_lr = 1.0"), "[reference].min_lr", "<= lr"),
    ("clip-negative", edit("candidate", "clip_grad = -1.0"), "[candidate].clip_grad", ">= 0"),
    ("clip-nan", edit("candidate", "clip_grad = nan"), "[candidate].clip_grad", "finite"),
    ("weight-decay-negative", edit("candidate", "weight_decay = -0.1"), "[candidate].weight_decay", ">= 0"),
    ("beta1-one", edit("candidate", "adam_beta1 = 1.0"), "[candidate].adam_beta1", "in [0.0, 1.0)"),
    ("adam-eps-zero", edit("candidate", "adam_eps = 0.0"), "[candidate].adam_eps", "> 0"),
    ("momentum-above-one", edit("candidate", "sgd_momentum = 1.5"), "[candidate].sgd_momentum",
     "in [0.0, 1.0)"),
    ("steps-1e15", BASE.replace("steps = 2", "steps = 1000000000000000"), "[train].steps", "2**31"),
    ("steps-huge", BASE.replace("steps = 2", "steps = 100000"), "steps", "exceeds the limit"),
    ("steps-zero", BASE.replace("steps = 2", "steps = 0"), "[reference].steps", ">= 1"),
    ("steps-differ", edit("candidate", "steps = 1"), "steps", "same number of steps"),
    ("world-10000", BASE.replace("world_size = 2", "world_size = 10000"), "world_size", "exceeds the limit"),
    ("tp-zero", edit("candidate", "tp = 0"), "[candidate].tp", ">= 1"),
    ("gtp-not-dividing", BASE.replace("[candidate]\ngtp = 2", "[candidate]\ngtp = 3"),
     "[candidate].world_size",
     "multiple of TP x G"),
    ("precision-fp16", edit("candidate", 'precision = "fp16"'), "[candidate].precision",
     "unknown precision 'fp16'"),
    ("backend-unknown", edit("candidate", 'backend = "jax"'), "[candidate].backend", "unknown backend"),
    ("optimizer-unknown", edit("candidate", 'optimizer = "lamb"'), "[candidate].optimizer",
     "unknown optimizer"),
    ("recipe-unknown", edit("candidate", 'recipe = "fp6"'), "[candidate].recipe", "unknown recipe"),
    ("decay-style-unknown", edit("candidate", 'lr_decay_style = "step"'), "[candidate].lr_decay_style",
     "one of"),
    ("decay-steps-zero", edit("candidate", "lr_decay_steps = 0"), "[candidate].lr_decay_steps", ">= 1"),
    ("side-unknown-key", edit("candidate", "gpt = 2"), "[candidate].gpt", "unknown key"),
    # planted faults
    ("inject-unknown", edit("candidate", 'inject = ["nope"]'), "[candidate].inject", "unknown fault"),
    ("inject-int", edit("candidate", "inject = [1]"), "[candidate].inject", "every item must be str"),
    ("inject-rank-outside", edit("candidate", 'inject = ["exit:7:1"]'), "[candidate].inject", "never fires"),
    ("inject-step-past-last", edit("candidate", 'inject = ["hang:1:9"]'), "[candidate].inject",
     "never fires"),
    ("inject-step-zero", edit("candidate", 'inject = ["raise:0:0"]'), "[candidate].inject", "never fires"),
    ("inject-gtp-fault-without-gtp", edit("reference", 'inject = ["gtp-rs-no-prescale"]'),
     "[reference].inject",
     "without GTP"),
    ("inject-golden", edit("golden", 'inject = ["optimizer-skips-weight"]'), "[golden].inject",
     "not the golden"),
    # GTP path options and known divergences
    ("recompute-unknown", edit("candidate", 'recompute = "most"'), "[candidate].recompute", "one of"),
    ("recompute-int", edit("candidate", "recompute = 1"), "[candidate].recompute", "must be one of"),
    ("per-token-unknown", edit("candidate", 'per_token_loss = "yes"'), "[candidate].per_token_loss",
     "one of"),
    ("collectives-unknown", edit("candidate", 'gtp_collectives = "sync"'), "[candidate].gtp_collectives",
     "one of"),
    ("prefetch-str", edit("candidate", 'gtp_weight_prefetch = "no"'), "[candidate].gtp_weight_prefetch",
     "must be bool"),
    ("bucket-without-overlap", edit("candidate", "bucket_size = 1000"), "[candidate].bucket_size",
     "overlap_grad_reduce"),
    ("bucket-zero", edit("candidate", "overlap_grad_reduce = true\nbucket_size = 0"),
     "[candidate].bucket_size",
     ">= 1"),
    ("loss-mask-unknown", edit("data", 'loss_mask = "random"'), "[data].loss_mask", "one of"),
    ("loss-mask-under-mean-loss", edit("data", 'loss_mask = "variable"'), "[reference].per_token_loss",
     "needs per_token_loss"),
    ("distopt-sgd", edit("candidate", 'distributed_optimizer = true\noptimizer = "sgd"'),
     "[candidate].distributed_optimizer", "Adam only"),
    ("grad-reduce-bf16-in-fp32", edit("candidate", "grad_reduce_in_fp32 = false"),
     "[candidate].grad_reduce_in_fp32",
     "only with precision bf16"),
    ("grad-reduce-bf16-on-torch",
     edit("candidate", 'backend = "torch"\nprecision = "bf16"\ngrad_reduce_in_fp32 = false'),
     "[candidate].grad_reduce_in_fp32", "only the megatron, mlm backends take this option"),
    ("param-gather-without-distopt", edit("candidate", "overlap_param_gather = true"),
     "[candidate].overlap_param_gather", "needs distributed_optimizer"),
    ("inject-missing-wait-async", edit("candidate", 'inject = ["gtp-prefetch-missing-wait"]'),
     "[candidate].inject",
     "lagging"),
    ("inject-token-count-mean-loss", edit("candidate", 'inject = ["token-count-without-gtp-peers"]'),
     "[candidate].inject", "without per-token loss"),
    ("inject-distopt-offsets-local", edit("candidate", 'inject = ["distopt-offsets-ignore-gtp-pad"]'),
     "[candidate].inject", "distributed optimizer"),
    ("path-option-on-torch", edit("candidate", 'backend = "torch"\nrecompute = "full"'),
     "[candidate].recompute",
     "only the megatron backend"),
    ("expect-without-reason", edit("expect", 'signature = "ratio-G"'), "[expect].reason", "root cause"),
    ("expect-verdict-unknown", edit("expect", 'verdict = "flaky"\nreason = "x"'), "[expect].verdict",
     "one of"),
    ("expect-step-past-last", edit("expect", 'reason = "x"\nstep = 5'), "[expect].step", "not in 1..2"),
    ("expect-not-table", edit(None, "expect = 5"), "[expect]", "must be a table"),
    # capture and compare policies
    ("capture-kind-unknown", edit("capture", 'kinds = ["weights"]'), "[capture].kinds", "unknown kind"),
    ("capture-tensors-int", edit("capture", "tensors = [1]"), "[capture].tensors", "every item must be str"),
    ("capture-step-zero", edit("capture", "steps = [0]"), "[capture].steps", "not in 1..2"),
    ("capture-step-past-last", edit("capture", "steps = [3]"), "[capture].steps", "not in 1..2"),
    ("capture-step-str", edit("capture", 'steps = ["a"]'), "[capture].steps", "every item must be int"),
    ("capture-mode-unknown", edit("capture", 'mode = "x"'), "[capture].mode", "full or fingerprint"),
    ("compare-k-inf", edit("compare", "k = inf"), "[compare].k", "finite"),
    ("compare-policy-unknown", edit("compare", 'policy = "fuzzy"'), "[compare].policy", "one of"),
    ("compare-floor-negative", edit("compare", "floor = -1.0"), "[compare].floor", ">= 0"),
]

def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _assert_one_clear_line(code: int, out: str, err: str, where: str, rule: str) -> None:
    assert code == 2, f"exit {code}, expected 2 (bad input); stderr: {err}"
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got {len(lines)}:\n{err}"
    assert "Traceback" not in out + err
    assert where in lines[0], f"{where!r} not named in: {lines[0]}"
    assert rule in lines[0], f"{rule!r} not stated in: {lines[0]}"


@pytest.mark.parametrize(("text", "where", "rule"), [c[1:] for c in SCENARIOS], ids=[c[0] for c in SCENARIOS])
def test_bad_scenario(tmp_path, capsys, text, where, rule):
    (tmp_path / "base.toml").write_text(BASE)
    path = tmp_path / "s.toml"
    path.write_text(text)
    code, out, err = _run(["validate", str(path)], capsys)
    _assert_one_clear_line(code, out, err, where, rule)
    assert str(path) in err
    # `run` refuses it the same way, before launching anything.
    code, out, err = _run(["run", str(path), "--out", str(tmp_path / "out")], capsys)
    _assert_one_clear_line(code, out, err, where, rule)
    assert not (tmp_path / "out" / "traces").exists()


def test_base_scenario_is_valid(tmp_path, capsys):
    """The corpus's base is valid: each case fails for its own edit."""
    (tmp_path / "s.toml").write_text(BASE)
    code, out, err = _run(["validate", str(tmp_path / "s.toml")], capsys)
    assert code == 0, err


def _files(tmp_path):
    """Unreadable scenario files: a folder, binary bytes, Latin-1 text, a missing file, a huge file."""
    (tmp_path / "folder.toml").mkdir()
    (tmp_path / "binary.toml").write_bytes(bytes(range(256)))
    (tmp_path / "latin1.toml").write_bytes('name = "café"\n'.encode("latin-1"))
    (tmp_path / "broken.toml").write_text("name = \n")
    (tmp_path / "huge.toml").write_text("# " + "x" * (1 << 20) + "\n")
    return {
        "folder.toml": "is a folder", "binary.toml": "not UTF-8", "latin1.toml": "not UTF-8",
        "missing.toml": "no such file", "broken.toml": "invalid TOML", "huge.toml": "not a scenario file",
    }


@pytest.mark.parametrize("name",
                         ["folder.toml", "binary.toml", "latin1.toml", "missing.toml", "broken.toml",
                          "huge.toml"])
def test_unreadable_scenario_file(tmp_path, capsys, name):
    rule = _files(tmp_path)[name]
    code, out, err = _run(["run", str(tmp_path / name), "--out", str(tmp_path / "out")], capsys)
    _assert_one_clear_line(code, out, err, str(tmp_path / name), rule)


def test_validate_reports_every_bad_file(tmp_path, capsys):
    good, bad1, bad2 = tmp_path / "good.toml", tmp_path / "bad1.toml", tmp_path / "bad2.toml"
    good.write_text(BASE)
    bad1.write_text(edit("candidate", "lr = nan"))
    bad2.write_text(BASE.replace("steps = 2", "steps = 0"))
    code, out, err = _run(["validate", str(bad1), str(good), str(bad2)], capsys)
    assert code == 2
    assert "ok  bad-input-base" in out
    lines = err.strip().splitlines()
    assert len(lines) == 2 and str(bad1) in lines[0] and str(bad2) in lines[1]


def test_limits_are_lifted_by_flag(tmp_path, capsys):
    path = tmp_path / "s.toml"
    path.write_text(BASE.replace("steps = 2", "steps = 20000"))
    code, _, err = _run(["validate", str(path)], capsys)
    assert code == 2 and "--no-limits" in err
    code, out, err = _run(["validate", "--no-limits", str(path)], capsys)
    assert code == 0, err


ARGUMENTS = [
    ("jobs-zero", ["run", "{s}", "--jobs", "0"], "--jobs", "must be >= 1"),
    ("jobs-word", ["run", "{s}", "--jobs", "x"], "--jobs", "not an integer"),
    ("matrix-jobs-negative", ["matrix", "{s}", "--jobs", "-1"], "--jobs", "must be >= 1"),
    ("out-is-file", ["run", "{s}", "--out", "{file}"], "--out", "not a folder"),
    ("out-below-file", ["run", "{s}", "--out", "{file}/sub"], "--out", "not a folder"),
    ("report-is-file", ["matrix", "{s}", "--report", "{file}"], "--report", "not a folder"),
    ("inject-unknown", ["run", "{s}", "--inject", "nope"], "--inject", "unknown fault"),
    ("inject-rank-outside", ["run", "{s}", "--inject", "exit:7:1"], "--inject", "never fires"),
    ("inject-step-past-last", ["run", "{s}", "--inject", "exit:1:3"], "--inject", "never fires"),
    ("inject-on-reference-without-gtp",
     ["run", "{s}", "--inject", "gtp-pad-leak", "--inject-side", "reference"],
     "--inject", "without GTP"),
    ("compare-k-nan", ["compare", "{t}", "{t}", "--k", "nan"], "--k", "finite"),
    ("compare-k-negative", ["compare", "{t}", "{t}", "--k", "-1"], "--k", ">= 0"),
    ("compare-floor-inf", ["compare", "{t}", "{t}", "--floor", "inf"], "--floor", "finite"),
    ("compare-policy-unknown", ["compare", "{t}", "{t}", "--policy", "fuzzy"], "--policy", "invalid choice"),
    ("compare-jobs-zero", ["compare", "{t}", "{t}", "--jobs", "0"], "--jobs", ">= 1"),
    ("run-compare-jobs-zero", ["run", "{s}", "--compare-jobs", "0"], "--compare-jobs", ">= 1"),
    ("compare-not-a-trace", ["compare", "{dir}", "{dir}", "--out", "{out}"], "{dir}", "not a trace"),
    ("compare-a-file", ["compare", "{file}", "{file}", "--out", "{out}"], "{file}", "not a trace folder"),
    ("compare-out-is-file", ["compare", "{dir}", "{dir}", "--out", "{file}"], "--out", "not a folder"),
    ("report-not-a-run", ["report", "{dir}", "--out", "{out}"], "{dir}", "not a run folder"),
    ("report-corrupt-summary", ["report", "{run}", "--out", "{out}"], "summary.json", "not a run summary"),
    ("report-name-is-path", ["report", "{evil}", "--out", "{out}"], "summary.json", "not a valid name"),
    ("unknown-command", ["frobnicate"], "gtp-parity", "invalid choice"),
    ("inject-list-missing", ["inject"], "--list", "required"),
]


@pytest.mark.parametrize(("argv", "where", "rule"), [c[1:] for c in ARGUMENTS], ids=[c[0] for c in ARGUMENTS])
def test_bad_argument(tmp_path, capsys, argv, where, rule):
    (tmp_path / "s.toml").write_text(BASE)
    (tmp_path / "file").write_text("a file\n")
    (tmp_path / "dir").mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.json").write_text("{not json")
    (tmp_path / "evil" / "scenarios").mkdir(parents=True)
    (tmp_path / "evil" / "summary.json").write_text(json.dumps({"scenarios": [{"scenario": "../../pwned"}]}))
    fill = {k: str(tmp_path / v) for k, v in
            {"s": "s.toml", "file": "file", "dir": "dir", "out": "out", "run": "run", "evil": "evil",
             "t": "dir"}.items()}
    argv = [a.format(**fill) for a in argv]
    try:
        code, out, err = _run(argv, capsys)
    except SystemExit as e:  # argparse's own exit path
        code = e.code
        out, err = capsys.readouterr()
    _assert_one_clear_line(code, out, err, where.format(**fill), rule)
    assert not (tmp_path / "out" / "traces").exists()
    assert not list(tmp_path.parent.glob("pwned*")) and not (tmp_path / "pwned.html").exists()
