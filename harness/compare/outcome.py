"""One scenario's outcome: compare its traces, judge its expectation, write its files.

``steps.csv|json`` (per-step scalars), ``rank_losses.csv``, ``results.csv`` (one row per
compared step x kind x tensor) and ``summary.json`` (a :class:`ScenarioSummary`) in the
scenario's folder.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from harness.capture import trace
from harness.common.jsonio import write_json
from harness.compare import split, steps
from harness.compare.judge import compare
from harness.compare.summary import FirstDivergence, ScenarioSummary, Verdict
from harness.run.trees import CodeTree, is_ancestor
from harness.run.provenance import differences
from harness.scenario import ComparePolicy, KnownDivergence, Role, Scenario
from harness.scenario.checkpoint import topology
from harness.scenario.tree_specs import code_axes
from harness.scenario.rules import version_key


def scenario_config(s: Scenario) -> dict:
    """The summary's ``config``: where the scenario came from and what each side ran."""
    config = {"source": s.source, "description": s.description,
              **{r: side.label() for r, side in s.sides.items()},
              "paths": {r: side.paths() for r, side in s.sides.items() if side.paths()}}
    if code := code_axes(s):  # which megatron-core each side ran, where not the installed one
        config["code"] = code
    return config


def holds_fix(expect: KnownDivergence, tree: dict | None, version: str | None) -> bool:
    """Whether the candidate's megatron-core holds the expectation's upstream fix: its commit
    is in the tree's history, or (a tree without a commit) its version is the fix's or later."""
    if expect.fixed_in and tree and tree.get("commit"):
        found = is_ancestor(CodeTree(**tree), expect.fixed_in)
        if found is not None:
            return found
    if expect.fixed_in_version and version and version_key(version) is not None:
        return version_key(version) >= version_key(expect.fixed_in_version)
    return False


def holds_commit(commit: str | None, tree: dict | None) -> bool:
    """Whether the candidate's tree has ``commit`` in its history (a tree without a commit, the
    installed wheel, holds none)."""
    if commit and tree and tree.get("commit"):
        return bool(is_ancestor(CodeTree(**tree), commit))
    return False


def judge_known_divergence(summary: ScenarioSummary, expect: KnownDivergence | None,
                      fixed: bool = False, introduced: bool = True) -> ScenarioSummary:
    """A failure that matches the scenario's known divergence becomes ``known-divergence``;
    a scenario that was expected to diverge and holds, or diverges otherwise, fails. ``fixed``:
    the candidate's tree holds the upstream fix, so parity is what is expected there (or, with
    ``diverges_after_fix``, that other signature). ``introduced``: the tree holds the commit
    that introduced the divergence (``introduced_in``); where it does not, parity is expected."""
    if expect is None:
        return summary
    optional = ("fixed_in", "fixed_in_version", "diverges_after_fix", "introduced_in")
    summary = summary.with_(expect={k: v for k, v in dataclasses.asdict(expect).items()
                                    if v is not None or k not in optional})
    if not introduced:
        held = "parity holds" if summary.verdict == Verdict.PASS else "but it diverges"
        return summary.with_(expectation=f"introduced in {expect.introduced_in}, which this tree does not "
                                         f"hold: {held}")
    if fixed and expect.diverges_after_fix:
        expect, fixed = dataclasses.replace(expect, signature=expect.diverges_after_fix), False
    fd = summary.first_divergence
    if expect.raises and not fixed:
        return summary.with_(verdict=Verdict.FAIL,
                             expectation=f"expected the run to raise {expect.raises!r}, but it ran")
    if fixed:
        fix = expect.fixed_in or f"megatron-core {expect.fixed_in_version}"
        if summary.verdict == Verdict.PASS:
            return summary.with_(verdict=Verdict.FIXED,
                                 expectation=f"fixed in {fix}: parity holds on this tree")
        return summary.with_(expectation=f"this tree holds the fix ({fix}), but it still diverges")
    if summary.verdict == Verdict.PASS:
        return summary.with_(verdict=Verdict.FAIL, expectation=(
            "expected the known divergence, but parity holds: if megatron-core fixed it, "
            "remove the scenario's [expect]"))
    if summary.verdict == Verdict.FAIL and fd:
        wrong = [f"{k} {getattr(fd, k)!r} (expected {getattr(expect, k)!r})" for k in ("signature", "step")
                 if getattr(expect, k) is not None and getattr(fd, k) != getattr(expect, k)]
        if wrong:
            return summary.with_(expectation="diverged, but not as the known divergence: " + ", ".join(wrong))
        return summary.with_(verdict=Verdict.KNOWN_DIVERGENCE)
    return summary


def failure_outcome(s: Scenario, failed: dict[str, str], jobs: dict,
                    raised: dict[str, dict] | None = None) -> ScenarioSummary:
    """A scenario whose sides did not all run: ``known-divergence`` where the candidate alone
    raised as its ``[expect] raises`` records, on a tree without the fix; ``fail`` with signature
    ``raised`` where the code under test raised on one compared side only (``raised``: per side,
    :func:`harness.run.launch.raised_record`); an error otherwise (a launch, a timeout, the
    harness's own exception, the same exception on both sides)."""
    base = {"scenario": s.name, "error": failed, "axes": dict(s.axes), "config": scenario_config(s),
            "traces": {r: j.trace_dir for r, j in jobs.items()}}
    e = s.expect
    if e is not None and e.raises and set(failed) == {Role.CANDIDATE} and e.raises in failed[Role.CANDIDATE]:
        prov = jobs[Role.CANDIDATE].provenance or {}
        tree, version = prov.get("megatron_core"), (prov.get("versions") or {}).get("megatron-core")
        if not holds_fix(e, tree, version) and (e.introduced_in is None
                                                or holds_commit(e.introduced_in, tree)):
            return ScenarioSummary.of(verdict=Verdict.KNOWN_DIVERGENCE,
                                      expectation=f"raised as known ({e.raises!r})",
                                      expect={k: v for k, v in dataclasses.asdict(e).items()
                                              if v is not None},
                                      **base)
    side = one_side_raised(failed, raised or {})
    if side is None:
        return ScenarioSummary.of(verdict=Verdict.ERROR, **base)
    fd = raised_divergence(side, raised[side])
    summary = ScenarioSummary.of(verdict=Verdict.FAIL, first_divergence=fd, **base)
    if e is not None and e.raises:
        return summary.with_(expectation=f"expected the candidate to raise {e.raises!r}, but the {side} "
                                         f"raised {fd.tensor}")
    return judge_known_divergence(summary, e) if e is not None else summary


def one_side_raised(failed: dict[str, str], raised: dict[str, dict]) -> str | None:
    """The compared side (reference or candidate) whose code under test raised while the other
    ran, or None: both raised, the golden failed, or a failure was the harness's own."""
    compared = [r for r in failed if r in (Role.REFERENCE, Role.CANDIDATE)]
    if len(compared) != 1 or set(failed) != set(compared) or compared[0] not in raised:
        return None
    return compared[0]


def raised_divergence(side: str, raised: dict) -> FirstDivergence:
    """The first divergence of a side whose code under test raised: the exception, its innermost
    frame in that code (file:function:line, the tree), the step and phase, the ranks."""
    frame = raised.get("frame") or {}
    where = f"{frame.get('file')}:{frame.get('function')}:{frame.get('line')}"
    text = f"{raised.get('type')}: {raised.get('message')}"
    return FirstDivergence(
        step=raised.get("step"), phase=raised.get("phase"), kind="raised", tensor=text,
        ranks=raised.get("ranks"), signature="raised",
        explanation=(f"the {side}'s code under test raised {text} at {where} (tree {raised.get('tree')}) "
                     f"at step {raised.get('step')}, phase {raised.get('phase')}; the other side ran"),
        extra={"raised": {**raised, "side": side, "where": where}})


def checkpoint_outcome(summary: ScenarioSummary, s: Scenario, results) -> ScenarioSummary:
    """A checkpoint scenario's own record: what was saved and loaded, and whether the load was
    bitwise (every tensor recorded at the load step); a divergence there is named a load."""
    k = s.candidate.load_step
    at_load = results[(results["step"] == k) & (results["kind"] != "scalar")]
    summary = summary.with_(checkpoint={
        "save_step": k, "from": topology(s.saver), "to": topology(s.candidate),
        "tensors_at_load": int(len(at_load)),
        "bitwise_at_load": bool(len(at_load) and at_load["bitwise_equal"].astype(bool).all())})
    fd = summary.first_divergence
    if fd and fd.step == k:
        summary = summary.with_(first_divergence=fd.with_(phase="load"))
    return summary


# What only the megatron-core sides import: a difference there cannot change a side that imports none
# (the torch backend: the golden), so it is no warning where either trace was made by one.
_MEGATRON_ONLY = ("versions.megatron-core:", "versions.transformer-engine:", "code.megatron:",
                  "code.transformer_engine:", "megatron_core.")


def provenance_warnings(traces: dict[str, trace.Trace]) -> list[str]:
    """A warning per side made by other code than the reference, where the difference can change
    what it computes: that may be the point of the comparison (two megatron-core versions), but it
    must never go unnoticed. megatron-core's and Transformer Engine's versions and code are left out
    between a side that imports them and one that does not (the golden's torch backend)."""
    reference = traces[Role.REFERENCE].manifest
    out = []
    for role, t in traces.items():
        if role == Role.REFERENCE:
            continue
        diffs = differences(reference.get("provenance"), t.manifest.get("provenance"))
        if "torch" in (reference.get("backend"), t.manifest.get("backend")):
            diffs = [d for d in diffs if not d.startswith(_MEGATRON_ONLY)]
        if diffs:
            out.append(f"{role} trace was made by other code than the reference: " + "; ".join(diffs))
    return out


def tree_default_notes(traces: dict[str, trace.Trace]) -> list[str]:
    """The declared options whose megatron-core default differs between the reference's and the
    candidate's trees (recorded by the megatron backend as ``tree_defaults``)."""
    infos = [next(iter(traces[r].infos.values()), {}) if r in traces else {} for r in (Role.REFERENCE,
                                                                                       Role.CANDIDATE)]
    a, b = (i.get("tree_defaults") or {} for i in infos)
    out = []
    for name in sorted(set(a) & set(b)):
        if a[name]["default"] != b[name]["default"]:
            ran = a[name].get("left_to_tree") or b[name].get("left_to_tree")
            out.append(f"{name} ({a[name]['target']}): the trees' defaults differ, {a[name]['default']!r} vs "
                       f"{b[name]['default']!r}; " + ("a side left it unset: the values that ran differ"
                                                      if ran
                                                      else "both sides set it: no effect on this run"))
    return out


def compare_scenario(s: Scenario | None, paths: dict[str, Path], sdir: Path, say=print,
                     policy: ComparePolicy | None = None, verify: bool = True, jobs: int = 1,
                     ranks: bool = False) -> ScenarioSummary | None:
    """Compare the traces of one scenario; write steps.csv/json, results.csv, summary.json.
    ``policy`` overrides the scenario's (offline re-judging of existing traces). ``jobs``:
    compare processes; ``ranks``: split over torchrun's ranks, rank 0 writing everything and
    returning the summary, the other ranks measuring their share and returning None."""
    traces = {role: trace.read(p, verify=verify) for role, p in paths.items() if p is not None}
    trace.check_same_model(traces)
    policy = policy or (s.compare if s else None)
    if ranks and split.rank() != 0:
        compare(traces, policy=policy, ranks=True)
        return None
    sdir.mkdir(parents=True, exist_ok=True)
    table = steps.step_table(traces)
    table.to_csv(sdir / "steps.csv", index=False)
    write_json(sdir / "steps.json", table.to_dict(orient="records"))
    steps.rank_losses(traces).to_csv(sdir / "rank_losses.csv", index=False)
    name = s.name if s else sdir.name
    say(f"\n== {name}")
    say(steps.format_steps(table))
    summary, results = compare(traces, policy=policy, jobs=jobs, ranks=ranks)
    results.to_csv(sdir / "results.csv", index=False)
    if warnings := provenance_warnings(traces) + tree_default_notes(traces):
        summary = summary.with_(warnings=warnings)
        for w in warnings:
            say(f"warning: {w}")
    summary = summary.with_(scenario=name, traces={r: str(p) for r, p in paths.items()})
    if s is not None:
        cand = traces[Role.CANDIDATE].manifest
        fixed = s.expect is not None and holds_fix(s.expect,
                                                   (cand.get("provenance") or {}).get("megatron_core"),
                                                   (cand.get("versions") or {}).get("megatron-core"))
        introduced = s.expect is None or s.expect.introduced_in is None or holds_commit(
            s.expect.introduced_in, (cand.get("provenance") or {}).get("megatron_core"))
        summary = judge_known_divergence(summary.with_(axes=dict(s.axes), config=scenario_config(s)),
                                         s.expect, fixed,
                                    introduced)
        if s.saver is not None:
            summary = checkpoint_outcome(summary, s, results)
    write_json(sdir / "summary.json", summary.to_json())
    if summary.expectation:
        say(f"expectation: {summary.expectation}")
    fd = summary.first_divergence
    say(f"verdict: {summary.verdict.upper()}" + (
        f"  first divergence: step {fd.step} {fd.phase} {fd.kind} {fd.tensor} "
        f"ranks {fd.ranks} signature {fd.signature}" if fd else ""))
    return summary
