"""The mutation campaign: stable mutant identities, run-time application in a worker process
(installed files untouched), and an end-to-end campaign of a few mutants."""

import dataclasses
import hashlib
import json
import subprocess
import sys
import textwrap

import pytest

from harness.mutation import campaign
from harness.scenario.mutants import OPT_IN, TARGETS, Mutant, diff, mutants_of
from harness.scenario.schema import DataConfig, ModelConfig, Side
from tests.helpers import ROOT

TOY = '''
def mean_over_group(values, group_size, group=None, other_group=None):
    total = 0.0
    for v in values:
        total += v
    if group_size > 1:
        total = total / group_size
    reduce(total, group=group)
    return total[:2] if isinstance(total, list) else total


def reduce(x, group=None):
    return x
'''


def _toy(tmp_path, text=TOY, name="toy_gtp"):
    (tmp_path / f"{name}.py").write_text(text)
    sys.path.insert(0, str(tmp_path))
    try:
        return mutants_of(name, every_function=True)
    finally:
        sys.path.remove(str(tmp_path))


def test_operators_model_the_bug_classes(tmp_path):
    ms = _toy(tmp_path)
    got = {(m.operator, m.original, m.replacement) for m in ms}
    assert ("constant", "total / group_size", "total") in got  # 1/G -> 1
    assert ("constant", "total / group_size", "total / (group_size + 1)") in got
    assert ("compare", "group_size > 1", "group_size <= 1") in got
    assert ("arith", "total += v", "total -= v") in got
    assert ("remove-call", "reduce(total, group=group)", "pass") in got
    assert ("branch", "group_size > 1", "False") in got
    assert ("slice", "2", "(2 + 1)") in got
    assert len({m.id for m in ms}) == len(ms)


def test_identity_survives_regeneration_and_edits_elsewhere(tmp_path):
    first = {m.id: m for m in _toy(tmp_path)}
    shifted = {m.id: m for m in _toy(tmp_path, "# a new first line\n\n" + TOY)}
    assert set(first) == set(shifted)
    assert all(shifted[i].line == first[i].line + 2 for i in first)


def test_a_checkpoint_stage_runs_the_mutant_where_it_saves_and_where_it_loads(tmp_path, monkeypatch):
    """In a checkpoint scenario the saving side runs the mutant too (GTP's checkpoint code runs
    there), launched before the loader; a saver that crashes leaves its loader unlaunched."""
    from types import SimpleNamespace

    from harness import scenario

    (ckpt,) = [s for s in scenario.load(ROOT / "scenarios" / "mutate.toml") if s.saver is not None]
    ms = [Mutant(id=mid, module="m", file="f", function="f", operator="branch", line=1, end_line=1, start=0,
                 end=1, original="a", replacement="b") for mid in ("x-save-crash", "x-survives")]
    clean = {ckpt.name: {"candidate": SimpleNamespace(provenance={"digest": "0" * 12})}}
    launched = []

    def run_jobs(jobs, *a, **k):
        launched.append(sorted((j.side.mutant, bool(j.side.save_step)) for j in jobs))
        return {j.key: "crashed" for j in jobs if j.side.mutant == "x-save-crash" and j.side.save_step}

    monkeypatch.setattr(campaign, "run_clean", lambda *a: clean)
    monkeypatch.setattr(campaign, "clean_lines", lambda roles: None)
    monkeypatch.setattr(campaign, "run_mutant_jobs", run_jobs)
    monkeypatch.setattr(campaign, "_verdict", lambda s, by_s, failed, out, clean: None if any(
        j.key in failed for j in campaign.mutant_jobs(by_s[s.name]))
            else {"scenario": s.name, "verdict": "pass"})
    monkeypatch.setattr(campaign, "reached", lambda trace_dir: True)
    doc = campaign.run_campaign(ms, [ckpt], tmp_path, timeout_s=90, per_launch=12, triage={},
                                say=lambda *a: None, warm=False)
    assert launched == [[("x-save-crash", True), ("x-survives", True)], [("x-survives", False)]]
    assert [m["status"] for m in doc["mutants"]] == ["crashed", "survived"]


@pytest.mark.slow
def test_every_target_has_mutants():
    for module in (*TARGETS, *OPT_IN):
        ms = mutants_of(module, validate=False)
        assert ms, module
        assert len({m.id for m in ms}) == len(ms), module


def test_a_mutant_gets_its_own_side_key():
    model, data = ModelConfig(), DataConfig()
    clean = Side(gtp=2)
    keys = {clean.key(model, data), Side(gtp=2, mutant="a-1").key(model, data),
            Side(gtp=2, mutant="a-2").key(model, data)}
    assert len(keys) == 3


@pytest.mark.slow
def test_a_mutant_is_applied_in_a_worker_process_and_undone(tmp_path):
    (tmp_path / "toy_gtp.py").write_text(TOY)
    before = hashlib.sha256((tmp_path / "toy_gtp.py").read_bytes()).hexdigest()
    m = next(m for m in _toy(tmp_path) if m.replacement == "total" and m.operator == "constant")
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(tmp_path)!r})
        from harness.backends.faults.mutant import apply
        from harness.scenario.mutants import Mutant
        from harness.backends.patching import undo_all
        from toy_gtp import mean_over_group as imported_before
        apply(Mutant(**json.loads({json.dumps(json.dumps(m.to_json()))})))
        import toy_gtp
        mutated = (toy_gtp.mean_over_group([1.0, 2.0, 3.0], 2), imported_before([1.0, 2.0, 3.0], 2))
        undo_all()
        print(json.dumps([*mutated, toy_gtp.mean_over_group([1.0, 2.0, 3.0], 2)]))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    # The sum over the group without the 1/G: every reference to the function sees it.
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [6.0, 6.0, 3.0]
    assert hashlib.sha256((tmp_path / "toy_gtp.py").read_bytes()).hexdigest() == before
    assert "-        total = total / group_size" in diff(m) and "+        total = total" in diff(m)


def test_score_counts_crashes_apart_and_leaves_out_equivalents():
    def o(status, op="arith", localized=None):
        m = Mutant(id=f"x-{status}-{op}", module="m", file="f", function="f", operator=op, line=1,
                   end_line=1, start=0, end=1, original="a", replacement="b")
        return campaign.Outcome(m, status=status, localized=localized)
    s = campaign.score([o("killed", localized=True), o("killed", localized=False), o("crashed"),
                        o("timeout"), o("survived"), o("equivalent")])
    assert s["overall"]["score"] == 4 / 5
    assert (s["overall"]["crashed"], s["overall"]["timeout"]) == (1, 1)
    assert s["localization"] == {"killed": 2, "localized": 1, "accuracy": 0.5}


@pytest.mark.multirank
def test_campaign_end_to_end(tmp_path):
    """Two mutants of GTP's wgrad pre-scale: 1/G -> 1 is killed at the GTP weights' main_grad
    (ratio-G), a forced-off branch of the pad handling is run and judged; a mutant of GTP's
    checkpoint code, which a run without a checkpoint never runs, is not launched (the clean
    candidate's recorded lines say so) and is unreachable; the page, the JSON and --show come out."""
    from harness import scenario
    from harness.mutation import page
    from harness.mutation.command import show

    module = "megatron.core.tensor_parallel.generalized_tensor_parallelism"
    ms = mutants_of(module)
    prescale = next(m for m in ms if m.function == "GTPShardedParam._prescale_wgrads_for_mean_rs"
                    and m.operator == "constant" and m.replacement == "1.0")
    other = next(m for m in ms if m.function == "GTPShardedParam._reduce_scatter" and m.operator == "arith"
                 and "_debug_name" in m.original)
    unreached = next(m for m in ms if m.function.endswith("for_checkpoint_with_gtp_remat"))
    scenarios = scenario.load(ROOT / "scenarios" / "mutate.toml")[:1]  # the 2-rank scenario
    doc = campaign.run_campaign([prescale, other, unreached], scenarios, tmp_path, timeout_s=90,
                                per_launch=12, triage={}, say=lambda *a: None)
    by_id = {m["id"]: m for m in doc["mutants"]}
    killed = by_id[prescale.id]
    assert killed["status"] == "killed" and killed["localized"], killed
    assert killed["first_divergence"]["kind"] == "main_grad"
    assert killed["first_divergence"]["signature"] == "ratio-G"
    assert by_id[other.id]["status"] in ("killed", "crashed", "survived")
    assert by_id[unreached.id]["status"] == "unreachable" and by_id[unreached.id]["verdicts"] == {}
    assert doc["stages"][0]["lines_recorded"] and doc["timing"]["mutant_sides"] == 2
    html = page.write(doc, tmp_path).read_text()
    assert prescale.id in html and "<script" not in html.lower()
    assert f"<td>{scenarios[0].name}</td><td>3</td><td>2</td>" in html  # the stage: 3 undetected, 2 run
    assert "&quot;" in html or "&#x27;" in html  # quoted source text is escaped
    assert json.loads((tmp_path / "mutants.json").read_text())["score"]["overall"]["total"] == 3
    assert show(tmp_path, prescale.id) == 0


def test_a_detected_mutant_does_not_run_the_later_scenarios(tmp_path, monkeypatch):
    """The matrix runs in stages: a mutant killed (or crashed) by the first scenario is not
    launched on the second; a survivor runs both and is judged over both. A mutant whose line the
    clean sides of a scenario never ran is not launched there; one no scenario's clean sides
    reach is unreachable without a launch."""
    from types import SimpleNamespace

    from harness import scenario

    scenarios = scenario.load(ROOT / "scenarios" / "mutate.toml")
    assert len(scenarios) >= 2

    def mutant(mid, line=1):
        return Mutant(id=mid, module="m", file="f", function="f", operator="branch", line=line, end_line=line,
                      start=0, end=1, original="a", replacement="b")

    ms = [mutant("x-killed"), mutant("x-crashed"), mutant("x-survives"), mutant("x-second-only", 2),
          mutant("x-nowhere", 3), mutant("x-equivalent", 3)]
    clean = {s.name: {"candidate": SimpleNamespace(provenance={"digest": "0" * 12})} for s in scenarios}
    lines = {id(clean[scenarios[0].name]): {"m": {1, 9}}, id(clean[scenarios[1].name]): {"m": {1, 2}}}
    launched = []

    def run_jobs(jobs, *a, **k):
        launched.append(sorted(j.side.mutant for j in jobs))
        return {j.key: "crashed" for j in jobs if j.side.mutant == "x-crashed"}

    def verdict(s, by_s, failed, out, clean):
        if by_s[s.name]["candidate"].key in failed:
            return None
        return {"scenario": s.name, "verdict": "fail" if s.candidate.mutant == "x-killed" else "pass"}

    monkeypatch.setattr(campaign, "run_clean", lambda *a: clean)
    monkeypatch.setattr(campaign, "clean_lines", lambda roles: lines.get(id(roles)))
    monkeypatch.setattr(campaign, "run_mutant_jobs", run_jobs)
    monkeypatch.setattr(campaign, "_verdict", verdict)
    monkeypatch.setattr(campaign, "reached", lambda trace_dir: True)
    triage = {"x-equivalent": {"status": "equivalent", "reason": "f: changes nothing"}}
    doc = campaign.run_campaign(ms, scenarios[:2], tmp_path, timeout_s=90, per_launch=12, triage=triage,
                                say=lambda *a: None, warm=False)
    assert launched == [["x-crashed", "x-killed", "x-survives"], ["x-second-only", "x-survives"]]
    by_id = {m["id"]: m for m in doc["mutants"]}
    statuses = [by_id[m.id]["status"] for m in ms]
    # one triaged equivalent is so whether or not a scenario reaches it (out of the denominator)
    assert statuses == ["killed", "crashed", "survived", "survived", "unreachable", "equivalent"]
    assert len(by_id["x-survives"]["verdicts"]) == 2 and len(by_id["x-killed"]["verdicts"]) == 1
    assert by_id["x-nowhere"]["verdicts"] == {} and scenarios[1].name in by_id["x-nowhere"]["reason"]
    assert [(st["alive"], st["ran"]) for st in doc["stages"]] == [(6, 3), (4, 2)]
    assert doc["timing"]["mutant_sides"] == 5


def test_lines_record_what_ran_and_decide_which_mutants_can_differ(tmp_path):
    """A clean side's recorder names the lines of a module that ran (each recorder afresh: the
    locations one disabled fire again for the next); a mutant whose span none of them holds
    cannot change the side; :func:`campaign.clean_lines` joins the ranks' records."""
    import sys as _sys
    from types import SimpleNamespace

    from harness.backends.faults.mutant import Lines

    ms = _toy(tmp_path)
    sys.path.insert(0, str(tmp_path))
    try:
        import toy_gtp

        seen = []
        for group_size in (1, 2):
            rank = tmp_path / f"t{group_size}" / "rank0"
            rank.mkdir(parents=True)
            rec = Lines(("toy_gtp",))
            toy_gtp.mean_over_group([1.0, 2.0], group_size)
            rec.close(rank / "lines.json")
            seen.append(campaign.clean_lines({"candidate": SimpleNamespace(trace_dir=str(rank.parent))}))
    finally:
        sys.path.remove(str(tmp_path))
        _sys.modules.pop("toy_gtp", None)
    if seen[0] is None:
        pytest.skip("another tool holds sys.monitoring's coverage id (a coverage run): lines not recorded")
    divide = next(m for m in ms if m.replacement == "total" and m.operator == "constant")
    loop = next(m for m in ms if m.operator == "arith" and "+=" in m.original)
    assert not campaign.can_differ(divide, seen[0]) and campaign.can_differ(divide, seen[1])
    assert campaign.can_differ(loop, seen[0]) and campaign.can_differ(loop, seen[1])  # fires again
    assert campaign.can_differ(divide, None)  # not recorded: run it
    assert campaign.can_differ(dataclasses.replace(divide, module="other"), seen[0])  # nor its module
    assert campaign.clean_lines({"candidate": SimpleNamespace(trace_dir=str(tmp_path / "none"))}) is None


@pytest.mark.slow
def test_the_triage_names_mutants_of_the_installed_source():
    """Every triaged survivor is a mutant the installed megatron-core still generates (identities
    survive regeneration), with a status the score knows and a reason naming its function."""
    from harness.mutation.command import TRIAGE

    triage = campaign.read_triage(TRIAGE)
    assert triage
    generated = {m.id: m for module in (*TARGETS, *OPT_IN) for m in mutants_of(module, validate=False)}
    for mid, entry in triage.items():
        assert mid in generated, f"{mid}: no such mutant (megatron-core changed?)"
        assert entry["status"] in (campaign.EQUIVALENT, campaign.UNREACHABLE)
        assert generated[mid].function.rsplit(".", 1)[-1] in entry["reason"], (mid, entry["reason"])


def test_bad_mutate_arguments_exit_2(tmp_path, capsys):
    from harness.cli import main

    assert main(["mutate", "--target", "megatron.core.models", "--out", str(tmp_path)]) == 2
    assert "--target" in capsys.readouterr().err
    assert main(["mutate", "--show", "nope", "--out", str(tmp_path)]) == 2  # no campaign there


def test_a_mutant_runs_on_a_megatron_reference_or_candidate_only():
    import dataclasses

    from harness import scenario
    from harness.common.errors import BadInput
    from harness.scenario.rules import validate

    s = scenario.load(ROOT / "scenarios" / "mutate.toml")[0]
    validate(dataclasses.replace(s, candidate=dataclasses.replace(s.candidate, mutant="x")), limits=False)
    with pytest.raises(BadInput, match=r"\[golden\]\.mutant"):
        validate(dataclasses.replace(s, golden=dataclasses.replace(s.golden, mutant="x")), limits=False)
