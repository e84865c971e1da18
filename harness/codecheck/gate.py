"""``gtp-parity canary`` and ``gtp-parity gate``: a matrix on two megatron-core trees.

The gate runs every scenario on the base tree and on the head tree (their GTP on/off verdicts
side by side) and, per scenario, a code comparison: the scenario's candidate on base vs head,
judged ``exact``. It fails when a code comparison finds a difference, or when a scenario's
verdict on head is not one a gate lets through while base's is: the question a PR's CI asks is
"does this commit change what GTP trains?".
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from harness import scenario
from harness.common.errors import EXIT_PARITY_FAIL, EXIT_PASS
from harness.compare.summary import ScenarioSummary, Verdict
from harness.scenario.tree_specs import with_code
from harness.session import run_scenarios

CANARY = Path(__file__).with_name("canary.toml")
KINDS = ("base", "head", "code")


def canary(spec: str, out: Path) -> int:
    """The canary scenario on ``spec``'s tree."""
    return run_scenarios(with_code(scenario.load(CANARY), every=spec), out, verbose=True)


def gate_scenarios(scenarios: list, base: str, head: str) -> list:
    """Each scenario three times: on base, on head, and as base-vs-head code comparison."""
    out = []
    for s in scenarios:
        for kind, (every, ref, cand) in zip(KINDS,
                                            ((base, None, None), (head, None, None), (None, base, head))):
            (t,) = with_code([s], every=every, reference=ref, candidate=cand)
            out.append(dataclasses.replace(t, name=f"{s.name}@{kind}"))
    return out


def gate_table(out: Path, names: list[str]) -> tuple[list[str], bool]:
    """The gate's lines (one per scenario) and whether it passes."""
    summaries = {d["scenario"]: ScenarioSummary.from_json(d)
                 for d in json.loads((out / "summary.json").read_text())["scenarios"]}
    lines, ok = [f"{'scenario':40s} {'base':18s} {'head':18s} code (base vs head, exact)"], True
    for name in names:
        got = {k: summaries.get(f"{name}@{k}") for k in KINDS}
        verdicts = {k: (s.verdict if s else Verdict.ERROR) for k, s in got.items()}
        code = got["code"]
        if code is not None and code.first_divergence is not None:
            fd = code.first_divergence
            change = f"CHANGED at step {fd.step} {fd.kind} {fd.tensor} ({fd.signature})"
        else:
            change = "bitwise" if verdicts["code"] == Verdict.PASS else f"{verdicts['code']}"
        regressed = verdicts["base"].passes_gate and not verdicts["head"].passes_gate
        ok &= verdicts["code"] == Verdict.PASS and not regressed
        lines.append(f"{name:40s} {verdicts['base']:18s} {verdicts['head']:18s} {change}"
                     + ("  <- regressed" if regressed else ""))
    return lines, ok


def gate(matrix: str, base: str, head: str, out: Path, parallel: int = 2, limits: bool = True) -> int:
    scenarios = scenario.load(matrix, limits=limits)
    run_scenarios(gate_scenarios(scenarios, base, head), out, parallel=parallel, verbose=True)
    lines, ok = gate_table(out, [s.name for s in scenarios])
    print("\n" + "\n".join(lines))
    print(f"gate: {'PASS' if ok else 'FAIL'}: base {base} vs head {head}")
    return EXIT_PASS if ok else EXIT_PARITY_FAIL
