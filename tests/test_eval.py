"""Evaluation between training steps under GTP: the features matrix's eval scenarios (the
harness's loop and Megatron-LM's, GTP 2 vs off, world 2) and the planted faults only an
evaluation exposes, in one run; then the rules, without a launch."""

import fnmatch
import math
import re

import pytest
import torch

from harness import cli, scenario
from harness.backends.evaluation import REPORTED, SAMPLE, eval_points, eval_sample_ids
from harness.capture import trace
from harness.common.errors import BadInput
from harness.common.mesh import Mesh
from harness.compare.evaluation import partial_average
from harness.scenario.faults import CATALOG
from harness.session import run_scenarios
from tests.helpers import ASSETS, ROOT, results, summary

FEATURES, FAULTS = ROOT / "scenarios" / "features.toml", ASSETS / "eval_faults.toml"
LABELS = ("eval", "eval-mlm")
SCENARIOS = [s for s in scenario.load(FEATURES) if s.axes.get("feature") in LABELS] + scenario.load(FAULTS)
EVAL = SCENARIOS[0]
FAULT_SCENARIOS = {s.name: s.candidate.inject[0] for s in SCENARIOS if s.candidate.inject}
EPS32 = torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def eval_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    assert run_scenarios(SCENARIOS, out, parallel=2) == 1  # the fault scenarios fail; each is checked
    return out


def _trace(out, name, role):
    return trace.read(summary(out, name)["traces"][role])


def _eval_scalars(t, name):
    return [s for s in t.scalars if s["name"] == name]


@pytest.mark.multirank
def test_eval_gtp2_bitwise_as_gtp_off_on_the_harness_loop(eval_run):
    """One micro-batch per data rank and no clipping keep the weights bitwise: every evaluation's
    per-sample and reported loss is expected bitwise, and is."""
    assert summary(eval_run, "eval")["verdict"] == "pass"
    rows = results(eval_run, "eval")
    rows = rows[rows["kind"] == "eval"]
    s = EVAL
    samples = len(eval_points(s.reference)) * s.reference.eval_iters * s.data.global_batch_size
    assert len(rows) == samples + len(eval_points(s.reference))
    assert (rows["expectation"] == "bitwise").all() and rows["bitwise_equal"].astype(bool).all()
    assert (rows["phase"] == "eval").all()


@pytest.mark.multirank
@pytest.mark.parametrize("name", LABELS)
def test_every_side_evaluates_the_validation_split_after_the_training_samples(eval_run, name):
    """Each evaluation reads the next global batches of the validation split, which starts after
    the last training sample; data rank d reads its micro-batch slice, as in training."""
    s = next(x for x in SCENARIOS if x.name == name)
    side, d = s.reference, s.data
    first_valid = side.steps * d.global_batch_size
    points = eval_points(side)
    for role in ("reference", "candidate", "golden"):
        t = _trace(eval_run, name, role)
        trained = {i for e in t.entries if e.kind == "input" for i in (e.sample_ids or ())}
        records = _eval_scalars(t, SAMPLE)
        assert [x["step"] for x in _eval_scalars(t, REPORTED) if x["rank"] == 0] == points, role
        for index in range(len(points)):
            read = sorted(i for x in records if x["eval"] == index and x["rank"] == min(t.coords())
                          for i in x["sample_ids"])
            if role == "golden":
                start = first_valid + index * side.eval_iters * d.global_batch_size
                assert read == list(range(start, start + side.eval_iters * d.global_batch_size))
            assert not set(read) & trained
        if role == "golden":
            continue  # one process, the whole batch in one forward
        ranked = getattr(s, role)
        mesh = Mesh.of_side(ranked)
        for x in records:  # every rank read its data rank's slice of the iteration's batch
            ids = eval_sample_ids(x["eval"], x["iteration"], ranked, d)
            m, mbs = x["micro_batch"], d.micro_batch_size
            at = (m * ranked.data_ranks + mesh.data_rank(x["rank"])) * mbs
            assert x["sample_ids"] == ids[at:at + mbs], (role, x)


@pytest.mark.multirank
def test_frontends_report_the_same_eval_losses_without_gtp(eval_run):
    """The harness's loop and Megatron-LM's evaluate alike: GTP off, every evaluation scalar is
    bitwise equal; GTP 2, every per-sample loss is, and only Megatron-LM's reported loss differs."""
    for role in ("reference", "candidate"):
        ours, theirs = (_trace(eval_run, name, role) for name in LABELS)
        assert ours.manifest["backend"] == "megatron" and theirs.manifest["backend"] == "mlm"
        for name in (SAMPLE, REPORTED):
            a, b = ([(x["step"], x["eval"], x["rank"], x.get("sample_ids"), x["value"])
                     for x in _eval_scalars(t, name)]
                    for t in (ours, theirs))
            assert a, (role, name)
            assert (a == b) == (role == "reference" or name == SAMPLE), (role, name)


@pytest.mark.multirank
def test_megatron_lm_eval_loss_on_the_wheel_averages_each_ranks_own_samples(eval_run):
    """megatron-core 0.19.2's evaluate() reduces over the replicate data-parallel group: at TP 1 x
    GTP 2 each rank reports the token mean over its own samples. Recomputed here from the
    per-sample losses in fp64, each reported value is within the rounding of its fp32
    computation ((n + 2) eps for n micro-batch terms) of its own rank's mean, and far from the
    whole batch's; the GTP-off reference reports the whole batch's."""
    s = summary(eval_run, "eval-mlm")
    assert s["verdict"] == "known-divergence"
    fd = s["first_divergence"]
    assert (fd["step"], fd["kind"], fd["tensor"], fd["signature"]) == (1, "eval", "eval_loss[eval 0]",
                                                                       "partial-average")
    assert fd["partial_average"] == {"averaged": {"0": [0], "1": [1]}, "data_ranks": 2}
    for role, own in (("candidate", True), ("reference", False)):
        t = _trace(eval_run, "eval-mlm", role)
        for rep in _eval_scalars(t, REPORTED):
            mine = [x for x in _eval_scalars(t, SAMPLE)
                    if x["eval"] == rep["eval"] and (x["rank"] == rep["rank"] or not own)]
            mean = math.fsum(x["value"] * x["tokens"] for x in mine) / math.fsum(x["tokens"] for x in mine)
            assert abs(rep["value"] - mean) <= (len(mine) + 2) * EPS32 * abs(mean), (role, rep)


@pytest.mark.multirank
def test_partial_average_names_the_subset_and_only_a_proper_one(eval_run):
    t = _trace(eval_run, "eval", "candidate")
    full = next(x["value"] for x in _eval_scalars(t, REPORTED) if x["eval"] == 0 and x["rank"] == 0)
    assert partial_average(t, 1, 0, {"0": full, "1": full}) is None  # the whole batch's mean: no subset
    own = [x for x in _eval_scalars(t, SAMPLE) if x["eval"] == 0 and x["rank"] == 1]
    mean1 = sum(x["value"] * x["tokens"] for x in own) / sum(x["tokens"] for x in own)
    assert partial_average(t, 1, 0, {"0": full, "1": mean1}) == {"averaged": {"1": [1]}, "data_ranks": 2}
    # no subset's mean: not a partial average
    assert partial_average(t, 1, 0, {"0": full * (1 + 1e-3)}) is None


@pytest.mark.multirank
@pytest.mark.parametrize("name", sorted(FAULT_SCENARIOS))
def test_eval_fault_localized(eval_run, name):
    s = summary(eval_run, name)
    fd, expect = s["first_divergence"], CATALOG[FAULT_SCENARIOS[name]].expect
    assert s["verdict"] == "fail"
    assert (fd["step"], fd["phase"], fd["kind"], fd["signature"]) == (
        expect["step"], expect["phase"], expect["kind"], expect["signature"]), fd
    assert fnmatch.fnmatchcase(fd["tensor"], expect["tensor"]), fd
    if FAULT_SCENARIOS[name] == "gtp-eval-stale-gather":  # the evaluation's GEMM of the target, every rank
        assert fd["consumed"] and {e["phase"] for e in fd["consumed"]} == {"eval"}
        assert {e["param"] for e in fd["consumed"]} == {CATALOG["gtp-eval-stale-gather"].target}
        train = results(eval_run, name)
        assert train[train["kind"] != "eval"]["passed"].astype(bool).all()  # training never reads it


def test_eval_points_follow_megatron_lm():
    side = EVAL.reference
    assert eval_points(side) == [*range(side.eval_interval, side.steps + 1, side.eval_interval), side.steps]
    for interval, steps, points in ((1, 2, [1, 2, 2]), (2, 3, [2, 3]), (5, 3, [3]), (0, 3, [])):
        assert eval_points(scenario.Side(eval_interval=interval, steps=steps)) == points


BASE = FAULTS.read_text().split("[matrix]")[0]  # the faults' scenario without its faults


MOCK = (("gtp = 1\n", 'gtp = 1\ndata = "mock"\n'), ("gtp = 2\n", 'gtp = 2\ndata = "mock"\n'))


@pytest.mark.parametrize("edits, says", [
    ((("eval_iters = 2\n", "eval_iters = 0\n"),), "eval_iters: must be >= 1"),
    ((("gtp = 2\n", "gtp = 2\neval_interval = 2\n"),), "every side must evaluate alike"),
    ((("gtp = 2\n", 'gtp = 2\nbackend = "torch"\n'),), "single-process golden side only"),
    ((('backend = "megatron"\n', 'backend = "mlm"\n'), *MOCK), "synthetic validation samples"),
    ((("gtp = 2\n", 'gtp = 2\nbackend = "mlm"\nargs = ["--eval-iters", "3"]\n'),),
     "--eval-iters is what the key [side].eval_iters sets: set eval_iters instead"),
    ((("gtp = 1\n", "gtp = 1\npipeline_parallel = 2\n"),), "without pipeline stages"),
    ((("eval_interval = 1\n", "eval_interval = 0\n"),
      ("gtp = 2\n", 'gtp = 2\ninject = ["gtp-eval-stale-gather"]\n')),
     "does not evaluate"),
])
def test_bad_eval_inputs_exit_2_before_launch(tmp_path, capsys, edits, says):
    text = BASE
    for old, new in edits:
        text = text.replace(old, new, 1)
    (tmp_path / "s.toml").write_text(text)
    with pytest.raises(BadInput, match=re.escape(says)):
        scenario.load(tmp_path / "s.toml")
    assert cli.main(["run", str(tmp_path / "s.toml"), "--out", str(tmp_path / "out")]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "out" / "traces").exists()


@pytest.mark.slow
def test_mlm_command_reads_its_evaluation_flags():
    """``gtp-parity mlm -- <flags>``: the side evaluates as the flags say (the golden with it); no
    iterations, no evaluation; eval batch sizes other than the training ones are refused."""
    from harness.backends.mlm.command import scenario_of
    from tests.test_mlm import SEED_FLAGS

    def with_eval(*flags):
        at = SEED_FLAGS.index("--eval-interval")
        return SEED_FLAGS[:at] + SEED_FLAGS[at + 4:] + list(flags)

    s = scenario_of(with_eval("--eval-interval", "2", "--eval-iters", "3"), 2)
    assert (s.reference.eval_interval, s.reference.eval_iters) == (2, 3) == (s.golden.eval_interval,
                                                                             s.golden.eval_iters)
    s = scenario_of(with_eval("--eval-iters", "2"), 2)  # no interval: Megatron-LM's final validation only
    assert eval_points(s.reference) == [s.reference.steps]
    assert scenario_of(with_eval("--eval-interval", "1", "--eval-iters", "0"), 2).reference.eval_interval == 0
    with pytest.raises(BadInput, match="--eval-global-batch-size"):
        scenario_of(with_eval("--eval-interval", "1", "--eval-iters", "1", "--eval-global-batch-size", "4"),
                    2)
