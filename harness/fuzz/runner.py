"""Judging a campaign's draws: each draw a scenario, a batch of them run through the session.

Launches go to warm workers (:class:`harness.run.warm.WarmPool`, one per world size and tree,
kept across batches and shrinks) unless the campaign turns them off (``gtp-parity fuzz --cold``):
the traces are the same either way, only the start-up paid per batch differs.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from harness.common.errors import BadInput, HarnessError
from harness.compare.summary import FirstDivergence, ScenarioSummary, Verdict
from harness.fuzz.space import Draw
from harness.run.warm import WarmPool
from harness.run.trees import holds, resolve
from harness.scenario import checkpoint as checkpointing
from harness.scenario.checkpoint import EXPERT_TOPOLOGY_FIX
from harness.scenario import parse_scenario
from harness.scenario.rules import validate
from harness.session import run_scenarios, skip_reason


def scenario_document(settings, draw: Draw, name: str, inject: tuple[str, ...] = ()) -> dict:
    """A draw's scenario document on the campaign's tree, with the faults ``inject`` planted."""
    doc = draw.document(settings.space, name, inject)
    if settings.megatron_core != "installed":
        doc["train"]["megatron_core"] = settings.megatron_core
    return doc


class Runner:
    """Judges draws: each becomes a scenario, a batch runs through the session (sides of one world
    size share launches), and each pair's first divergence is read back from its summary. The
    traces of a batch are removed once judged (a finding's minimal scenario reproduces it)."""

    def __init__(self, settings, out: Path):
        self.settings, self.out, self.batches = settings, out, 0
        self._topology_fix: dict[str, bool] = {}  # megatron-core spec -> holds EXPERT_TOPOLOGY_FIX
        # Warm workers (one per world size and tree) serve every batch and shrink; closed by close().
        self.pool = WarmPool(out / "warm") if settings.warm else None

    def close(self) -> None:
        """End the warm workers (the campaign's end, or Ctrl-C)."""
        if self.pool is not None:
            self.pool.close()

    def document(self, draw: Draw, name: str) -> dict:
        return scenario_document(self.settings, draw, name, self.settings.inject)

    def scenario(self, draw: Draw, name: str):
        doc, source = self.document(draw, name), f"fuzz draw {name}"
        if "checkpoint" in doc:  # one topology loaded into: the scenario keeps the pair's name
            [s] = checkpointing.expand(doc, source, parse_scenario, validate)
            s = dataclasses.replace(s, name=name)
        else:
            s = parse_scenario(doc, source)
        if (reason := skip_reason(s)) is not None:
            raise BadInput(f"fuzz draw {name}", reason)
        if s.saver is not None:  # what a checkpoint's loader takes depends on the tree, as before a run
            checkpointing.check_expert_optimizers(s, self._holds_topology_fix)
        return s

    def _holds_topology_fix(self, side) -> bool:
        spec = side.megatron_core
        if spec not in self._topology_fix:  # resolved once a campaign: draws are refused by the thousand
            self._topology_fix[spec] = holds(resolve(spec, "--megatron-core"), *EXPERT_TOPOLOGY_FIX)
        return self._topology_fix[spec]

    def refusal(self, draw: Draw) -> str | None:
        """Why the rules refuse a draw (its message without the draw's name), or None."""
        try:
            self.scenario(draw, "probe")
        except BadInput as e:
            return _reason(str(e))
        except Exception as e:  # the rules themselves failed: a harness bug, named, and the draw refused
            return f"HARNESS: validate raised {type(e).__name__}: {e}"
        return None

    def judge(self, draws: list[Draw], names: list[str] | None = None) -> list[ScenarioSummary | None]:
        """Each draw's summary (None: refused). A run that failed is judged again alone: a crash
        ends the launch it shares, and the pairs beside it must not be blamed for it."""
        out = self._batch(draws, names)
        if len(draws) > 1:
            for i, s in enumerate(out):
                if s is not None and s.verdict == Verdict.ERROR:
                    out[i] = self._batch([draws[i]], [names[i]] if names else None)[0]
        return out

    def _batch(self, draws: list[Draw], names: list[str] | None) -> list[ScenarioSummary | None]:
        self.batches += 1
        names = names or [f"shrink-{self.batches:04d}-{i:02d}" for i in range(len(draws))]
        runnable, out = {}, []
        for d, name in zip(draws, names):
            try:
                runnable[name] = self.scenario(d, name)
            except BadInput:
                continue
        folder = self.out / "runs" / f"batch-{self.batches:04d}"
        if runnable:
            try:
                run_scenarios(list(runnable.values()), folder, parallel=self.settings.jobs, fresh=True,
                              pool=self.pool)
            except HarnessError as e:  # the harness failed judging (a trace it cannot read): not a
                # finding; each pair is a failed run, judged again alone by judge() where it shared
                why = {"harness": f"{type(e).__name__}: {e}"}
                return [ScenarioSummary.of(scenario=n, verdict=Verdict.ERROR, error=why) if n in runnable
                        else None for n in names]
        for name in names:
            path = folder / "scenarios" / name / "summary.json"
            out.append(ScenarioSummary.from_json(json.loads(path.read_text())) if name in runnable
                       and path.exists() else None)
        shutil.rmtree(folder / "traces", ignore_errors=True)
        return out

    def first_divergences(self, draws: list[Draw]) -> list[FirstDivergence | None]:
        return [s.first_divergence if s is not None and is_finding(s) else None for s in self.judge(draws)]


def is_finding(s: ScenarioSummary) -> bool:
    """A pair that fails: a first divergence beyond the expectations, or the code under test
    raising on one side (a run that failed otherwise is the harness's, not a finding)."""
    return s.verdict == Verdict.FAIL and s.first_divergence is not None


def _reason(message: str) -> str:
    """A refusal's reason without the draw's name: ``fuzz draw probe: [candidate]: why`` -> ``[candidate]:
    why``."""
    return message.split(": ", 1)[1] if message.startswith("fuzz draw") else message
