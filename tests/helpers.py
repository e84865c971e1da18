"""Helpers shared by the tests that launch real runs."""

import json
import os
from pathlib import Path

import pytest

import pandas as pd
import torch

from harness.compare import bounds
from harness import scenario
from harness.capture import trace
from harness.backends import data as data_mod
from harness.compare.assemble import assemble_trace
from harness.backends.torch.model import GPT, token_losses
from harness.backends.gpt import canonical_state
from harness.run.repos import configured, env_name
from harness.scenario.tree_specs import parse_spec
from harness.session import run_scenarios

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "tests" / "assets"
MAIN_TREE = os.environ.get("GTP_PARITY_MAIN_TREE", "git:megatron-lm@d98e8a64dd")
"""Megatron-LM main as of 2026-08-22, for the tests that run on it (where its repository is)."""


def needs_repositories(*specs: str) -> None:
    """Skip, naming what to configure, where a spec's tree is not on this machine: a ``git:``
    spec's name configured nowhere, or a folder that is not there (a URL is cloned)."""
    missing = []
    for spec in sorted(set(specs)):
        parsed = parse_spec(spec)
        folder = parsed.kind == "path" or parsed.names == "folder"
        if parsed.names == "name" and configured(parsed.repo) is None:
            missing.append(f"{spec} (the repository {parsed.repo!r}: set {env_name(parsed.repo)})")
        elif folder and not Path(parsed.repo).expanduser().exists():
            missing.append(f"{spec} (no folder {parsed.repo})")
    if missing:
        pytest.skip("not on this machine: " + ", ".join(missing) + "; see docs/code-under-test.md")


def at_revision(spec: str, rev: str) -> str:
    """A ``git:`` spec's repository at another revision."""
    return f"git:{parse_spec(spec).repo}@{rev}"


def run(path, out: Path, **kw) -> tuple[int, dict]:
    """Run a scenario or matrix file (or loaded scenarios) into ``out``; return (exit code, run
    summary)."""
    scenarios = path if isinstance(path, list) else scenario.load(path)
    code = run_scenarios(scenarios, out, parallel=kw.get("parallel", 1))
    return code, json.loads((out / "summary.json").read_text())


def scenario_dir(out: Path, name: str) -> Path:
    return out / "scenarios" / name


def results(out: Path, name: str) -> pd.DataFrame:
    return pd.read_csv(scenario_dir(out, name) / "results.csv")


def summary(out: Path, name: str) -> dict:
    return json.loads((scenario_dir(out, name) / "summary.json").read_text())


def step1_partial_grad_bound(sc: scenario.Scenario) -> dict[str, torch.Tensor]:
    """Element-wise bound on how far two correct fp32 runs' step-1 main_grads may part when they
    sum the same per-micro-batch partial gradients in another order (GTP reduce-scatter vs DP
    all-reduce, accumulation per micro-batch vs per reduction).

    Both sides start from the same weights and read the same micro-batches, so each partial is
    the same computation; the ``K = global batch / micro-batch`` partials (and the scalings by
    1/G, 1/DP, 1/micro-batches: one rounding each at most, counted as 2 terms) are summed in two
    orders, which differ by at most ``2 gamma_(K+1) sum_k |p_k|`` (:func:`bounds.reorder_bound`).
    ``sum_k |p_k|`` is taken in fp64 from the golden model, sample by sample (a micro-batch's
    |partial| is at most the sum of its samples'), times 2: the fp32 partials are the same
    values to about 1e-6 relative (fp32 vs fp64 logits agree within 1.3e-6).
    """
    m, d = sc.model, sc.data
    model = GPT(m).double()
    state = canonical_state(m, sc.golden.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(state[name].double())
    ids = data_mod.step_sample_ids(1, d)
    tokens, labels = data_mod.batch(d.seed, ids, m)
    abs_sum = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    for i in range(len(ids)):
        model.zero_grad(set_to_none=True)
        (token_losses(model(tokens[i : i + 1]), labels[i : i + 1]).mean() / len(ids)).backward()
        for name, p in model.named_parameters():
            abs_sum[name] += p.grad.abs()
    partials = d.global_batch_size // d.micro_batch_size
    return {name: bounds.reorder_bound(partials + 2, 2 * s) for name, s in abs_sum.items()}


def step1_main_grads(out: Path, name: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Logical step-1 main_grads of a scenario's reference and candidate: name -> (ref, cand)."""
    paths = summary(out, name)["traces"]
    ref, cand = (assemble_trace(trace.read(paths[role])) for role in ("reference", "candidate"))
    return {key[2]: (t, cand.tensors[key]) for key, t in ref.tensors.items()
            if key[0] == 1 and key[1] == "main_grad"}


def assert_grads_differ_by_order_only(out: Path, sc: scenario.Scenario) -> int:
    """Every step-1 main_grad element within :func:`step1_partial_grad_bound`; returns the
    number of tensors checked. Premise: the step-1 forward is bitwise equal on both sides."""
    bound = step1_partial_grad_bound(sc)
    grads = step1_main_grads(out, sc.name)
    for name, (r, c) in grads.items():
        over = (c.double() - r.double()).abs() - bound[name]
        assert over.max() <= 0, f"{name}: {float(over.max()):.3g} over the reordering bound"
    return len(grads)
