"""Tensor signatures: fit a structured difference between a reference and a candidate tensor.

Each function answers one question of :mod:`harness.compare.localize` about a failing pair: is the
candidate the reference scaled by a parallel size (``ratio``), with GTP's dim-0 shard blocks
permuted (``permuted_blocks``), or with zero rows inserted (``inserted_zero_rows``)?
"""

from __future__ import annotations

import itertools

import torch
from torch.distributed.tensor import Shard


def ratio(ref: torch.Tensor, cand: torch.Tensor, mesh: dict) -> str | None:
    r, c = ref.double().reshape(-1), cand.double().reshape(-1)
    denom = float(r @ r)
    if denom == 0:
        return "missing-gradient" if float(c.abs().max()) > 0 else None
    scale = float(r @ c) / denom
    resid = float((c - scale * r).norm()) / max(float(c.norm()), 1e-300)
    if float(c.abs().max()) == 0:
        return "missing-gradient"
    if resid > 0.05:
        return None
    g, tp = mesh.get("gtp", 1), mesh.get("tp", 1)
    candidates = []
    if g > 1:
        candidates += [("ratio-G", g), ("ratio-1/G", 1 / g)]
    if tp > 1:
        candidates += [("ratio-TP", tp), ("ratio-1/TP", 1 / tp)]
    candidates += [("ratio-2", 2.0), ("ratio-1/2", 0.5)]
    for sig, value in candidates:
        if abs(scale / value - 1) < 0.03:
            return sig
    return None


def permuted_blocks(ref: torch.Tensor, cand: torch.Tensor, mesh: dict, tol: float,
                           layout=None) -> dict | None:
    """Does cand equal ref with its dim-0 shard blocks permuted?

    Blocks are cut as GTP cuts them: within each TP block of dim 0, after padding to the GTP
    layout's padded size (the pad rows of a misplaced block land inside the logical rows).
    Returns the permutation of the first TP block where one is found.
    """
    if ref.dim() == 0 or ref.shape != cand.shape:
        return None
    g, tp = mesh.get("gtp", 1), mesh.get("tp", 1)
    pad = layout.pads.get("gtp", 0) if layout is not None else 0
    tp_dim0 = layout is not None and isinstance(layout.placement("tp"), Shard) and layout.placement("tp").dim == 0
    tp_blocks = tp if tp_dim0 and tp > 1 else 1
    for n in sorted({g, tp, g * tp} - {1}):
        if n > 4:
            continue  # every permutation of up to 4 blocks is tried
        outer = tp_blocks if n == g else 1
        block_pad = pad if n == g else 0
        for rb, cb in zip(ref.double().chunk(outer), cand.double().chunk(outer)):
            rows = rb.shape[0]
            padded = torch.nn.functional.pad(rb, [0, 0] * (rb.dim() - 1) + [0, block_pad])
            if padded.shape[0] % n:
                continue
            blocks = padded.chunk(n)
            for perm in itertools.permutations(range(n)):
                if list(perm) == list(range(n)):
                    continue
                if float((torch.cat([blocks[i] for i in perm])[:rows] - cb).abs().max()) <= tol:
                    return {"blocks": n, "permutation": list(perm), "pad_rows": block_pad}
    return None


def inserted_zero_rows(ref: torch.Tensor, cand: torch.Tensor) -> dict | None:
    """{"row": i, "count": p}: ``cand`` is ``ref`` with p zero rows inserted at row i (the rows
    behind shifted down, the last p cut off); else None."""
    if ref.dim() < 1 or ref.shape != cand.shape or torch.equal(ref, cand):
        return None
    i = int((ref != cand).reshape(ref.shape[0], -1).any(1).nonzero()[0])
    p = int((cand[i:] == 0).reshape(cand.shape[0] - i, -1).all(1).long().cumprod(0).sum())  # zero run at i
    ok = p and torch.equal(cand[i + p:], ref[i:ref.shape[0] - p]) and bool((ref[i:i + p] != 0).any())
    return {"row": i, "count": p} if ok else None
