"""``gtp-parity fuzz`` (harness/fuzz): the space read from the declarations, draws the rules accept
and a seed repeats, resumption, nodes, bad input (shrinking and clusters: test_fuzz_shrink.py);
and two campaigns on real code: a planted fault found and shrunk under a bounded budget, and no
finding where both sides run the same code."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli import main
from harness.cli.fuzz import duration
from harness.common.errors import BadInput
from harness.fuzz.campaign import Runner, Settings, State, _load_state
from harness.fuzz import page
from harness.fuzz.reach import reach_seeds, seed_label
from harness.fuzz.shrink import Shrunk
from harness.fuzz.space import Axis, Coverage, Draw, draw_for, load_space
from harness.scenario import load, parse_scenario
from harness.scenario.options import declared
from harness.scenario.schema import DataConfig, ModelConfig, Side
from tests.test_fuzz_shrink import _fd

ROOT = Path(__file__).resolve().parents[1]
SPACE = ROOT / "scenarios" / "fuzz" / "space.toml"
CLASSES = {"model": ModelConfig, "data": DataConfig, "train": Side}


def _draws(space, seed: int, n: int) -> list[Draw]:
    runner, coverage, out = Runner(Settings(seed=seed, space=space), Path(".")), Coverage(), []
    for i in range(n):
        d, _ = draw_for(space, seed, i, coverage, runner.refusal)
        coverage.add(d)
        out.append(d)
    return out


def test_the_space_is_the_declarations():
    space = load_space(str(SPACE))
    for (section, key), values in space.values.items():
        if section == "checkpoint":  # the space file's checkpoint pairs, not a declared key
            continue
        o = declared(CLASSES[section])[key]
        assert o.group not in ("backend", "checkpoint", "self-test") and "megatron" in o.backends
        if o.choices is not None and key != "precision":
            assert set(values) == set(o.choices), key  # every declared choice is drawn
    assert ("train", "recipe") not in space.values  # excluded by the space file
    assert {a.key for a in space.axes} >= {"gtp", "tp", "distributed_optimizer", "gtp_weight_prefetch"}
    for a in space.axes:  # topology and code paths: the two sides must train the same model
        o = declared(Side)[a.key]
        assert a.key in ("gtp", "tp", "ep", "expert_gtp") or o.group in ("topology", "code paths")
    assert not {a.key for a in space.axes} & {"grad_reduce_in_fp32", "muon_tp_mode", "precision"}


def test_draws_pass_the_rules_and_a_seed_repeats_them():
    space = load_space(str(SPACE))
    first, again, other = _draws(space, 7, 6), _draws(space, 7, 6), _draws(space, 8, 6)
    assert first == again and first != other
    for i, d in enumerate(first):  # every draw parses: the rules of validate accepted it
        s = parse_scenario(d.document(space, f"d{i}"), "test")
        assert getattr(s.reference, d.axis.key) != getattr(s.candidate,
                                                           d.axis.key) or d.axis.reference is None
        assert len(d.settings) <= space.max_off_default


def test_a_planted_faults_reach_aims_the_draws(tmp_path):
    """``distopt-offsets-ignore-gtp-pad`` fires only with the distributed optimizer in bf16 under
    GTP: random draws of the default space (a few of some 44 keys) do not hold all three, so a
    self-test campaign starts every draw from the fewest settings that do."""
    space = dataclasses.replace(load_space(str(SPACE)), candidates=4)
    fault = "distopt-offsets-ignore-gtp-pad"
    assert reach_seeds(space, ("gtp-rs-no-prescale",)) == []  # the GTP axis reaches it on defaults
    seeds = reach_seeds(space, (fault,))
    needs = {("train", "distributed_optimizer", True), ("train", "precision", "bf16"), ("train", "gtp", 2)}
    for settings, axis in seeds:  # two settings and the axis: the three needs, nothing else
        assert len(settings) == 2 and set(settings) | {("train", axis.key, axis.candidate)} == needs
    runner, coverage = Runner(Settings(seed=0, space=space, inject=(fault,)), Path(".")), Coverage()
    assert draw_for(space, 0, 0, coverage, runner.refusal)[0] is None  # unaimed: every draw refused
    for i in range(3):
        d, _ = draw_for(space, 0, i, coverage, runner.refusal, seeds)
        coverage.add(d)
        s = runner.scenario(d, f"d{i}")  # the rules accept it, the fault on the candidate
        assert s.candidate.distributed_optimizer and s.candidate.precision == "bf16" and s.candidate.gtp > 1
    # the campaign's page says its draws were aimed, and from what
    state = State(identity=runner.settings.identity(), aimed=[seed_label(s) for s in seeds])
    html = page.write(state.to_json(runner.settings, coverage), tmp_path / "index.html").read_text()
    assert "Draws aimed at the planted faults' reach" in html and "train.precision=bf16" in html
    # A fault of a checkpoint's save needs what the saving reference holds (GTP's padded shards):
    # every seed saves a checkpoint from a GTP run, and an aimed draw's saver is one.
    fault = "ckpt-pad-rows-as-data"
    seeds = reach_seeds(space, (fault,))
    assert seeds and all({("checkpoint", "save_step", 1), ("train", "gtp", 2)} <= set(st) for st, _ in seeds)
    runner = Runner(Settings(seed=0, space=space, inject=(fault,)), Path("."))
    d, _ = draw_for(space, 0, 0, Coverage(), runner.refusal, seeds)
    s = runner.scenario(d, "c0")  # the rules accept it: the fault planted where the candidate resumes
    assert s.saver.gtp > 1 and s.candidate.load_step == 1 and s.candidate.inject == (fault,)


def test_a_checkpoint_draw_the_tree_cannot_load_is_refused_not_run():
    """The loader's optimizer chain depends on the tree (checked before a run): a draw saved at EP 2
    without expert GTP and loaded with it is refused on the wheel, as a run would refuse it, instead
    of ending the campaign when its batch is run."""
    space = load_space(str(SPACE))
    runner = Runner(Settings(seed=0, space=space), Path("."))
    draw = Draw(settings=(("checkpoint", "save_step", 1), ("model", "num_experts", 4), ("train", "ep", 2)),
                world_size=4, axis=Axis("expert_gtp", 1, 2))
    assert "another optimizer chain" in runner.refusal(draw)
    assert runner.refusal(dataclasses.replace(draw, axis=Axis("expert_gtp", 1, 1))) is None
    # tree-independent: the distributed optimizer cannot load the local optimizer's checkpoint
    distopt = Draw(settings=(("checkpoint", "save_step", 1),), world_size=2,
                   axis=Axis("distributed_optimizer", False, True))
    assert "checkpoint of the local optimizer" in runner.refusal(distopt)


def test_an_expert_grid_the_world_cannot_hold_is_refused():
    """megatron-core's expert grid is ETP x EP x PP x EGTP (initialize_model_parallel raised on a
    draw at world 2 with PP 2 and expert GTP 2, which the rules had let through)."""
    runner = Runner(Settings(seed=0, space=load_space(str(SPACE))), Path("."))
    draw = Draw(settings=(("model", "num_experts", 4), ("train", "expert_gtp", 2)), world_size=2,
                axis=Axis("pipeline_parallel", 1, 2))
    assert "expert TP x EP x PP x EGTP = 4" in runner.refusal(draw)
    assert runner.refusal(dataclasses.replace(draw, world_size=4)) is None


def test_a_pair_the_harness_cannot_judge_is_a_failed_run_not_the_campaigns_end(tmp_path, monkeypatch):
    """A comparison that raises (main's seed-2 campaign: a trace assembly error) ends that pair as a
    failed run of the harness; the batch's other pairs are judged alone."""
    from harness.common.errors import BadInput
    from harness.compare.summary import Verdict
    from harness.fuzz import runner as runner_module

    calls = []

    def run_scenarios(scenarios, folder, **kw):
        calls.append([s.name for s in scenarios])
        raise BadInput("trace", "no shard for mesh coordinate")

    monkeypatch.setattr(runner_module, "run_scenarios", run_scenarios)
    runner = Runner(Settings(seed=0, space=load_space(str(SPACE)), warm=False), tmp_path)
    draws = [Draw(settings=(), world_size=2, axis=Axis("gtp", 1, 2))] * 2
    out = runner.judge(draws, ["p0", "p1"])
    assert calls == [["p0", "p1"], ["p0"], ["p1"]]
    assert [s.verdict for s in out] == [Verdict.ERROR] * 2 and "no shard" in out[0].error["harness"]


def test_coverage_prefers_what_is_not_covered_yet():
    space = load_space(str(SPACE))
    coverage = Coverage()
    d = _draws(space, 3, 1)[0]
    assert coverage.new_in(d) > 0
    coverage.add(d)
    assert coverage.new_in(d) == 0  # the same draw covers nothing new


@pytest.mark.parametrize("text,problem", [
    ("bogus = 1", "unknown key"),
    ("[values.train]\ntp = [1, 0]", "values.train.tp"),
    ("[values.model]\nnot_a_key = [1, 2]", "no such key"),
    ('axes = ["nothing"]', "no axis"),
    ('backend = "mlm"', "megatron or torch"),
])
def test_a_bad_space_is_refused_naming_what(tmp_path, capsys, text, problem):
    path = tmp_path / "space.toml"
    path.write_text(text)
    assert main(["fuzz", "--space", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert problem in err and str(path) in err
    assert not (tmp_path / "out" / "fuzz.json").exists()


def test_a_campaign_resumes_only_as_itself(tmp_path):
    space = load_space(str(SPACE))
    (tmp_path / "fuzz.json").write_text(json.dumps({"identity": Settings(seed=1, space=space).identity()}))
    with pytest.raises(BadInput, match="another seed"):
        _load_state(tmp_path, Settings(seed=2, space=space))
    (tmp_path / "fuzz.json").write_text("{not json")
    with pytest.raises(BadInput, match="not a campaign"):
        _load_state(tmp_path, Settings(seed=2, space=space))


def test_a_folder_holds_one_running_campaign_at_a_time(tmp_path, capsys):
    from harness.fuzz.campaign import only_campaign

    with only_campaign(tmp_path):  # as a campaign running in it holds it
        code = main(["fuzz", "--pairs", "1", "--out", str(tmp_path)])
    assert code == 2 and f"another campaign is running in this folder (process {os.getpid()})" in \
        capsys.readouterr().err
    assert not (tmp_path / "fuzz.json").exists()
    with only_campaign(tmp_path):  # the lock went with its holder
        pass


def test_durations():
    assert [duration(t) for t in ("90", "90s", "45m", "1.5h")] == [90, 90, 2700, 5400]
    for bad in ("0", "5d", "-1m", "m"):
        with pytest.raises(Exception):
            duration(bad)


# --- campaigns on real code (one launch set each) ----------------------------------------------

FAULT = "gtp-rs-no-prescale"


def _campaign(tmp_path: Path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "campaign"
    proc = subprocess.run([sys.executable, "-m", "harness", "fuzz", "--out", str(out), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    # the warm workers (harness.run.warm) ended with the campaign: no process names its folder
    left = subprocess.run(["pgrep", "-af", str(out)], capture_output=True, text=True).stdout.strip()
    assert not left, left
    return proc.returncode, json.loads((out / "fuzz.json").read_text())


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("fault, needs", [
    (FAULT, ["axis:gtp=1->2"]),  # GTP alone: every drawn setting is removed
    # a bias beside a GTP weight: no draw of the space's defaults holds one, so the draws are
    # aimed at the fault's reach (harness.fuzz.reach) and shrinking keeps the bias
    ("gtp-bias-grad-unreduced", ["axis:gtp=1->2", "model.add_bias_linear=true"]),
])
def test_a_planted_fault_is_found_and_shrunk(tmp_path, fault, needs):
    space = tmp_path / "space.toml"
    space.write_text(SPACE.read_text().replace("world_size = [2, 4]", "world_size = [2]")
                     .replace("max_off_default = 4", "max_off_default = 2\naxes = [\"gtp\"]"))
    code, doc = _campaign(tmp_path, "--space", str(space), "--inject", fault, "--pairs", "3", "--batch", "3",
                          "--seed", "5", "--shrink-budget", "8m")
    from harness.scenario.faults import CATALOG

    expect = CATALOG[fault].expect
    assert code == 1 and doc["clusters"], doc["judged"]
    assert bool(doc.get("aimed")) == (len(needs) > 1), doc.get("aimed")
    c = doc["clusters"][0]
    assert c["fingerprint"] == [expect["signature"], expect["kind"]]
    assert c["needs"] == needs
    assert c["shrink"]["complete"]
    # the batch and the shrink's runs went to one warm worker of world 2, plan after plan
    (worker,) = (tmp_path / "campaign" / "warm").glob("w2-*")
    assert (worker / "done-0002.json").is_file()
    minimal = load(tmp_path / "campaign" / c["scenario_file"])[0]  # ships as a scenario that parses
    assert minimal.candidate.inject == (fault,) and minimal.expect.signature == expect["signature"]


def test_passing_pairs_become_a_matrix_of_stages(tmp_path):
    from harness.fuzz.campaign import State, _write_stages

    space = load_space(str(SPACE))
    draws = _draws(space, 4, 3)
    judged = [{"name": f"fuzz-4-{i:05d}", "draw": d.to_json(), "verdict": v}
              for i, (d, v) in enumerate(zip(draws, ("pass", "fail", "pass")))]
    _write_stages(State(identity={}, judged=judged), Settings(seed=4, space=space), tmp_path)
    stages = load(tmp_path / "stages.toml")  # a matrix the mutation campaign can take (--matrix)
    assert [s.name for s in stages] == ["fuzz-4-00000", "fuzz-4-00002"]
    alone = parse_scenario(draws[2].document(space, "fuzz-4-00002"), stages[1].source)
    assert (stages[1].model, stages[1].data, stages[1].sides) == (alone.model, alone.data, alone.sides)


def test_failed_runs_are_grouped_by_what_failed():
    from harness.fuzz.campaign import run_errors

    msg = ("launch w2-0 (world 2) failed (exit 1); side megatron-w2-tp1-gtp2-fp32: rank {} raised at step 1: "
           "AssertionError: expert GTP needs whole experts; log: /x/launch-w2-0.log")
    judged = [{"name": f"p{i}", "verdict": v, "error": {"candidate": msg.format(i)} if v == "error" else None}
              for i, v in enumerate(("error", "pass", "error"))]
    assert run_errors(judged) == {"AssertionError: expert GTP needs whole experts": ["p0", "p2"]}


@pytest.mark.multirank
@pytest.mark.slow
def test_nothing_is_found_where_both_sides_run_the_same_code(tmp_path):
    # The torch backend's GPT on both sides, GTP or TP apart: the fuzzer's verdicts, expectations
    # and signatures raise no false alarm over the drawn architectures.
    clean = ROOT / "scenarios" / "fuzz" / "clean.toml"
    code, doc = _campaign(tmp_path, "--space", str(clean), "--pairs", "8", "--batch", "8", "--seed", "3")
    assert code == 0 and not doc["clusters"] and not doc["errors"], (doc["clusters"], doc["errors"])
    assert len(doc["judged"]) == 8 and all(j["verdict"] == "pass" for j in doc["judged"])
    reached = set().union(*(Draw.from_json(j["draw"]).items() for j in doc["judged"]))
    assert doc["coverage"]["values"] == len(reached)  # the coverage counted is what the pairs hold


# --- a campaign spread over nodes --------------------------------------------------------------


def _fake_judge(fails: set[int]):
    """Runner.judge without launching: pairs whose index is in ``fails`` fail with one signature."""
    from types import SimpleNamespace

    from harness.compare.summary import Verdict

    def judge(self, draws, names=None):
        out = []
        for name in names or [None] * len(draws):
            failing = name is not None and int(name.rsplit("-", 1)[1]) in fails
            fd = _fd("replica-drift", "main_grad") if failing else None
            out.append(SimpleNamespace(verdict=Verdict.FAIL if failing else Verdict.PASS, error=None,
                                       first_divergence=fd))
        return out

    return judge


def test_nodes_judge_the_draws_one_node_would_and_merge_into_one_campaign(tmp_path, monkeypatch):
    from harness.fuzz import campaign
    from harness.fuzz.merge import merge

    space = dataclasses.replace(load_space(str(SPACE)), candidates=3)  # each draw validates 3, not 24
    monkeypatch.setattr(campaign.Runner, "judge", _fake_judge({2, 3}))
    # every failing pair's shrink ends at once and keeps the draw: one cluster per node that saw one
    monkeypatch.setattr(campaign, "shrink", lambda d, fd, sp, fds, deadline: Shrunk(d, fd, 0, 0.0, True))
    alone = campaign.run(Settings(seed=7, space=space, max_pairs=4, batch=2), tmp_path / "one", say=str)
    folders = [tmp_path / f"node-{i}" for i in range(2)]
    for i, folder in enumerate(folders):
        s = Settings(seed=7, space=space, max_pairs=2, batch=2, node=i, nodes=2)
        doc = campaign.run(s, folder, say=str)
        assert [j["index"] % 2 for j in doc["judged"]] == [i] * 2
    merged = merge(folders, Settings(seed=7, space=space), tmp_path / "merged")
    pairs = [[(j["index"], j["draw"]) for j in doc["judged"]] for doc in (merged, alone)]
    assert pairs[0] == pairs[1]
    assert merged["coverage"] == alone["coverage"] and merged["identity"]["nodes"] == 2
    # the shrink stub keeps each failing draw whole: two clusters, numbered as one node numbered them
    assert len(alone["clusters"]) == 2
    assert [(c["id"], c["members"]) for c in merged["clusters"]] == [(c["id"], c["members"])
                                                                     for c in alone["clusters"]]
    assert [j["cluster"] for j in merged["judged"]] == [j["cluster"] for j in alone["judged"]]
    for c in merged["clusters"]:
        assert (tmp_path / "merged" / c["scenario_file"]).is_file()
    with pytest.raises(BadInput, match="every node of one campaign once"):
        merge(folders[:1], Settings(seed=7, space=space), tmp_path / "half")
    with pytest.raises(BadInput, match="another seed"):
        merge(folders, Settings(seed=8, space=space), tmp_path / "other")


@pytest.mark.parametrize(("args", "said"), [
    (["--node", "2/2"], "0 <= I < N"),
    (["--merge", "nowhere"], "holds no fuzz.json"),
    (["--node", "0/2", "--merge", "nowhere"], "without --node"),
])
def test_a_bad_node_share_or_merge_is_refused(tmp_path, capsys, args, said):
    try:
        code = main(["fuzz", "--out", str(tmp_path / "o"), *args])
    except SystemExit as e:  # argparse's own refusal
        code = e.code
    assert code == 2 and said in capsys.readouterr().err


def test_a_checkpoint_pair_saves_on_the_reference_and_loads_into_the_candidates_topology(tmp_path):
    from harness.fuzz.space import CHECKPOINT

    space = load_space(str(SPACE))
    assert space.values[CHECKPOINT] == (0, 1)  # scenarios/fuzz/space.toml: checkpoint_steps = [1]
    draw = Draw(settings=(("checkpoint", "save_step", 1),), world_size=2, axis=Axis("gtp", 1, 2))
    assert "checkpoint.save_step=1" in draw.items()  # coverage and needs name it as a key
    s = Runner(Settings(seed=1, space=space), tmp_path).scenario(draw, "fuzz-1-00000")
    assert s.name == "fuzz-1-00000"  # the pair's name: its summary is read back by it
    assert (s.saver.save_step, s.saver.gtp) == (1, 1)
    resumed = (s.candidate.load_step, s.candidate.gtp, s.candidate.resume_from)
    assert resumed == (1, 2, s.saver.key(s.model, s.data))
    bad = tmp_path / "bad.toml"
    bad.write_text(SPACE.read_text().replace("checkpoint_steps = [1]", "checkpoint_steps = [0]"))
    with pytest.raises(BadInput, match="checkpoint_steps"):
        load_space(str(bad))
