"""The stages chained: one ``gtp-parity run``, ``matrix``, ``compare`` or ``mlm``.

scenario -> run (plan, launch: the backends record traces) -> compare (one summary per
scenario) -> the run's summary. The command line, the pytest plugin and the mutation campaign
call these; no stage calls back into them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from harness.common.errors import EXIT_PARITY_FAIL, EXIT_PASS, EXIT_RUN_FAILED, BadInput, RunFailed
from harness.common.jsonio import write_json
from harness.compare import split
from harness.compare.outcome import compare_scenario, failure_outcome, scenario_config
from harness.compare.summary import ScenarioSummary, Verdict, overall
from harness.run.tree_checks import check_all_import, check_bridge_imports, check_bridge_trees
from harness.run.trees import BRIDGE, holds, resolve_all
from harness.run.job import Job
from harness.run.launch import launch, mark_interrupted, raised_record, worker_env
from harness.run.nodes import Nodes, node_commands, read_plan
from harness.run.plan import clear_incomplete, execute, job_for, launches, pending_jobs, plan, write_plans
from harness.run.provenance import code_identity
from harness.run.warm import WarmPool
from harness.scenario import Role, Scenario
from harness.scenario import checkpoint as checkpointing
from harness.scenario.checkpoint import EXPERT_TOPOLOGY_FIX


def skip_reason(s: Scenario) -> str | None:
    """Why this machine cannot run the scenario, or None. Such a scenario is reported as
    skipped with the reason, never run halfway and never passed."""
    for role, side in s.sides.items():
        if side.backend == "megatron" and side.recipe != "none":
            try:
                import transformer_engine  # noqa: F401
            except ImportError:
                return (f"[{role}] uses recipe {side.recipe!r} on the megatron backend: Transformer Engine "
                        f"is not importable")
            return (f"[{role}] uses recipe {side.recipe!r}: the megatron backend runs recipes only through "
                    f"Transformer Engine, which it does not drive yet")
    return None


def reads_mock_data(s: Scenario) -> bool:
    """Whether the compared sides read Megatron-LM's mock samples (mlm ``data = "mock"``): the
    golden reads the harness's synthetic samples, so it is no measure of them, and the sides
    are judged against each other only (the policy's no-golden fallback)."""
    return any(side.backend in ("mlm", "bridge") and side.data == "mock"
               for side in (s.reference, s.candidate))


def check_mlm_flags(scenarios: list[Scenario]) -> None:
    """Parse every mlm side's command line that carries extra ``args`` with Megatron-LM's own
    parser before anything is launched: a refused flag is bad input naming the side. (Sides
    without ``args`` run flags the harness writes; they skip the parser's import cost.)"""
    from harness.backends.mlm.args import check_flags, side_argv

    for s in scenarios:
        for role, side in s.sides.items():
            if side.backend == "mlm" and side.args:
                check_flags(side_argv(s.model, s.data, side), f"{s.source}: [{role}].args")


def plan_checked(scenarios: list[Scenario], out: Path) -> dict[str, dict[str, Job]]:
    """The scenarios' jobs, every megatron-core and Megatron-Bridge tree resolved first (a
    repository configured nowhere is named before any import), then each checked: it imports,
    and holds what its sides ask."""
    trees = resolve_all(scenarios)
    bridges = resolve_all(scenarios, BRIDGE)
    check_bridge_trees(scenarios, bridges)
    check_all_import(trees, scenarios, worker_env)
    for s in scenarios:  # what a checkpoint's loader can take depends on the tree
        checkpointing.check_expert_optimizers(
            s, lambda side: holds(trees[side.megatron_core], *EXPERT_TOPOLOGY_FIX))
    check_bridge_imports(scenarios, trees, bridges, worker_env)
    return plan(scenarios, out, trees=trees, bridges=bridges)


def run_scenarios(scenarios: list[Scenario], out: Path, parallel: int = 2, verbose: bool = False,
                  fresh: bool = False, compare_jobs: int = 1, collect: bool = False,
                  pool: WarmPool | None = None) -> int:
    """Run, compare and summarize every scenario; return the exit code of the worst.
    ``collect``: launch nothing, compare the traces already complete (``gtp-parity collect``:
    sides run by ``gtp-parity plan``'s launches); a side without one is an error naming why.
    ``pool``: the launches run on its warm workers (the fuzzer's: :mod:`harness.run.warm`)."""
    say = print if verbose else (lambda *a, **k: None)
    out.mkdir(parents=True, exist_ok=True)
    skipped, runnable = [], []
    for s in scenarios:
        if (reason := skip_reason(s)) is None:
            runnable.append(s)
            continue
        summary = ScenarioSummary.of(scenario=s.name, verdict=Verdict.SKIP, reason=reason, axes=dict(s.axes),
                                     config=scenario_config(s))
        write_json(out / "scenarios" / s.name / "summary.json", summary.to_json())
        say(f"== {s.name}: skipped: {reason}")
        skipped.append(summary)
    scenarios = runnable
    check_mlm_flags(scenarios)
    by_scenario = plan_checked(scenarios, out)
    say(f"gtp-parity: {len(scenarios)} scenario(s), "
        f"{len({j.key for r in by_scenario.values() for j in r.values()})} distinct side(s) -> {out}")
    failures = execute(by_scenario, scenarios, out, parallel=parallel, progress=say, fresh=fresh,
                       collect=collect, pool=pool)
    worst = EXIT_PASS
    results = []
    for s in scenarios:
        jobs = by_scenario[s.name]
        sdir = out / "scenarios" / s.name
        failed = {role: failures[j.key] for role, j in jobs.items() if j.key in failures}
        if failed:
            raised = {r: rec for r in failed if (rec := raised_record(jobs[r], jobs[r].side.world_size))}
            summary = failure_outcome(s, failed, jobs, raised)
            write_json(sdir / "summary.json", summary.to_json())
            known = summary.verdict == Verdict.KNOWN_DIVERGENCE
            fd = summary.first_divergence
            what = "run failed" if fd is None else "the code under test raised"
            say(f"\n== {s.name}: {what}" + (f", {summary.expectation}" if known else "") + "\n"
                + "\n".join(f"  {r}: {m}" for r, m in failed.items())
                + (f"\nverdict: {summary.verdict.upper()}  first divergence: step {fd.step} {fd.phase} "
                   f"signature {fd.signature}: {fd.explanation}" if fd else ""))
            # The code under test raising on one side is a verdict (exit 1); a run that failed otherwise, 3.
            code = EXIT_RUN_FAILED if summary.verdict == Verdict.ERROR else EXIT_PARITY_FAIL
            worst = worst if summary.verdict.passes_gate else max(worst, code)
            results.append(summary)
            continue
        paths = {r: Path(j.trace_dir) for r, j in jobs.items() if r != Role.SAVER}  # the saver: not compared
        if reads_mock_data(s):  # the golden reads the synthetic samples: no measure of these
            paths[Role.GOLDEN] = None
        summary = compare_scenario(s, paths, sdir, say, jobs=compare_jobs)
        results.append(summary)
        if not summary.verdict.passes_gate:
            worst = max(worst, EXIT_PARITY_FAIL)
    results += skipped
    write_json(out / "summary.json", {"scenarios": [r.to_json() for r in results],
                                      "verdict": overall(r.verdict for r in results)})
    return worst


def plan_launches(scenarios: list[Scenario], out: Path, nnodes: int = 1, endpoint: str | None = None,
                  fresh: bool = False, say=print) -> int:
    """``gtp-parity plan``: write the launch plans of every side without a complete trace under
    ``out/launches`` (paths made absolute: every node reads them) and print what runs each;
    launch nothing. Incomplete traces of those sides are removed, as ``run`` would."""
    out = out.resolve()
    scenarios = [s for s in scenarios if skip_reason(s) is None]
    check_mlm_flags(scenarios)
    by_scenario = plan_checked(scenarios, out)
    pending = pending_jobs(by_scenario, fresh=fresh, progress=say)
    batches = launches(by_scenario, scenarios, pending)
    clear_incomplete(pending.values())
    paths = write_plans(batches, out)
    say(f"gtp-parity: {len(scenarios)} scenario(s), {len(pending)} side(s) to run in {len(batches)} "
        f"launch(es), "
        f"one after another -> {out}")
    root = Path(__file__).resolve().parents[1]
    for b, path in zip(batches, paths):
        where, lines = node_commands(b.name, path, b.world, nnodes, endpoint, root)
        say(f"\nlaunch {b.name}: {len(b.jobs)} side(s), world {b.world}, {where}; any one of:")
        for how, line in lines:
            say(f"  # {how}\n  {line}")
    return EXIT_PASS


def launch_plan(path: str, nnodes: int = 1, node_rank: int = 0, endpoint: str | None = None,
                say=print) -> int:
    """``gtp-parity launch PLAN``: run this node's share of a planned launch under torchrun,
    watched as ``run`` watches its launches (timeouts, heartbeats, failures named by node and
    rank). Bad flags are refused before anything starts."""
    doc = read_plan(path)
    nodes = Nodes.of(nnodes, node_rank, endpoint, doc["world"])
    try:
        jobs = [Job.from_json(j) for j in doc["jobs"]]
        timeout_s = {k: float(v) for k, v in doc.get("timeout_s", {}).items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise BadInput(path, f"not a launch plan: a malformed job ({type(e).__name__}: {e})") from None
    plan_path = Path(path).resolve()
    try:
        wall = launch(jobs, world=doc["world"], timeout_s=timeout_s, workdir=plan_path.parent,
                      name=doc["name"],
                      nodes=nodes, plan=plan_path)
    except KeyboardInterrupt:  # the launch's ranks are already ended (launch's finally)
        mark_interrupted(jobs, doc["world"])
        raise
    on = f" (node {node_rank} of {nnodes})" if nnodes > 1 else ""
    say(f"launch {doc['name']}{on}: {len(jobs)} side(s) on {doc['world']} rank(s) in {wall:.1f} s")
    for job in jobs:
        say(f"  {job.side.label()}: {job.trace_dir}")
    return EXIT_PASS


def compare_traces(ref: Path, cand: Path, golden: Path | None, out: Path,
                   policy=None, verify: bool = True, jobs: int = 1) -> int:
    """Compare three traces into ``out``; under torchrun, split over the ranks (every rank
    returns rank 0's exit code)."""
    with split.rank_group() as ranks:
        summary = compare_scenario(None, {Role.REFERENCE: ref, Role.CANDIDATE: cand, Role.GOLDEN: golden},
                                   out,
                                   policy=policy, verify=verify, jobs=jobs, ranks=ranks)
        code = EXIT_PASS if summary is None or summary.verdict.passes_gate else EXIT_PARITY_FAIL
        return split.share_exit_code(code) if ranks else code


def run_mlm_command(flags: list[str], nproc: int, out: Path, timeout_s: float) -> Path:
    """``gtp-parity mlm``: run a user's Megatron-LM command with capture on; return its trace folder."""
    from harness.backends.mlm.command import scenario_of

    s = dataclasses.replace(scenario_of(flags, nproc), timeout_s=timeout_s)
    job = job_for(s, Role.REFERENCE, out / "traces", code_identity(worker_env()))
    failures = execute({s.name: {Role.REFERENCE: job}}, [s], out)
    if failures:
        raise RunFailed(next(iter(failures.values())))
    return Path(job.trace_dir)
