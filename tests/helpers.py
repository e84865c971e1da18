"""Helpers shared by the tests that launch real runs."""

import json
from pathlib import Path

import pandas as pd

from harness import scenario
from harness.session import run_scenarios

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "tests" / "assets"


def run(path, out: Path, **kw) -> tuple[int, dict]:
    """Run a scenario or matrix file into ``out``; return (exit code, run summary)."""
    code = run_scenarios(scenario.load(path), out, parallel=kw.get("parallel", 1))
    return code, json.loads((out / "summary.json").read_text())


def scenario_dir(out: Path, name: str) -> Path:
    return out / "scenarios" / name


def results(out: Path, name: str) -> pd.DataFrame:
    return pd.read_csv(scenario_dir(out, name) / "results.csv")


def summary(out: Path, name: str) -> dict:
    return json.loads((scenario_dir(out, name) / "summary.json").read_text())
