"""Per-step scalars of each side (loss, grad norm, LR, skipped steps) as pandas tables."""

from __future__ import annotations

import pandas as pd

from harness.capture.trace import Trace
from harness.scenario import COMPARED_ROLES

SCALARS = ["reduced_loss", "loss_logged", "grad_norm", "lr", "lr_logged", "num_zeros", "skipped"]
"""``loss_logged``: the loss a frontend's log line shows for the step (mlm and bridge backends)."""


def step_table(traces: dict[str, Trace]) -> pd.DataFrame:
    """One row per (side, step): the reduced loss the frontend logs, grad norm, LR, ...

    Scalars every rank records identically are read from rank 0.
    """
    rows = []
    for role, trace in traces.items():
        df = pd.DataFrame(trace.scalars)
        if df.empty:
            continue
        df = df[(df["rank"] == 0) & df["name"].isin(SCALARS)]
        wide = df.pivot_table(index="step", columns="name", values="value", aggfunc="first")
        wide.insert(0, "side", role)
        rows.append(wide.reset_index())
    if not rows:
        return pd.DataFrame(columns=["side", "step", *SCALARS])
    out = pd.concat(rows, ignore_index=True)
    return out[["side", "step", *[c for c in SCALARS if c in out.columns]]]


def rank_losses(traces: dict[str, Trace]) -> pd.DataFrame:
    """One row per (side, step, rank, micro-batch): sample ids and that micro-batch's loss."""
    rows = []
    for role, trace in traces.items():
        for s in trace.scalars:
            if s["name"] == "loss":
                rows.append({"side": role, "step": s["step"], "rank": s["rank"],
                             "micro_batch": s.get("micro_batch"), "sample_ids": s.get("sample_ids"),
                             "loss": s["value"]})
    return pd.DataFrame(rows, columns=["side", "step", "rank", "micro_batch", "sample_ids", "loss"])


def per_sample_losses(traces: dict[str, Trace]) -> pd.DataFrame:
    """Loss per (side, step, global sample id), whatever rank read the sample."""
    df = rank_losses(traces)
    rows = []
    for r in df.itertuples():
        ids = r.sample_ids or []
        if len(ids) == 1:
            rows.append({"side": r.side, "step": r.step, "sample_id": ids[0], "loss": r.loss, "rank": r.rank})
    return pd.DataFrame(rows, columns=["side", "step", "sample_id", "loss", "rank"])


def format_steps(table: pd.DataFrame) -> str:
    """The per-step table printed by ``gtp-parity run``: sides side by side."""
    if table.empty:
        return "(no steps recorded)"
    shown = ("reduced_loss", "loss_logged", "grad_norm", "lr")
    values = [v for v in shown if v in table.columns]
    wide = table.pivot_table(index="step", columns="side", values=values)
    cols = []
    for metric in shown:
        for role in COMPARED_ROLES:
            if (metric, role) in wide.columns:
                cols.append((metric, role))
    wide = wide[cols]
    wide.columns = [f"{m.replace('reduced_', '').replace('loss_logged', 'logged')}:{r[:4]}" for m, r in cols]
    return wide.to_string(float_format=lambda v: f"{v:.6g}")
