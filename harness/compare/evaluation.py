"""Compare an evaluation's losses (kind ``eval``), from the traces' scalars
(:mod:`harness.backends.evaluation` records them).

Rows, at the step whose weights the evaluation read, after that step's optimizer update:

- ``eval_loss[sample S]``: sample S's loss, aligned by global sample id whatever rank read it
  (micro-batches of one sample), with the candidate ranks that read it;
- ``eval_loss[eval E]``: the loss evaluation E reports. It is the mean over the whole
  evaluation batch, so every rank reports the same value: each candidate rank's value is
  compared with the reference's on that rank (``rank_values``; ``cand_value`` is the furthest
  rank's, ``ranks`` those that differ), and candidate ranks that disagree among themselves fail
  the row as a replicated value that is not (``policy`` ``replica``).

A reported loss that fails while its per-sample losses agree is fitted by
:func:`partial_average`: the data ranks whose samples each rank's value is the mean of.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable

import torch

from harness.backends.evaluation import REPORTED, SAMPLE
from harness.capture.trace import Trace

MAX_SUBSET_RANKS = 12
"""Data ranks up to which :func:`partial_average` tries every subset (4095 of them)."""


def is_sample(row: dict) -> bool:
    return row["kind"] == "eval" and row["tensor"].startswith("eval_loss[sample")


def is_reported(row: dict) -> bool:
    return row["kind"] == "eval" and row["tensor"].startswith("eval_loss[eval")


def position(name: str) -> float:
    """Causal position within a step's evaluation: the samples' losses, then the reported ones."""
    number = float(name.rsplit(" ", 1)[-1].rstrip("]"))
    return number if name.startswith("eval_loss[sample") else 1e12 + number


def _by_side(traces: dict[str, Trace], name: str) -> dict[str, list[dict]]:
    return {role: [s for s in t.scalars if s["name"] == name] for role, t in traces.items()}


def rows(traces: dict[str, Trace], scalar_row: Callable[..., dict]) -> list[dict]:
    """Every ``eval`` row of a compare; ``scalar_row(step, name, ref, cand, golden)`` measures
    and judges one value as the scalars are."""
    samples, reported = _by_side(traces, SAMPLE), _by_side(traces, REPORTED)
    if not samples.get("reference") or not samples.get("candidate"):
        return []
    out = []
    per_sample = {role: _per_sample(recs) for role, recs in samples.items()}
    ref, cand, gold = (per_sample.get(r, {}) for r in ("reference", "candidate", "golden"))
    for key in sorted(set(ref) & set(cand)):
        step, sid = key
        g = gold[key][0] if key in gold else None
        row = scalar_row(step, f"eval_loss[sample {sid}]", ref[key][0], cand[key][0], g)
        out.append({**row, "kind": "eval", "sample_ids": [sid], "ranks": cand[key][1]})
    ref_r, cand_r, gold_r = (_reported(reported.get(r, [])) for r in ("reference", "candidate", "golden"))
    for key in sorted(set(ref_r) & set(cand_r)):
        step, index = key
        r_of, c_of = ref_r[key], cand_r[key]
        worst = max(c_of, key=lambda rk: (abs(c_of[rk] - r_of.get(rk, r_of[min(r_of)])), -rk))
        r = r_of.get(worst, r_of[min(r_of)])
        g = next(iter(gold_r[key].values())) if key in gold_r else None
        row = {**scalar_row(step, f"eval_loss[eval {index}]", r, c_of[worst], g), "kind": "eval"}
        row["rank_values"] = {str(rk): v for rk, v in sorted(c_of.items())}
        row["ranks"] = sorted(rk for rk, v in c_of.items() if v != r_of.get(rk, r_of[min(r_of)]))
        if len(set(c_of.values())) > 1:  # one value, the whole batch's mean, on every rank
            row.update(passed=False, policy="replica")
        out.append(row)
    return out


def _per_sample(records: list[dict]) -> dict[tuple[int, int], tuple[float, list[int]]]:
    """(step, sample id) -> (its loss, the ranks that recorded it), micro-batches of one sample."""
    out: dict[tuple[int, int], tuple[float, list[int]]] = {}
    for s in sorted(records, key=lambda s: s["rank"]):
        ids = s.get("sample_ids") or []
        if len(ids) == 1:
            value, ranks = out.get((s["step"], ids[0]), (s["value"], []))
            out[(s["step"], ids[0])] = (value, ranks + [s["rank"]])
    return out


def _reported(records: list[dict]) -> dict[tuple[int, int], dict[int, float]]:
    """(step, evaluation index) -> rank -> the value it reported."""
    out: dict[tuple[int, int], dict[int, float]] = defaultdict(dict)
    for s in records:
        out[(s["step"], s["eval"])][s["rank"]] = s["value"]
    return dict(out)


def partial_average(trace: Trace, step: int, index: int, rank_values: dict) -> dict | None:
    """Which data ranks' samples each differing rank's reported value is the token mean of.

    From the trace's own micro-batch losses of that evaluation (TP rank 0's of each data rank),
    every subset of the data ranks is tried; a value matches a subset's mean within the
    rounding of the two fp32 computations of it: each micro-batch's mean rounded once, the
    reported sum of ``n`` terms and its division, ``(n + 2) eps_fp32`` relative. Returns
    {"averaged": {rank: [data ranks]}, "data_ranks": D} when every differing rank matches a
    proper subset (the one holding its own data rank where several do), else None."""
    coords = trace.coords()
    sums: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    seen: dict[int, int] = {}
    for s in sorted((s for s in trace.scalars if s["name"] == SAMPLE and s["step"] == step
                     and s["eval"] == index),
                    key=lambda s: s["rank"]):
        data = coords[s["rank"]]["data"]
        if seen.setdefault(data, s["rank"]) != s["rank"]:
            continue  # a TP peer's (or a pipeline stage's) reading of the same samples
        acc = sums[data]
        acc[0], acc[1], acc[2] = acc[0] + s["value"] * s["tokens"], acc[1] + s["tokens"], acc[2] + 1
    data_ranks = sorted(sums)
    if not data_ranks or len(data_ranks) > MAX_SUBSET_RANKS:
        return None
    eps = torch.finfo(torch.float32).eps
    averaged = {}
    for rank, value in rank_values.items():
        own = coords[int(rank)]["data"]
        fits = []
        for size in range(1, len(data_ranks) + 1):
            for subset in itertools.combinations(data_ranks, size):
                total, tokens, n = (sum(sums[d][i] for d in subset) for i in range(3))
                if tokens and abs(total / tokens - value) <= (n + 2) * eps * abs(value):
                    fits.append(list(subset))
        if not fits:
            return None
        best = min(fits, key=lambda f: (own not in f, len(f)))
        if len(best) < len(data_ranks):
            averaged[str(rank)] = best
    return {"averaged": averaged, "data_ranks": len(data_ranks)} if averaged else None


def signature(first: dict, df, cand: Trace) -> tuple[str, dict]:
    """The signature of a failing ``eval`` row (see the module docstring)."""
    step = int(first["step"])
    if not is_reported(first):
        return "mismatch", {}
    at_step = (df["step"] == step) & (df["kind"] == "eval")
    samples = df[at_step & df["tensor"].str.startswith("eval_loss[sample")]
    index = int(first["tensor"].rsplit(" ", 1)[-1].rstrip("]"))
    fitted = partial_average(cand, step, index, first.get("rank_values") or {})
    if fitted is not None:
        return "partial-average", {"partial_average": fitted}
    if samples["passed"].astype(bool).all():
        return "loss-report-only", {}
    return "mismatch", {}
