"""A fuzz campaign: draw, judge in batches, shrink what fails, cluster, write what is done.

The state lives in ``OUT/fuzz.json``, rewritten after every batch and shrink: the same command
on the same folder continues a campaign (its seed, space, tree and faults must match; draws
are a function of the seed and of the draws before, so a resumed campaign draws what an
uninterrupted one would). Ctrl-C keeps what is done.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import tomli_w

from harness.common.errors import BadInput
from harness.common.jsonio import write_json
from harness.compare.summary import FirstDivergence, ScenarioSummary, Verdict
from harness.fuzz import page
from harness.fuzz.cluster import (
    Cluster, fingerprint, known_as, needs_of, recorded_divergences, tensor_pattern,
)
from harness.fuzz.runner import Runner, is_finding, scenario_document
from harness.fuzz.reach import reach_seeds, seed_label
from harness.fuzz.shrink import shrink
from harness.fuzz.space import Coverage, Draw, Space, draw_for

FORMAT = 1


@dataclass
class Settings:
    """What a campaign is: its seed, space, tree and faults (a resume must match them), and how
    it runs (budgets and batch size may change between runs)."""

    seed: int
    space: Space
    megatron_core: str = "installed"
    inject: tuple[str, ...] = ()
    budget_s: float = 3600.0
    max_pairs: int | None = None
    shrink_s: float = 600.0
    batch: int = 8
    jobs: int = 2
    warm: bool = True
    """Launches on warm workers kept across batches (:mod:`harness.fuzz.runner`); False: a launch
    of its own per batch and world size."""
    recorded: Path | None = None
    """Where the shipped scenarios with ``[expect]`` are (a cluster matching one is known)."""
    node: int = 0
    nodes: int = 1
    """A campaign spread over ``nodes`` machines: each draws every index (draws depend on the
    coverage of all before them) and judges those ``node`` is given (index mod nodes);
    :mod:`harness.fuzz.merge` folds the nodes' folders into one campaign."""

    def identity(self) -> dict:
        spread = {"node": [self.node, self.nodes]} if self.nodes > 1 else {}
        return {"format": FORMAT, "seed": self.seed, "space": self.space.digest(),
                "megatron_core": self.megatron_core, "inject": list(self.inject), **spread}


@dataclass
class State:
    identity: dict
    judged: list[dict] = field(default_factory=list)
    refused: Counter = field(default_factory=Counter)
    clusters: list[Cluster] = field(default_factory=list)
    elapsed_s: float = 0.0
    pair_s: float = 0.0
    """Seconds spent judging drawn pairs (not shrinking)."""
    next_index: int = 0
    drawn_elsewhere: list[dict] = field(default_factory=list)
    """The draws other nodes judge (:attr:`Settings.nodes`): coverage counts them here too."""
    aimed: list[str] = field(default_factory=list)
    """The seeds every draw started from (:mod:`harness.fuzz.reach`), shown; [] for unaimed draws."""

    def to_json(self, settings: Settings, coverage: Coverage) -> dict:
        values, pairs = coverage.reachable(settings.space)
        return {"identity": self.identity, "space": settings.space.to_json(), "judged": self.judged,
                "refused": dict(self.refused.most_common()), "clusters": [c.to_json() for c in self.clusters],
                "elapsed_s": round(self.elapsed_s, 1), "pair_s": round(self.pair_s, 1),
                "coverage": {"values": len(coverage.values), "values_in_space": values,
                             "pairs": len(coverage.pairs), "pairs_in_space": pairs},
                "throughput": throughput(self), "errors": run_errors(self.judged),
                "next_index": self.next_index,
                **({"drawn_elsewhere": self.drawn_elsewhere} if self.drawn_elsewhere else {}),
                **({"aimed": self.aimed} if self.aimed else {})}


def run_errors(judged: list[dict]) -> dict[str, list[str]]:
    """Pairs whose run failed (not a verdict: the harness's, a launch's, or a tree refusing at run
    time what the rules accepted), grouped by what failed."""
    out: dict[str, list[str]] = {}
    for j in judged:
        if j["verdict"] != "error":
            continue
        message = next(iter((j.get("error") or {}).values()), "unknown")
        what = re.sub(r"; log: .*", "", re.sub(r"^.* raised at step \S+: ", "", message))
        out.setdefault(re.sub(r"\s+", " ", what)[:240], []).append(j["name"])
    return out


def throughput(state: State) -> dict:
    """Pairs judged per hour of judging, and the time shrinks took."""
    n = len(state.judged)
    shrinks = [c.shrink for c in state.clusters if c.shrink]
    return {"pairs": n, "pairs_per_hour": round(3600 * n / state.pair_s, 1) if state.pair_s else None,
            "shrink_s": [s.get("seconds") for s in shrinks],
            "shrink_runs": [s.get("runs") for s in shrinks]}


def read_state(path: Path, hint: str = "") -> dict:
    """A campaign's (or a node's) ``fuzz.json``; anything else is refused, naming the file."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        doc["identity"] = dict(doc["identity"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BadInput(str(path), f"not a campaign's state ({type(e).__name__}: {e}){hint}") from None
    return doc


def _load_state(out: Path, settings: Settings) -> tuple[State, Coverage]:
    path, coverage = out / "fuzz.json", Coverage()
    if not path.exists():
        return State(identity=settings.identity()), coverage
    doc = read_state(path, "; choose another --out")
    identity = doc["identity"]
    if identity != settings.identity():
        differs = sorted(k for k in identity.keys() | settings.identity().keys()
                         if identity.get(k) != settings.identity().get(k))
        raise BadInput(str(path), f"holds a campaign of another {', '.join(differs)}: run it with the "
                       "same --seed, --space, --megatron-core and --inject to continue it, or choose another "
                       "--out")
    state = State(identity=identity, judged=doc["judged"], refused=Counter(doc["refused"]),
                  clusters=[Cluster.from_json(c) for c in doc["clusters"]], elapsed_s=doc["elapsed_s"],
                  pair_s=doc["pair_s"], drawn_elsewhere=doc.get("drawn_elsewhere", []),
                  next_index=doc.get("next_index", len(doc["judged"]) and doc["judged"][-1]["index"] + 1))
    for d in [j["draw"] for j in state.judged] + state.drawn_elsewhere:
        coverage.add(Draw.from_json(d))
    return state, coverage


def run(settings: Settings, out: Path, say=print) -> dict:
    """Run (or continue) a campaign in ``out``; return its document (``fuzz.json``)."""
    out.mkdir(parents=True, exist_ok=True)
    with only_campaign(out):
        return _run(settings, out, say)


@contextlib.contextmanager
def only_campaign(out: Path):
    """One campaign at a time in a folder: two would launch into each other's batch and warm
    worker folders and fail in ways that name neither. The lock goes with the process."""
    lock = open(out / ".lock", "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        who = lock.read().strip()
        lock.close()
        raise BadInput(str(out), f"another campaign is running in this folder (process {who or 'unknown'}): "
                       "wait for it to end, or choose another --out") from None
    try:
        lock.seek(0)
        lock.truncate()
        lock.write(str(os.getpid()))
        lock.flush()
        yield
    finally:
        lock.close()


def _run(settings: Settings, out: Path, say) -> dict:
    state, coverage = _load_state(out, settings)
    runner = Runner(settings, out)
    runner.batches = max((int(p.name.split("-")[1]) for p in (out / "runs").glob("batch-*")), default=0) \
        if (out / "runs").exists() else 0
    recorded = recorded_divergences(settings.recorded) if settings.recorded else []
    seeds = reach_seeds(settings.space, settings.inject)  # [] unless a planted fault needs settings
    state.aimed = [seed_label(s) for s in seeds]
    started, before = time.monotonic(), state.elapsed_s
    try:
        while True:
            state.elapsed_s = before + time.monotonic() - started
            left = settings.budget_s - state.elapsed_s
            if left <= 0 or (settings.max_pairs is not None and len(state.judged) >= settings.max_pairs):
                break
            b = _next_batch(state, settings, coverage, runner, seeds)
            if not b.draws:
                refused = state.refused + b.refused
                raise BadInput("--space", "the rules refuse every draw of this space: "
                               + "; ".join(f"{r} ({n}x)" for r, n in refused.most_common(3)))
            names = [f"fuzz-{settings.seed}-{i:05d}" for i in b.indices]
            t0 = time.monotonic()
            summaries = runner.judge(b.draws, names)
            state.pair_s += time.monotonic() - t0
            for index, name, d, s in zip(b.indices, names, b.draws, summaries):
                state.judged.append(_judged(index, name, d, s))
            state.refused.update(b.refused)
            state.drawn_elsewhere += b.elsewhere
            state.next_index = b.next_index
            _settle(state, settings, runner, recorded, out, say)
            state.elapsed_s = before + time.monotonic() - started
            _write(state, settings, coverage, out)
            _progress(state, settings, say)
    except KeyboardInterrupt:
        say("\ngtp-parity fuzz: interrupted; what is done is kept")
    finally:
        runner.close()  # no warm worker outlives the campaign
    state.elapsed_s = before + time.monotonic() - started
    return _write(state, settings, coverage, out)


@dataclass
class Batch:
    """The next draws a node judges, with what drawing them saw: committed to the state once they
    are judged (an interrupted batch is drawn again on resume, as an uninterrupted one would)."""

    draws: list[Draw] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)
    elsewhere: list[dict] = field(default_factory=list)
    """The other nodes' draws among them (coverage counts them on every node)."""
    refused: Counter = field(default_factory=Counter)
    next_index: int = 0


def _next_batch(state: State, settings: Settings, coverage: Coverage, runner: Runner, seeds: list) -> Batch:
    """Every index is drawn on every node (a draw depends on the coverage of all before it); this
    node keeps the indices it is given (index mod nodes)."""
    b, index = Batch(), state.next_index
    while len(b.draws) < settings.batch and index < state.next_index + settings.batch * settings.nodes:
        own = index % settings.nodes == settings.node
        if own and settings.max_pairs is not None and len(state.judged) + len(b.draws) >= settings.max_pairs:
            break
        d, refused = draw_for(settings.space, settings.seed, index, coverage, runner.refusal, seeds)
        if own:
            b.refused.update(refused)
        if d is not None:
            coverage.add(d)
            if own:
                b.draws.append(d)
                b.indices.append(index)
            else:
                b.elsewhere.append(d.to_json())
        index += 1
    b.next_index = index
    return b


def _judged(index: int, name: str, d: Draw, s: ScenarioSummary | None) -> dict:
    fd = s.first_divergence if s is not None else None
    return {"index": index, "name": name, "draw": d.to_json(), "verdict": s.verdict.value if s else "refused",
            "finding": bool(s is not None and is_finding(s)), "fingerprint": list(fingerprint(fd) or []),
            "pattern": tensor_pattern(fd), "first_divergence": fd.to_json() if fd else None,
            "error": dict(s.error) if s is not None and s.verdict == Verdict.ERROR else None, "cluster": None}


def _settle(state: State, settings: Settings, runner: Runner, recorded, out: Path, say) -> None:
    """Each new finding joins a cluster whose needs it holds, or is shrunk into a new one."""
    for j in state.judged:
        if not j["finding"] or j["cluster"] is not None:
            continue
        d, fp = Draw.from_json(j["draw"]), tuple(j["fingerprint"])
        home = next((c for c in state.clusters if c.fingerprint == fp and c.pattern == j["pattern"]
                     and c.holds(d)),
                    None)
        if home is None:
            fd = FirstDivergence.from_json(j["first_divergence"])
            deadline = time.monotonic() + min(settings.shrink_s, max(settings.budget_s - state.elapsed_s, 0))
            say(f"gtp-parity fuzz: {j['name']} fails ({'/'.join(fp)}); shrinking")
            shrunk = shrink(d, fd, settings.space, runner.first_divergences, deadline)
            needs = needs_of(shrunk.draw, eager=shrunk.eager)
            home = next((c for c in state.clusters if c.fingerprint == fp and c.pattern == j["pattern"]
                         and c.needs == needs), None)
            if home is None:
                home = Cluster(id=f"C{len(state.clusters) + 1}", fingerprint=fp, pattern=j["pattern"],
                               needs=needs,
                               minimal=shrunk.draw.to_json(), example=j["first_divergence"],
                               shrink=shrunk.to_json())
                if shrunk.first is not None:  # what the minimal scenario shows (eager: maybe earlier)
                    home.shrink["step"] = shrunk.first.step
                home.known = known_as(home, recorded)
                home.scenario_file = _write_scenario(home, shrunk.draw, settings, runner, out)
                state.clusters.append(home)
        home.members.append(j["name"])
        j["cluster"] = home.id


def _write_scenario(c: Cluster, draw: Draw, settings: Settings, runner: Runner, out: Path) -> str:
    """The minimal draw as a scenario file, ``[expect]`` recording the divergence as found."""
    name = f"fuzz-{settings.seed}-{c.id.lower()}"
    doc = runner.document(draw, name)
    sig = c.fingerprint[0]
    doc["description"] = (f"found by gtp-parity fuzz (seed {settings.seed}), shrunk to what it needs: "
                          f"{', '.join(c.needs)}"
                          + ("; with eager collectives, where the race shows on every run"
                             if c.shrink.get("eager") else ""))
    doc["expect"] = {"reason": "found by gtp-parity fuzz; root cause not settled yet",
                     **({"signature": sig, "step": c.shrink.get("step", c.example.get("step"))}
                        if sig != "raised"
                        else {"raises": str(c.example.get("tensor", "")).partition(": ")[2][:120]})}
    doc["expect"] = {k: v for k, v in doc["expect"].items() if v is not None}
    path = out / "scenarios" / f"{name}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(doc), encoding="utf-8")
    return str(path.relative_to(out))


STAGES = 12


def _write_stages(state: State, settings: Settings, out: Path) -> None:
    """The first passing pairs as a matrix (``OUT/stages.toml``): scenarios other tools can run as
    their stages (``gtp-parity mutate --matrix``), each a configuration nobody wrote down."""
    passing = [j for j in state.judged if j["verdict"] == "pass"][:STAGES]
    if not passing:
        return
    pairs = []
    for j in passing:
        doc = scenario_document(settings, Draw.from_json(j["draw"]), j["name"])  # no planted fault
        pairs.append({"label": j["name"], **{k: v for k, v in doc.items() if k not in ("name", "timeout_s")}})
    matrix = {"name": f"fuzz-{settings.seed}-stages", "timeout_s": settings.space.timeout_s,
              "description": f"passing pairs of gtp-parity fuzz (seed {settings.seed})",
              "matrix": {"name": "{pair}", "axes": {"pair": pairs}}}
    (out / "stages.toml").write_text(tomli_w.dumps(matrix), encoding="utf-8")


def _write(state: State, settings: Settings, coverage: Coverage, out: Path) -> dict:
    doc = state.to_json(settings, coverage)
    write_json(out / "fuzz.json", doc)
    _write_stages(state, settings, out)
    page.write(doc, out / "index.html")
    return doc


def _progress(state: State, settings: Settings, say) -> None:
    left = max(settings.budget_s - state.elapsed_s, 0)
    findings = sum(j["finding"] for j in state.judged)
    line = (f"gtp-parity fuzz: {len(state.judged)} pairs judged, {findings} failing, {len(state.clusters)} "
            f"cluster(s), {sum(state.refused.values())} draws refused, {left / 60:.1f} min left")
    if sys.stdout.isatty() and say is print:
        print("\r" + line, end="", flush=True)
    else:
        say(line)
