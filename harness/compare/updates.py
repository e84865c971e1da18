"""Judge an optimizer step by its *update*: what the step added to a parameter or a state.

Comparing the parameter after a step hides the structure of an optimizer bug: the weights of
both sides are nearly equal, and the step's own contribution is small next to them. The
update ``after - before`` of the candidate, set against the reference's, shows it: a factor
(an LR multiplier, a clip factor applied twice) or a term proportional to the parameter (a
weight decay left out or applied twice, ``-lr * wd * param`` per step in SGD and in Adam's
decoupled decay alike).
"""

from __future__ import annotations

import torch

# A fit explains the difference when its residual is this small a part of what it explains
# (the same relative threshold as the localizer's ratio signatures).
FIT_RESIDUAL = 0.05
# A factor this close to 1 is not a structured difference of the update.
FACTOR_MIN = 0.01
# A fitted coefficient within this relative distance of lr * wd is named as the decay term.
NAMED_TERM = 0.03


def _dot(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a * b).sum())


def update_term(ref_before, ref_after, cand_before, cand_after, lr: float | None = None,
                wd: float | None = None, param=None) -> dict | None:
    """The structure of the candidate's update against the reference's, or None.

    Returns ``{"kind": "factor", "factor": s, "text": ...}`` when cand's update is s times the
    reference's, or ``{"kind": "param-term", "coefficient": c, "text": ...}`` when the updates
    differ by ``c * param`` (named ``lr*wd*param`` when c matches the step's lr x wd).
    ``param`` is the weight before the step (default ``cand_before``: the update of a weight).
    """
    dr = (ref_after.double() - ref_before.double()).reshape(-1)
    dc = (cand_after.double() - cand_before.double()).reshape(-1)
    if dr.numel() == 0 or not bool(dr.any()) or not bool(dc.any()):
        return None  # an update that did not land is stale-update's, a zero reference has no scale
    scale = _dot(dr, dc) / _dot(dr, dr)
    if abs(scale - 1) > FACTOR_MIN and float((dc - scale * dr).norm()) <= FIT_RESIDUAL * float(dc.norm()):
        return {"kind": "factor", "factor": scale, "text": f"update scaled by {scale:.3g}"}
    diff = dc - dr
    p = (cand_before if param is None else param).double().reshape(-1)
    if _dot(p, p) == 0:
        return None
    coef = _dot(diff, p) / _dot(p, p)
    if float((diff - coef * p).norm()) > FIT_RESIDUAL * float(diff.norm()):
        return None
    doc = {"kind": "param-term", "coefficient": coef, "text": f"update differs by {coef:+.3g}*param"}
    if lr and wd:
        m = coef / (lr * wd)
        for mult, meaning in ((1.0, "weight decay not applied"), (-1.0, "weight decay applied twice")):
            if abs(m - mult) <= NAMED_TERM:
                sign = "+" if mult > 0 else "-"
                doc.update(text=f"update differs by {sign}lr*wd*param: {meaning}", multiple_of_lr_wd=m)
                break
        else:
            doc["multiple_of_lr_wd"] = m
    return doc


def befores(tensors: dict, step: int, kind: str, name: str):
    """(reference-or-candidate) tensor the step started from for an optimizer-phase ``kind``:
    the weight before the step for ``param``; the state after the previous step for a state
    (zero before the first step); for an fp32 master, the previous master or the weight."""
    if kind == "param":
        return tensors.get((step, "param_before", name))
    prev = tensors.get((step - 1, kind, name))
    if prev is not None:
        return prev
    if kind == "master":
        before = tensors.get((step, "param_before", name))
        return None if before is None else before.float()
    after = tensors.get((step, kind, name))
    return None if after is None else torch.zeros_like(after)
