"""Run mutants against a fast matrix and score the harness's detection power.

Each mutant becomes a candidate side of every matrix scenario (its id enters the side key, so
a trace of a mutant is never reused for clean code nor for another mutant); the clean
references and goldens are shared. Mutant sides of one world size share launches; a side that
crashes or overruns its timeout ends its launch, is counted killed-by-crash (or -timeout), and
the sides after it are launched again.
"""

from __future__ import annotations

import dataclasses
import filecmp
import json
import fnmatch
import time
import tomllib
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from harness.capture import trace
from harness.common.jsonio import write_json
from harness.common.errors import BadInput, RunFailed
from harness.compare.summary import Verdict
from harness.run.launch import launch
from harness.scenario import Role
from harness.scenario.mutants import Mutant, applicable

KILLED, CRASHED, TIMEOUT, SURVIVED = "killed", "crashed", "timeout", "survived"
EQUIVALENT, UNREACHABLE = "equivalent", "unreachable"
DETECTED = (KILLED, CRASHED, TIMEOUT)

# What a mutated function computes, as the tensor kinds its first divergence should name:
# (module suffix, function pattern) -> kinds. The first match wins.
EXPECTED_KINDS = [
    # GTP's checkpoint offsets: what a load reads (a checkpoint scenario's load step).
    ("generalized_tensor_parallelism", "*checkpoint*", {"param", "exp_avg", "exp_avg_sq", "master"}),
    ("generalized_tensor_parallelism", "*reduce_scatter*", {"main_grad"}),
    ("generalized_tensor_parallelism", "*wgrad*", {"main_grad"}),
    ("generalized_tensor_parallelism", "*grad*", {"main_grad"}),
    ("generalized_tensor_parallelism", "*backward*", {"main_grad", "materialized"}),
    ("generalized_tensor_parallelism", "*", {"materialized", "activation", "main_grad"}),
    ("finalize_model_grads", "*", {"main_grad"}),
    ("distributed_data_parallel", "*", {"main_grad"}),
    ("optimizer", "*", {"param", "master", "exp_avg", "exp_avg_sq", "scalar"}),
    ("parallel_state", "*", {"input", "materialized", "main_grad", "scalar"}),
    ("emerging_optimizers", "*", {"param", "master"}),  # Muon's update: the new weight
]


def expected_kinds(m: Mutant) -> set[str]:
    for module, pattern, kinds in EXPECTED_KINDS:
        if m.module.endswith(module) and fnmatch.fnmatchcase(m.function.lower(), pattern):
            return kinds
    return set()


@dataclass
class Outcome:
    mutant: Mutant
    status: str = SURVIVED
    verdicts: dict = field(default_factory=dict)
    """scenario -> verdict (or crashed / timeout)."""
    first_divergence: dict | None = None
    scenario: str | None = None
    localized: bool | None = None
    error: str | None = None
    reason: str | None = None
    """Why a survivor is equivalent or unreachable (the triage file's, or the run's: its
    mutated lines never ran)."""
    reached: bool | None = None
    """Whether the mutated lines ran on the candidate (None: not recorded, e.g. a crash)."""

    def to_json(self) -> dict:
        return {**self.mutant.to_json(), "status": self.status, "verdicts": self.verdicts,
                "scenario": self.scenario, "first_divergence": self.first_divergence,
                "expected_kinds": sorted(expected_kinds(self.mutant)), "localized": self.localized,
                "error": self.error, "reason": self.reason, "reached": self.reached}


def select(mutants: list[Mutant], budget: int | None) -> list[Mutant]:
    """``budget`` applicable mutants spread round-robin over (file, operator): a small
    campaign samples every file and operator, not the first functions of the first file.
    Only the chosen are compiled (checking all of them costs more than a small campaign)."""
    groups = defaultdict(list)
    for m in sorted(mutants, key=lambda m: m.id):
        groups[(m.module, m.operator)].append(m)
    queues = [groups[k] for k in sorted(groups)]
    order = []
    while any(queues):
        for q in queues:
            if q:
                order.append(q.pop(0))
    budget = len(order) if budget is None else budget
    out: list[Mutant] = []
    while len(out) < budget and order:
        batch, order = order[: budget - len(out)], order[budget - len(out):]
        out += applicable(batch)
    return out


def read_triage(path: Path) -> dict[str, dict]:
    """mutant id -> {"status": equivalent|unreachable, "reason": ...} from the triage file."""
    if not path.is_file():
        return {}
    try:
        doc = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise BadInput(str(path), f"invalid TOML: {e}") from None
    out = {}
    for mid, entry in doc.get("mutant", {}).items():
        if not isinstance(entry, dict) or entry.get("status") not in (EQUIVALENT, UNREACHABLE) \
                or not isinstance(entry.get("reason"), str):
            raise BadInput(f"{path}: mutant.{mid}", "needs status = equivalent|unreachable and a reason")
        out[mid] = entry
    return out


def mutant_scenarios(scenarios: list, mutants: list[Mutant], timeout_s: float) -> dict[str, list]:
    """mutant id -> its scenarios (the candidate runs the mutant, and so does a checkpoint
    scenario's saving side, whose checkpoint the candidate loads; the rest is the matrix's)."""
    def mutated(side, m):
        return None if side is None else dataclasses.replace(side, mutant=m.id)

    return {m.id: [dataclasses.replace(s, name=f"{s.name}@{m.id}", timeout_s=timeout_s,
                                       candidate=mutated(s.candidate, m), saver=mutated(s.saver, m))
                   for s in scenarios] for m in mutants}


def mutated_roles(roles: dict) -> list[str]:
    """The roles of a scenario that run the mutant: its saver (if any), then its candidate."""
    return [r for r in (Role.SAVER, "candidate") if r in roles]


def mutant_jobs(roles: dict) -> list:
    """The jobs of one mutant scenario that run the mutant."""
    return [roles[r] for r in mutated_roles(roles)]


def run_mutant_jobs(jobs: list, out: Path, per_launch: int, timeout_s: float, say,
                    prefix: str = "m", pool=None) -> dict[str, str]:
    """Run mutant sides, ``per_launch`` per launch (named ``prefix`` + a count, so that the
    launches of each stage keep their own plan and log); return job key -> crashed|timeout."""
    failed: dict[str, str] = {}
    by_world = defaultdict(list)
    for j in jobs:
        if not trace.is_complete(j.trace_dir):
            by_world[j.side.world_size].append(j)
    n = 0
    for world, queue in sorted(by_world.items()):
        while queue:
            chunk, queue = queue[:per_launch], queue[per_launch:]
            n += 1
            try:
                wall = (pool.launch if pool else launch)(chunk, world=world, workdir=out / "launches",
                                                         timeout_s={j.key: timeout_s for j in chunk},
                                                         name=f"{prefix}{n}")
                say(f"  launch {prefix}{n}: {len(chunk)} mutant side(s) in {wall:.1f} s")
            except RunFailed as e:
                done = [j for j in chunk if trace.is_complete(j.trace_dir)]
                rest = [j for j in chunk if j not in done]
                culprit = rest[0]
                failed[culprit.key] = TIMEOUT if "timed out" in str(e) else CRASHED
                say(f"  launch {prefix}{n}: {culprit.side.mutant} {failed[culprit.key]}")
                queue = rest[1:] + queue
    return failed


def score(outcomes: list[Outcome]) -> dict:
    """Mutation score killed / (total - equivalent), overall, per operator and per file."""
    def one(group):
        total = len(group)
        equivalent = sum(o.status == EQUIVALENT for o in group)
        counts = {s: sum(o.status == s for o in group) for s in (KILLED, CRASHED, TIMEOUT, SURVIVED,
                                                                  EQUIVALENT, UNREACHABLE)}
        detected = sum(counts[s] for s in DETECTED)
        reachable = total - equivalent - counts[UNREACHABLE]
        return {"total": total, **counts,
                "score": detected / (total - equivalent) if total > equivalent else None,
                # the checks' power where the matrix reaches the code
                "score_reached": detected / reachable if reachable else None}
    by_op, by_file = defaultdict(list), defaultdict(list)
    for o in outcomes:
        by_op[o.mutant.operator].append(o)
        by_file[o.mutant.module].append(o)
    killed = [o for o in outcomes if o.status == KILLED]
    localized = [o for o in killed if o.localized]
    return {"overall": one(outcomes), "operator": {k: one(v) for k, v in sorted(by_op.items())},
            "file": {k: one(v) for k, v in sorted(by_file.items())},
            "localization": {"killed": len(killed), "localized": len(localized),
                             "accuracy": len(localized) / len(killed) if killed else None}}


def judge(o: Outcome, summaries: list[dict], failed: dict[str, str], jobs: list) -> None:
    """A mutant's status from its scenarios' summaries and its sides' failures."""
    for doc in summaries:
        o.verdicts[doc["scenario"]] = doc["verdict"]
        if doc["verdict"] == Verdict.FAIL and o.first_divergence is None:
            o.status, o.scenario, o.first_divergence = KILLED, doc["scenario"], doc.get("first_divergence")
    for j in jobs:
        if j.key in failed:
            o.verdicts[j.side.label()] = failed[j.key]
            if o.status == SURVIVED:
                o.status = failed[j.key]
    if o.status == KILLED:
        fd = o.first_divergence or {}
        o.localized = fd.get("kind") in expected_kinds(o.mutant) or (
            fd.get("kind") == "scalar" and "scalar" in expected_kinds(o.mutant))


def clock() -> float:
    return time.monotonic()


def _quiet(*a, **k):
    pass


def _compare(s, roles: dict, out: Path):
    from harness.compare.outcome import compare_scenario

    return compare_scenario(s, {r: Path(j.trace_dir) for r, j in roles.items()}, out / "scenarios" / s.name,
                            say=_quiet)


def run_clean(scenarios: list, out: Path, say, modules: tuple[str, ...] = (), pool=None) -> dict:
    """Run and judge the clean matrix: a scenario failing clean would make every kill there
    meaningless. The sides a mutant will run on record which lines of ``modules`` ran. Returns
    the plan (its provenance is the mutants')."""
    from harness.run.plan import execute, plan

    by_scenario = plan(scenarios, out)
    for roles in by_scenario.values():
        for r in mutated_roles(roles):
            roles[r] = dataclasses.replace(roles[r], lines=modules)
    if failures := execute(by_scenario, scenarios, out, progress=say, pool=pool):
        raise RunFailed("the clean matrix did not run: " + "; ".join(failures.values()))
    bad = [s.name for s in scenarios if not _compare(s, by_scenario[s.name], out).verdict.passes_gate]
    if bad:
        raise BadInput("--matrix", f"clean scenario(s) {', '.join(bad)} do not hold parity: kills there "
                       "would not be the mutants'")
    return by_scenario


def clean_lines(roles: dict) -> dict[str, set[int]] | None:
    """module -> the lines its clean sides that a mutant would run on ran, on any rank (None:
    not recorded, e.g. a trace from before the campaign recorded lines). Only the modules every
    record covers: a clean trace reused from a campaign of other targets knows nothing of the rest."""
    docs = []
    for r in mutated_roles(roles):
        files = sorted(Path(roles[r].trace_dir).glob("rank*/lines.json"))
        docs += [json.loads(f.read_text()).get("lines") for f in files] or [None]
    if None in docs:
        return None
    return {module: set().union(*(doc[module] for doc in docs))
            for module in set.intersection(*(set(doc) for doc in docs))}


def can_differ(m: Mutant, lines: dict[str, set[int]] | None) -> bool:
    """Whether ``m`` could change what a scenario computes: a run is deterministic, so a mutant
    whose span holds no line the clean sides ran computes exactly what they did (its trace would
    be the clean one's, byte for byte) and is not run there."""
    if lines is None or m.module not in lines:
        return True
    return any(n in lines[m.module] for n in range(m.line, m.end_line + 1))


def run_campaign(mutants: list[Mutant], scenarios: list, out: Path, *, timeout_s: float, per_launch: int,
                 triage, say=print, warm: bool = True, skip: bool = True) -> dict:
    """Run ``mutants`` against ``scenarios``; write and return the campaign's document.
    ``triage`` is the survivors' triage (a dict, or a callable read once the runs are done).

    The matrix runs in stages, in its order: a mutant detected by one scenario (killed,
    crashed, timed out) does not run the next ones, which could not change its status; put the
    cheap scenario first. A mutant whose lines the scenario's clean sides never ran is not run
    there (:func:`can_differ`; ``skip=False`` runs it anyway, to check that claim). With ``warm``
    the launches go to warm workers."""
    from contextlib import nullcontext

    from harness.run.warm import WarmPool

    with WarmPool(out / "warm") if warm else nullcontext() as pool:
        return _campaign(mutants, scenarios, out, timeout_s, per_launch, triage, say, pool, skip)


def _campaign(mutants, scenarios, out, timeout_s, per_launch, triage, say, pool, skip) -> dict:
    import shutil

    from harness.run.plan import plan

    out.mkdir(parents=True, exist_ok=True)
    t0 = clock()
    clean = run_clean(scenarios, out, say, tuple(sorted({m.module for m in mutants})), pool)
    t_clean = clock() - t0
    provenance = next(iter(clean.values()))["candidate"].provenance
    per = mutant_scenarios(scenarios, mutants, timeout_s)
    by_s = plan([s for ss in per.values() for s in ss], out, provenance)
    say(f"gtp-parity mutate: {len(mutants)} mutant(s) x {len(scenarios)} scenario(s) -> {out}")
    failed: dict[str, str] = {}
    summaries: dict[str, list] = {m.id: [] for m in mutants}
    ran: dict[str, list[int]] = {m.id: [] for m in mutants}  # the stages each mutant ran
    alive, t_run, stages = list(mutants), 0.0, []
    for i, s in enumerate(scenarios):
        lines = clean_lines(clean[s.name])
        differ = [m for m in alive if can_differ(m, lines)]
        runs = differ if skip else alive
        roles = [by_s[per[m.id][i].name] for m in runs]
        jobs = list({j.key: j for r in roles for j in mutant_jobs(r)}.values())
        for j in jobs:
            if not trace.is_complete(j.trace_dir):
                shutil.rmtree(j.trace_dir, ignore_errors=True)  # a side left incomplete is run again
        say(f"  {s.name}: {len(runs)} of {len(alive)} mutant(s) reach its lines")
        t = clock()
        prefix = f"m{i}-" if i else "m"
        if savers := [r[Role.SAVER] for r in roles if Role.SAVER in r]:  # a checkpoint first, then its loader
            failed |= run_mutant_jobs(savers, out, per_launch, timeout_s, say, prefix=prefix + "s", pool=pool)
        loaders = [r["candidate"] for r in roles if not (Role.SAVER in r and r[Role.SAVER].key in failed)]
        failed |= run_mutant_jobs(list({j.key: j for j in loaders}.values()), out, per_launch, timeout_s, say,
                                  prefix=prefix, pool=pool)
        stages.append({"scenario": s.name, "alive": len(alive), "ran": len(runs),
                       "can_differ": [m.id for m in differ],
                       "lines_recorded": lines is not None, "seconds": clock() - t})
        t_run += clock() - t
        for m in runs:
            ran[m.id].append(i)
            if (doc := _verdict(per[m.id][i], by_s, failed, out, clean)) is not None:
                summaries[m.id].append(doc)
        alive = [m for m in alive if not _detected(summaries[m.id], [per[m.id][k] for k in ran[m.id]], by_s,
                                                   failed)]
    triage = triage() if callable(triage) else triage
    outcomes = [_judge_one(m, [per[m.id][k] for k in ran[m.id]], scenarios, summaries[m.id], by_s, failed,
                           triage) for m in mutants]
    t_all = clock() - t0
    doc = {"score": score(outcomes), "scenarios": [s.name for s in scenarios], "stages": stages,
           "timing": {"clean_s": t_clean, "mutant_runs_s": t_run, "compare_s": t_all - t_clean - t_run,
                      "total_s": t_all, "per_mutant_s": (t_all - t_clean) / max(len(mutants), 1),
                      "mutant_sides": sum(len(v) for v in ran.values())},
           "mutants": [o.to_json() for o in outcomes]}
    write_json(out / "mutants.json", doc)
    return doc


def same_trace(a: Path, b: Path) -> bool:
    """Every rank file of two traces byte for byte equal (the manifests name their keys).
    Two runs of equal code on one machine write equal bytes, so a mutant whose trace equals the
    clean candidate's computed what clean code computes: its verdict is the clean one."""
    def files(t: Path) -> list[Path]:
        return sorted(p.relative_to(t) for p in t.rglob("*") if p.is_file() and p.name not in _NOT_TRACE)

    ours, other = files(a), files(b)
    return ours == other and all(filecmp.cmp(a / f, b / f, shallow=False) for f in ours)


# Files of a trace folder that name the side rather than hold what it computed.
_NOT_TRACE = ("manifest.json", "mutant.json", "lines.json")


def reached(trace_dir: Path) -> bool | None:
    """Whether a mutant's lines ran on any rank of its side (None: not recorded)."""
    seen = [json.loads(p.read_text()).get("reached")
            for p in sorted(Path(trace_dir).glob("rank*/mutant.json"))]
    return None if not seen or None in seen else any(seen)


def _verdict(s, by_s: dict, failed: dict, out: Path, clean: dict) -> dict | None:
    """One mutant scenario's summary (None: its side crashed, timed out or left no trace)."""
    roles = by_s[s.name]
    if any(j.key in failed
           for j in mutant_jobs(roles)) or not trace.is_complete(roles["candidate"].trace_dir):
        return None
    base = clean[s.name.rsplit("@", 1)[0]]
    if same_trace(Path(roles["candidate"].trace_dir), Path(base["candidate"].trace_dir)):
        return {"scenario": s.name, "verdict": Verdict.PASS, "identical_to_clean": True}
    return _compare(s, roles, out).to_json()


def _detected(summaries: list[dict], scenarios: list, by_s: dict, failed: dict) -> bool:
    return any(d["verdict"] == Verdict.FAIL for d in summaries) or any(
        j.key in failed for s in scenarios for j in mutant_jobs(by_s[s.name]))


def _judge_one(m: Mutant, run: list, matrix: list, summaries: list[dict], by_s: dict, failed: dict,
               triage: dict) -> Outcome:
    """A mutant's outcome over the scenarios it ran (``run``; the others of ``matrix`` it either
    never reached, or was detected before)."""
    o = Outcome(m)
    jobs = [j for s in run for j in mutant_jobs(by_s[s.name])]
    judge(o, summaries, failed, jobs)
    reach = [reached(Path(j.trace_dir)) for j in jobs]
    o.reached = None if None in reach else any(reach)
    if o.status == SURVIVED and o.reached is False:  # its lines ran nowhere it ran, nor where it was not run
        names = ", ".join(s.name for s in matrix)
        o.status, o.reason = UNREACHABLE, f"the mutated line(s) never ran in {names}"
    equivalent = triage.get(m.id, {}).get("status") == EQUIVALENT  # in any configuration, reached or not
    if m.id in triage and (o.status == SURVIVED or o.status == UNREACHABLE and equivalent):
        o.status, o.reason = triage[m.id]["status"], triage[m.id]["reason"]
    return o
