"""Adam's step, judged by what each side's own moments make of it.

Adam's update ``u = m_hat / (sqrt(v_hat) + eps)`` normalizes the gradient: at step 1 it is
``g / (|g| + eps)``, about ``sign(g)``. Where a gradient element sits within the rounding noise
of zero (a bf16 gradient summed over another TP split), the two sides' updates there differ by
up to ``2 lr`` however close their gradients are, and the weight's error against the golden does
not scale with the gradient's: no noise floor carries through that normalization. What does
hold, whatever the gradients, is the step itself. Each side's new weight is, up to rounding,
``w (1 - lr wd) - lr u(m, v)`` of its own recorded moments ``m``, ``v`` (kinds ``exp_avg`` and
``exp_avg_sq``, after the step), so with ``0 <= lr wd <= 1``

    ``|w'_c - w'_r| <= |w_c - w_r| + lr |u_c - u_r| + rounding``,

``w`` the weights the step started from (equal at step 1: the canonical state). Rounding, per
side (Higham, Lemma 3.1): the decay (``1 - lr wd`` and the product, 2 roundings on ``w``), the
update (the square root, the two bias corrections and ``lr / bc1``, ``+ eps``, the quotient and
the product: 7 on ``lr u``) and the sum (1 on both) give at most ``gamma_8 (|w| + lr |u|)``; the
harness's own fp64 evaluation of ``u`` from the fp32 moments (6 fp64 roundings) is far inside
one more fp32 ``gamma``: ``gamma_9`` of fp32 each side. A bf16 weight is its fp32 master rounded
to nearest: ``u_bf16 |p|`` more per side (``|fl(x) - x| <= u |fl(x)|``).

The moments themselves are judged on their own rows (against the golden); this bound judges
that the weight is what the step makes of them, so a wrong update (a learning rate, a decay, a
bias correction, a stale or double step) still fails here.
"""

from __future__ import annotations

import math

import torch

from harness.compare import bounds
from harness.compare.updates import befores

KINDS = ("master", "param")
"""The weights it judges; and ``param_before`` after step 1, the previous step's ``param`` again."""
_HYPER = ("adam_beta1", "adam_beta2", "adam_eps", "weight_decay")
_ROUNDINGS = 9  # per side, on |w| + lr |u| (module docstring)


def hyper(traces: dict) -> dict | None:
    """The Adam hyperparameters both sides step with, or None where the bound does not apply: not
    Adam on both sides, other hyperparameters, a precision that skips steps (fp16's loss scaling:
    the bias correction's step count is then not the step's), or a run resumed from a checkpoint."""
    cfgs = [traces[r].manifest.get("config") if r in traces else None for r in ("reference", "candidate")]
    if not all(cfgs):
        return None
    ref, cand = cfgs
    for cfg in cfgs:
        if (cfg.get("optimizer") != "adam" or cfg.get("precision") not in ("fp32", "bf16")
                or cfg.get("load_step", 0) or cfg.get("resume_from", "")):
            return None
    if any(ref.get(k) != cand.get(k) for k in _HYPER) or ref.get("precision") != cand.get("precision"):
        return None
    lrs = _lrs(traces["reference"])
    if not lrs or lrs != _lrs(traces["candidate"]):
        return None  # the schedules' learning rates differ: the lr rows say so
    if not 0 <= max(lrs.values()) * float(ref["weight_decay"]) <= 1:
        return None
    return {**{k: float(ref[k]) for k in _HYPER}, "precision": ref["precision"], "lr": lrs}


def _lrs(trace) -> dict[int, float]:
    return {int(s["step"]): float(s["value"]) for s in trace.scalars
            if s.get("name") == "lr" and s.get("rank") == 0}


def update(m: torch.Tensor, v: torch.Tensor, step: int, h: dict) -> torch.Tensor:
    """Adam's ``m_hat / (sqrt(v_hat) + eps)`` at ``step`` (1-based), in fp64."""
    bc1, bc2 = 1 - h["adam_beta1"] ** step, 1 - h["adam_beta2"] ** step
    return (m.double() / bc1) / ((v.double() / bc2).sqrt() + h["adam_eps"])


def step_check(logical: dict, key: tuple, r: torch.Tensor, c: torch.Tensor, h: dict | None) -> dict:
    """A weight after an Adam step (an fp32 master, or the param) against the bound of the module
    docstring: the worst excess over it (<= 0: within it) and how many elements exceed it; empty
    where a side lacks the moments or the weights the step started from."""
    step, kind, name = key
    if kind == "param_before":  # the weight after the previous step, read again by this one
        step, kind = step - 1, "param"
    if h is None or kind not in KINDS or step not in h["lr"] or r.shape != c.shape:
        return {}
    if kind == "param" and h["precision"] == "bf16":
        src = "master"  # a bf16 param is its master rounded; the step ran on the master
    else:
        src = kind
    sides = [_Lazy(logical[role].tensors) for role in ("reference", "candidate")]
    moments = [[t.get((step, k, name)) for k in ("exp_avg", "exp_avg_sq")] for t in sides]
    before = [befores(t, step, src, name) for t in sides]
    if any(x is None for x in (*moments[0], *moments[1], *before)):
        return {}
    if any(x.shape != r.shape for x in (*moments[0], *moments[1], *before)):
        return {}
    lr = h["lr"][step]
    u_r, u_c = (update(m, v, step, h) for m, v in moments)
    g = bounds.gamma(_ROUNDINGS, torch.float32)
    bound = ((before[1].double() - before[0].double()).abs() + lr * (u_c - u_r).abs()
             + g * (before[0].double().abs() + before[1].double().abs() + lr * (u_r.abs() + u_c.abs())))
    if src != kind:
        bound = bound + bounds.unit_roundoff(torch.bfloat16) * (r.double().abs() + c.double().abs())
    excess = (c.double() - r.double()).abs() - bound
    excess = torch.where(torch.isnan(excess), torch.full_like(excess, math.inf), excess)
    return {"adam_bound_max": float(bound.max()), "adam_excess": float(excess.max()),
            "adam_violations": int((excess > 0).sum())}


class _Lazy:
    """``tensors.get`` for a lazy mapping of logical tensors (a missing key: None)."""

    def __init__(self, tensors):
        self.tensors = tensors

    def get(self, key):
        return self.tensors[key] if key in self.tensors else None
