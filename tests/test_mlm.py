"""The mlm backend: Megatron-LM's own loop (megatron.training.pretrain) on CPU, captured.

Every mlm scenario runs in one call, so the sides of world 2 share one launch (one import of
megatron.training): the seed (MLM GTP 2 vs MLM GTP off), the frontend scenario (gtp-parity's
loop vs Megatron-LM's at GTP 2), the tiny scenario and its planted faults."""

import fnmatch
import re

import pytest
import torch

from harness import cli
from harness import scenario
from harness.capture import trace
from harness.common.errors import BadInput
from harness.backends.faults import CATALOG
from harness.session import run_scenarios
from tests.helpers import ASSETS, ROOT, results, summary

pytestmark = pytest.mark.multirank

SEED, FRONTEND, TINY = "mlm-seed-tp1-gtp2-bf16", "mlm-vs-megatron-tp1-gtp2-bf16", "mlm-tiny-tp1-gtp2-fp32-sgd"
MOCK = "mlm-mock-tp1-gtp2-bf16"
FILES = [ROOT / "scenarios" / "mlm_seed.toml", ROOT / "scenarios" / "mlm_vs_megatron.toml",
         ASSETS / "mlm_tiny.toml", ASSETS / "mlm_faults.toml", ASSETS / "mlm_mock.toml"]
FAULTS = sorted({f for s in scenario.load(ASSETS / "mlm_faults.toml") for f in s.candidate.inject})
SEED_FLAGS = (
    "--tokenizer-type NullTokenizer --vocab-size 128 --num-layers 2 --hidden-size 128 --ffn-hidden-size 256 "
    "--num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 --micro-batch-size 1 "
    "--global-batch-size 2 --train-iters 3 --eval-interval 100 --eval-iters 0 --lr 3e-4 --min-lr 3e-5 "
    "--lr-warmup-iters 1 --lr-decay-iters 3 --lr-decay-style cosine --weight-decay 0.01 "
    "--weight-decay-incr-style constant --clip-grad 1.0 --bf16 --disable-bias-linear "
    "--untie-embeddings-and-output-weights --no-gradient-accumulation-fusion --attention-dropout 0 "
    "--hidden-dropout 0 --attention-softmax-in-fp32 --tensor-model-parallel-size 1 "
    "--pipeline-model-parallel-size 1 --tensor-parallel-num-weight-shards 2 --seed 1234 --log-interval 1 "
    "--dataloader-type single --num-workers 0"
).split()


@pytest.fixture(scope="module")
def mlm_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("mlm")
    code = run_scenarios([s for f in FILES for s in scenario.load(f)], out, parallel=2)
    assert code == 1  # the fault scenarios fail; each verdict is checked below
    return out


def _files(path):
    return sorted(p.relative_to(path) for p in path.rglob("*.safetensors"))


def test_seed_diverges_as_recorded_with_step_table(mlm_run):
    # Megatron-LM's loop on 0.19.2 shows the bf16 GTP reduce-scatter's extra rounding, as recorded.
    s = summary(mlm_run, SEED)
    assert s["verdict"] == "known-divergence", s["first_divergence"]
    assert (s["first_divergence"]["step"], s["first_divergence"]["kind"]) == (1, "main_grad")
    df = results(mlm_run, SEED)
    step0 = df[df["step"] == 0]
    # every parameter, cut from the canonical weights
    assert len(step0) == 21 and step0["bitwise_equal"].all()
    steps = (mlm_run / "scenarios" / SEED / "steps.csv").read_text()
    assert steps.count("\n") >= 4 and "grad_norm" in steps and "lr" in steps


def test_frontends_agree_bitwise(mlm_run):
    """gtp-parity's loop and Megatron-LM's run the same megatron-core calls on the same values in
    the same order (schedule, finalize, optimizer, scheduler in samples, loss reduced over the
    GTP-inclusive data group), so every captured tensor and scalar is bitwise equal."""
    s = summary(mlm_run, FRONTEND)
    assert s["verdict"] == "pass" and s["first_divergence"] is None
    ref, cand = (trace.read(s["traces"][role]) for role in ("reference", "candidate"))
    assert ref.manifest["backend"] == "megatron" and cand.manifest["backend"] == "mlm"
    assert _files(ref.path) == _files(cand.path) and _files(ref.path)
    for f in _files(ref.path):
        assert (ref.path / f).read_bytes() == (cand.path / f).read_bytes(), f
    # One difference, in the logged grad norm only: train_step passes the optimizer's norm (a
    # Python float, fp64) through reduce_max_stat_across_model_parallel_group, a float32 tensor.
    as_logged = {"grad_norm": lambda v: float(torch.tensor(v, dtype=torch.float32))}
    ref_scalars = [(x["step"], x["name"], as_logged.get(x["name"], float)(x["value"])) for x in ref.scalars]
    # The loss Megatron-LM's log line prints (loss_logged) has no counterpart: the harness's loop logs no
    # line.
    assert ref_scalars == [(x["step"], x["name"], x["value"]) for x in cand.scalars
                           if x["name"] != "loss_logged"]
    assert any(x["name"] == "grad_norm" and x["value"] != float(torch.tensor(x["value"], dtype=torch.float32))
               for x in ref.scalars)  # the harness's loop keeps the fp64 norm: the difference is real


def test_mlm_lr_applied_and_logged(mlm_run):
    # Megatron-LM steps its scheduler after the optimizer: the warmup step applies LR 0 and logs the peak.
    cand = trace.read(summary(mlm_run, SEED)["traces"]["candidate"])
    by = {(x["step"], x["name"]): x["value"] for x in cand.scalars if x["rank"] == 0}
    peak = scenario.load(FILES[0])[0].candidate.lr
    assert by[(1, "lr")] == 0.0 and by[(1, "lr_logged")] == peak and by[(2, "lr")] == peak


def test_tiny_gtp_on_vs_off_forward_bitwise_at_step1(mlm_run):
    assert summary(mlm_run, TINY)["verdict"] == "pass"
    df = results(mlm_run, TINY)
    fwd = df[(df["step"] == 1) & df["kind"].isin(["loss", "activation", "logits"])]
    assert len(fwd) and fwd["bitwise_equal"].all()


def test_mock_data_sides_read_megatron_lm_samples(mlm_run):
    """data = "mock": Megatron-LM's --mock-data pipeline, as the seed's command ran. The sides
    are judged against each other only (the golden reads the synthetic samples)."""
    s = summary(mlm_run, MOCK)
    assert s["traces"]["golden"] == "None"
    df = results(mlm_run, MOCK)
    step1 = df[(df["step"] == 1) & df["kind"].isin(["input", "loss", "activation", "logits"])]
    assert len(step1) and step1["bitwise_equal"].all()  # GTP on vs off read the same mock samples

    def losses(name):
        t = trace.read(summary(mlm_run, name)["traces"]["reference"])
        return [x["value"] for x in t.scalars if x["name"] == "reduced_loss" and x["rank"] == 0]

    # Same sample ids, same weights: only the tokens differ from the synthetic samples'.
    assert all(a != b for a, b in zip(losses(MOCK), losses(SEED)))


@pytest.mark.parametrize("fault", FAULTS)
def test_planted_fault_localized_on_mlm(mlm_run, fault):
    s = summary(mlm_run, f"mlm-fault-{fault}")
    fd, expect = s["first_divergence"], CATALOG[fault].expect
    assert s["verdict"] == "fail"
    assert (fd["step"], fd["kind"], fd["signature"]) == (expect["step"], expect["kind"],
                                                         expect["signature"]), fd
    assert fnmatch.fnmatchcase(fd["tensor"], expect["tensor"]), fd


def test_mlm_command_bad_flag_exits_2_naming_it(tmp_path, capsys):
    code = cli.main(["mlm", "--nproc", "2", "--out", str(tmp_path), "--", "--no-such-flag", "3", *SEED_FLAGS])
    assert code == 2 and "--no-such-flag" in capsys.readouterr().err


def test_mlm_command_reads_its_keys_and_refuses_what_the_harness_cannot_assemble():
    """The seed command's flags are the scenario's keys or the harness's fixed flags: no args
    are left; a fixed flag at another value, or a flag shaping the parameters, is refused."""
    from harness.backends.mlm.command import scenario_of

    s = scenario_of(list(SEED_FLAGS), 2)
    assert s.reference.args == () and (s.reference.gtp, s.reference.lr, s.model.seq_length) == (2, 3e-4, 64)
    assert scenario_of([*SEED_FLAGS, "--log-timers-to-tensorboard"], 2).reference.args == (
        "--log-timers-to-tensorboard",)
    for extra, said in ((["--num-workers", "2"], "--num-workers 0"),
                        (["--max-position-embeddings=128"], "--max-position-embeddings 64"),
                        (["--multi-latent-attention"], "shapes the model's parameters")):
        with pytest.raises(BadInput, match=re.escape(said)):
            scenario_of([*SEED_FLAGS, *extra], 2)


def test_mlm_command_trace_compares_with_the_seed_side(mlm_run, tmp_path, capsys):
    """The seed's command (on the harness's samples: no --mock-data) is the seed scenario's GTP 2
    side: compare reads its trace and finds them bitwise equal."""
    assert cli.main(["mlm", "--nproc", "2", "--out", str(tmp_path), "--", *SEED_FLAGS]) == 0
    out = capsys.readouterr().out
    assert len(re.findall(r"^iteration \d: lm loss", out, re.M)) == 3
    path = re.search(r"^trace: (.+)$", out, re.M).group(1)
    seed_gtp2 = summary(mlm_run, SEED)["traces"]["candidate"]
    assert cli.main(["compare", path, seed_gtp2, "--policy", "exact", "--out", str(tmp_path / "cmp")]) == 0


def test_scenario_args_refused_by_megatron_lm_parser_exit_2(tmp_path, capsys):
    text = (ASSETS / "mlm_tiny.toml").read_text().replace("[candidate]\n",
                                                          '[candidate]\nargs = ["--no-such-flag"]\n')
    (tmp_path / "bad.toml").write_text(text)
    code = cli.main(["run", str(tmp_path / "bad.toml"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "[candidate].args" in err and "--no-such-flag" in err
    assert not (tmp_path / "out" / "traces").exists()  # refused before any launch


@pytest.mark.parametrize("edit, where", [
    ('[reference]\nbackend = "megatron"\nargs = ["--bf16"]\n', "[reference].args"),
    ('[reference]\ndata = "mock"\n', "[reference].data"),
    ('[reference]\ngtp_pad_alignment = 32\n', "[reference].gtp_pad_alignment"),
    ('[candidate]\ninject = ["gtp-peers-same-sample"]\n', "[candidate].inject"),
])
def test_mlm_side_rules(tmp_path, edit, where):
    section = edit.split("\n", 1)[0] + "\n"
    text = (ASSETS / "mlm_tiny.toml").read_text().replace(section, edit, 1)
    (tmp_path / "s.toml").write_text(text)
    with pytest.raises(BadInput) as e:
        scenario.load(tmp_path / "s.toml")
    assert where in str(e.value)


def test_a_source_tree_borrows_the_wheels_helpers_build_only_for_the_same_source(tmp_path):
    """A checkout has helpers.cpp but no build: the wheel's build serves where the source is
    byte for byte the wheel's, and an edited source is refused with how to build it."""
    from harness.backends.mlm.compat import wheel_build_of_same_source
    from harness.run.trees import installed_root

    wheel = installed_root() / "megatron" / "core" / "datasets"
    tree = tmp_path / "datasets"
    tree.mkdir()
    (tree / "helpers.cpp").write_bytes((wheel / "helpers.cpp").read_bytes())
    assert callable(wheel_build_of_same_source(tree, wheel).build_sample_idx_int32)
    (tree / "helpers.cpp").write_bytes((wheel / "helpers.cpp").read_bytes() + b"// edited\n")
    with pytest.raises(ModuleNotFoundError, match=f"make -C {tree}"):
        wheel_build_of_same_source(tree, wheel)
