"""One ``gtp-parity run`` or ``compare``: the pipeline stages called in order.

scenario -> launch (runner) -> traces -> step table -> compare -> localize -> summary.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from harness import parallel, steps, trace
from harness.errors import EXIT_PARITY_FAIL, EXIT_PASS, EXIT_RUN_FAILED
from harness.provenance import differences
from harness.runner import execute, plan
from harness.scenario import ComparePolicy, Expectation, Scenario
from harness.trace import write_json


def skip_reason(s: Scenario) -> str | None:
    """Why this machine cannot run the scenario, or None. Such a scenario is reported as
    skipped with the reason, never run halfway and never passed."""
    for role, side in s.sides.items():
        if side.backend == "megatron" and side.recipe != "none":
            try:
                import transformer_engine  # noqa: F401
            except ImportError:
                return f"[{role}] uses recipe {side.recipe!r} on the megatron backend: Transformer Engine is not importable"
            return f"[{role}] uses recipe {side.recipe!r}: the megatron backend runs recipes only through Transformer Engine, which it does not drive yet"
    return None


def reads_mock_data(s: Scenario) -> bool:
    """Whether the compared sides read Megatron-LM's mock samples (mlm ``data = "mock"``): the
    golden reads the harness's synthetic samples, so it is no measure of them, and the sides
    are judged against each other only (the policy's no-golden fallback)."""
    return any(side.backend == "mlm" and side.data == "mock" for side in (s.reference, s.candidate))


def check_mlm_flags(scenarios: list[Scenario]) -> None:
    """Parse every mlm side's command line that carries extra ``args`` with Megatron-LM's own
    parser before anything is launched: a refused flag is bad input naming the side. (Sides
    without ``args`` run flags the harness writes; they skip the parser's import cost.)"""
    from harness.backends.mlm.args import check_flags, side_argv

    for s in scenarios:
        for role, side in s.sides.items():
            if side.backend == "mlm" and side.args:
                check_flags(side_argv(s.model, s.data, side), f"{s.source}: [{role}].args")


def run_scenarios(scenarios: list[Scenario], out: Path, parallel: int = 2, verbose: bool = False,
                  fresh: bool = False, compare_jobs: int = 1) -> int:
    """Run, compare and summarize every scenario; return the exit code of the worst."""
    say = print if verbose else (lambda *a, **k: None)
    out.mkdir(parents=True, exist_ok=True)
    skipped, runnable = [], []
    for s in scenarios:
        if (reason := skip_reason(s)) is None:
            runnable.append(s)
            continue
        doc = {"scenario": s.name, "verdict": "skip", "reason": reason, "axes": dict(s.axes), "config": _config(s)}
        write_json(out / "scenarios" / s.name / "summary.json", doc)
        say(f"== {s.name}: skipped: {reason}")
        skipped.append(doc)
    scenarios = runnable
    check_mlm_flags(scenarios)
    by_scenario = plan(scenarios, out)
    say(f"gtp-parity: {len(scenarios)} scenario(s), "
        f"{len({j.key for r in by_scenario.values() for j in r.values()})} distinct side(s) -> {out}")  # fmt: skip
    failures = execute(by_scenario, scenarios, out, parallel=parallel, progress=say, fresh=fresh)
    worst = EXIT_PASS
    results = []
    for s in scenarios:
        jobs = by_scenario[s.name]
        sdir = out / "scenarios" / s.name
        failed = {role: failures[j.key] for role, j in jobs.items() if j.key in failures}
        if failed:
            summary = {"scenario": s.name, "verdict": "error", "error": failed, "axes": dict(s.axes),
                       "config": _config(s), "traces": {r: j.trace_dir for r, j in jobs.items()}}  # fmt: skip
            write_json(sdir / "summary.json", summary)
            say(f"\n== {s.name}: run failed\n" + "\n".join(f"  {r}: {m}" for r, m in failed.items()))
            worst = max(worst, EXIT_RUN_FAILED)
            results.append(summary)
            continue
        paths = {r: Path(j.trace_dir) for r, j in jobs.items() if r != "source"}  # the saver: not compared
        if reads_mock_data(s):  # the golden reads the synthetic samples: no measure of these
            paths["golden"] = None
        summary = compare_scenario(s, paths, sdir, say, jobs=compare_jobs)
        results.append(summary)
        if summary["verdict"] not in GATE_PASSES:
            worst = max(worst, EXIT_PARITY_FAIL)
    results += skipped
    write_json(out / "summary.json", {"scenarios": results, "verdict": _overall(results)})
    return worst


# Verdicts a gate lets through: parity, and a known divergence that diverged as recorded.
GATE_PASSES = ("pass", "known-divergence")


def _overall(results: list[dict]) -> str:
    verdicts = {r["verdict"] for r in results}
    if "error" in verdicts or "fail" in verdicts:
        return "error" if "error" in verdicts else "fail"
    return "pass" if verdicts & set(GATE_PASSES) else "skip"


def judge_expectation(doc: dict, expect: Expectation | None) -> None:
    """Turn a failure that matches the scenario's known divergence into ``known-divergence``;
    a scenario that was expected to diverge and holds, or diverges otherwise, fails."""
    if expect is None:
        return
    doc["expect"] = dataclasses.asdict(expect)
    fd = doc.get("first_divergence")
    if doc["verdict"] == "pass":
        doc["verdict"] = "fail"
        doc["expectation"] = ("expected the known divergence, but parity holds: if megatron-core fixed it, "
                              "remove the scenario's [expect]")  # fmt: skip
    elif doc["verdict"] == "fail" and fd:
        wrong = [f"{k} {fd.get(k)!r} (expected {getattr(expect, k)!r})" for k in ("signature", "step")
                 if getattr(expect, k) is not None and fd.get(k) != getattr(expect, k)]  # fmt: skip
        if wrong:
            doc["expectation"] = "diverged, but not as the known divergence: " + ", ".join(wrong)
        else:
            doc["verdict"] = "known-divergence"


def compare_scenario(s: Scenario | None, paths: dict[str, Path], sdir: Path, say=print,
                     policy: ComparePolicy | None = None, verify: bool = True, jobs: int = 1,
                     ranks: bool = False) -> dict | None:
    """Compare the traces of one scenario; write steps.csv/json, results.csv, summary.json.
    ``policy`` overrides the scenario's (offline re-judging of existing traces). ``jobs``:
    worker processes; ``ranks``: split over torchrun's ranks, rank 0 writing everything and
    returning the summary, the other ranks measuring their share and returning None."""
    from harness.compare import compare

    traces = {role: trace.read(p, verify=verify) for role, p in paths.items() if p is not None}
    trace.check_same_model(traces)
    policy = policy or (s.compare if s else None)
    if ranks and parallel.rank() != 0:
        return compare(traces, policy=policy, ranks=True)
    sdir.mkdir(parents=True, exist_ok=True)
    table = steps.step_table(traces)
    table.to_csv(sdir / "steps.csv", index=False)
    write_json(sdir / "steps.json", table.to_dict(orient="records"))
    steps.rank_losses(traces).to_csv(sdir / "rank_losses.csv", index=False)
    name = s.name if s else sdir.name
    say(f"\n== {name}")
    say(steps.format_steps(table))
    summary = compare(traces, policy=policy, jobs=jobs, ranks=ranks)
    summary["results"].to_csv(sdir / "results.csv", index=False)
    doc = {k: v for k, v in summary.items() if k != "results"}
    if warnings := provenance_warnings(traces):
        doc["warnings"] = warnings
        for w in warnings:
            say(f"warning: {w}")
    doc.update(scenario=name, traces={r: str(p) for r, p in paths.items()})
    if s is not None:
        doc["axes"] = dict(s.axes)
        doc["config"] = _config(s)
        judge_expectation(doc, s.expect)
        if s.saver is not None:
            _checkpoint_summary(doc, s, summary["results"])
    write_json(sdir / "summary.json", doc)
    fd = doc.get("first_divergence")
    if doc.get("expectation"):
        say(f"expectation: {doc['expectation']}")
    say(f"verdict: {doc['verdict'].upper()}" + (
        f"  first divergence: step {fd['step']} {fd['phase']} {fd['kind']} {fd['tensor']} "
        f"ranks {fd.get('ranks')} signature {fd['signature']}" if fd else ""))  # fmt: skip
    return doc


def _checkpoint_summary(doc: dict, s: Scenario, results) -> None:
    """A checkpoint scenario's own row: what was saved and loaded, and whether the load was
    bitwise (every tensor recorded at the load step); a divergence there is named a load."""
    k = s.candidate.load_step
    at_load = results[(results["step"] == k) & (results["kind"] != "scalar")]
    from harness.checkpointing import topology

    doc["checkpoint"] = {"save_step": k, "from": topology(s.saver), "to": topology(s.candidate),
                         "tensors_at_load": int(len(at_load)),
                         "bitwise_at_load": bool(len(at_load) and at_load["bitwise_equal"].astype(bool).all())}  # fmt: skip
    fd = doc.get("first_divergence")
    if fd and fd.get("step") == k:
        fd["phase"] = "load"


def provenance_warnings(traces: dict[str, trace.Trace]) -> list[str]:
    """A warning per side made by other code than the reference: that may be the point of
    the comparison (two megatron-core versions), but it must never go unnoticed."""
    ref = traces["reference"].manifest.get("provenance")
    out = []
    for role, t in traces.items():
        if role == "reference":
            continue
        if diffs := differences(ref, t.manifest.get("provenance")):
            out.append(f"{role} trace was made by other code than the reference: " + "; ".join(diffs))
    return out


def _config(s: Scenario) -> dict:
    return {"source": s.source, "description": s.description, **{r: side.label() for r, side in s.sides.items()},
            "paths": {r: side.paths() for r, side in s.sides.items() if side.paths()}}


def compare_traces(ref: Path, cand: Path, golden: Path | None, out: Path,
                   policy: ComparePolicy | None = None, verify: bool = True, jobs: int = 1) -> int:
    """Compare three traces into ``out``; under torchrun, split over the ranks (every rank
    returns rank 0's exit code)."""
    with parallel.rank_group() as ranks:
        doc = compare_scenario(None, {"reference": ref, "candidate": cand, "golden": golden}, out,
                               policy=policy, verify=verify, jobs=jobs, ranks=ranks)
        code = EXIT_PASS if doc is None or doc["verdict"] in GATE_PASSES else EXIT_PARITY_FAIL
        return parallel.share_exit_code(code) if ranks else code
