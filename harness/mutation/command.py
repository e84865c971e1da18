"""``gtp-parity mutate``: generate, run and score mutants; ``--show ID`` explains one."""

from __future__ import annotations

import json
from pathlib import Path

from harness.common.errors import BadInput
from harness.scenario.mutants import OPT_IN, TARGETS, Mutant, applicable, diff, find, mutants_of

DEFAULT_MATRIX = "scenarios/mutate.toml"
TRIAGE = Path(__file__).resolve().parent / "triage.toml"


def _targets(names: list[str] | None) -> list[str]:
    if not names:
        return list(TARGETS)
    unknown = [n for n in names if n not in TARGETS and n not in OPT_IN]
    if unknown:
        raise BadInput("--target",
                       f"{unknown[0]!r} is not a module of the GTP path; known: "
                       f"{', '.join([*TARGETS, *OPT_IN])}")
    return names


def show(out: Path, mutant_id: str) -> int:
    path = out / "mutants.json"
    if not path.is_file():
        raise BadInput("--out", f"{out} holds no campaign (no mutants.json)")
    doc = json.loads(path.read_text())
    entry = next((m for m in doc["mutants"] if m["id"] == mutant_id), None)
    if entry is None:
        raise BadInput("--show", f"{mutant_id!r} is not a mutant of the campaign in {out}")
    fields = Mutant.__dataclass_fields__
    m = Mutant(**{k: entry[k] for k in fields})
    if not Path(m.file).is_file():  # a campaign run from another checkout: find it by identity here
        try:
            m = find(mutant_id)
        except KeyError as e:
            raise BadInput("--show", str(e.args[0])) from None
    print(diff(m))
    print(f"status: {entry['status']}" + (f" ({entry['reason']})" if entry.get("reason") else ""))
    for scenario, verdict in entry["verdicts"].items():
        print(f"  {scenario}: {verdict}")
    fd = entry.get("first_divergence")
    if fd:
        print(f"first divergence ({entry['scenario']}): step {fd['step']} {fd['phase']} {fd['kind']} "
              f"{fd['tensor']} ranks {fd.get('ranks')} signature {fd['signature']}")
        if fd.get("update"):
            print(f"  {fd['update']['text']}")
        print(f"expected kinds from {m.function}: {', '.join(entry['expected_kinds'])}; "
              f"localized: {'yes' if entry['localized'] else 'no'}")
    return 0


def retriage(out: Path) -> dict:
    """Apply the current triage file to a finished campaign's survivors (no run)."""
    from harness.mutation.campaign import EQUIVALENT, SURVIVED, UNREACHABLE, Outcome, read_triage, score
    from harness.common.jsonio import write_json

    path = out / "mutants.json"
    if not path.is_file():
        raise BadInput("--out", f"{out} holds no campaign (no mutants.json)")
    doc = json.loads(path.read_text())
    triage = read_triage(TRIAGE)
    outcomes = []
    for entry in doc["mutants"]:
        if entry["status"] in (SURVIVED, EQUIVALENT, UNREACHABLE) and entry["id"] in triage:
            entry.update(status=triage[entry["id"]]["status"], reason=triage[entry["id"]]["reason"])
        m = Mutant(**{k: entry[k] for k in Mutant.__dataclass_fields__})
        outcomes.append(Outcome(m, status=entry["status"], localized=entry.get("localized")))
    doc["score"] = score(outcomes)
    write_json(path, doc)
    return doc


def _print_score(doc: dict, out: Path) -> None:
    from harness.mutation import page

    s = doc["score"]
    o, loc = s["overall"], s["localization"]
    print(f"killed {o['killed']}, crashed {o['crashed']}, timeout {o['timeout']}, survived {o['survived']}, "
          f"equivalent {o['equivalent']}, unreachable {o['unreachable']} of {o['total']}: score "
          f"{o['score']:.1%}" if o["score"] is not None else "no mutant scored")
    if o.get("score_reached") is not None:
        print(f"score where the matrix reaches the mutated lines: {o['score_reached']:.1%}")
    if loc["accuracy"] is not None:
        print(f"localization accuracy: {loc['accuracy']:.1%} ({loc['localized']} / {loc['killed']})")
    t = doc["timing"]
    sides = f"; {t['mutant_sides']} mutant side(s) run" if "mutant_sides" in t else ""
    print(f"per mutant: {t['per_mutant_s']:.1f} s; total {t['total_s']:.0f} s{sides}")
    print(f"page: {page.write(doc, out)}; json: {out / 'mutants.json'}")


def main(args) -> int:
    from harness import scenario
    from harness.mutation.campaign import read_triage, run_campaign, select

    out = Path(args.out)
    if args.show:
        return show(out, args.show)
    if args.retriage:
        _print_score(retriage(out), out)
        return 0
    if out.exists() and not out.is_dir():
        raise BadInput("--out", f"{out} exists and is not a folder")
    if args.budget is not None and args.budget < 0:
        raise BadInput("--budget", f"{args.budget}: 0 (every mutant) or more")
    scenarios = scenario.load(args.matrix or DEFAULT_MATRIX)
    if bad := [s.name for s in scenarios if s.candidate.backend != "megatron"]:
        raise BadInput("--matrix", f"scenario {bad[0]}: mutants run on a megatron candidate")
    mutants = [m for t in _targets(args.target) for m in mutants_of(t, validate=False)]
    if args.mutant:  # these mutants only (e.g. a campaign's survivors against a wider matrix)
        known = {m.id: m for m in mutants}
        if missing := [i for i in args.mutant if i not in known]:
            raise BadInput("--mutant",
                           f"{missing[0]!r} is not a mutant of {', '.join(_targets(args.target))}")
        chosen = applicable([known[i] for i in dict.fromkeys(args.mutant)])
    else:
        chosen = select(mutants, args.budget or None)
    print(f"gtp-parity mutate: {len(mutants)} mutant(s) generated, {len(chosen)} run")
    doc = run_campaign(chosen, scenarios, out, timeout_s=args.timeout, per_launch=args.per_launch,
                       triage=lambda: read_triage(TRIAGE), warm=not args.cold)
    _print_score(doc, out)
    return 0
