"""Tensor signatures: fit a structured difference between a reference and a candidate tensor.

Each function answers one question of :mod:`harness.compare.localize` about a failing pair: is the
candidate the reference scaled by a parallel size (``ratio``), with GTP's dim-0 shard blocks
permuted (``permuted_blocks``), with zero rows inserted (``inserted_zero_rows``), or rounded once
more to a narrower dtype (``extra_rounding``)? :data:`SIGNATURES` says what each signature the
localizer can name means, in one line each (the report shows it under the first divergence).
"""

from __future__ import annotations

import itertools
import math

import torch
from torch.distributed.tensor import Shard

from harness.compare.metrics import NONFINITE_KEYS


SIGNATURES = {
    "ratio-G": "candidate = G x reference: a mean over the GTP group became a sum (missing 1/G)",
    "ratio-1/G": "candidate = reference / G: the GTP mean was taken twice",
    "ratio-TP": "candidate = TP x reference: a TP mean became a sum",
    "ratio-1/TP": "candidate = reference / TP",
    "ratio-2": "candidate = 2 x reference: a reduction counted twice",
    "ratio-1/2": "candidate = reference / 2: a reduction halved",
    "log-TP-offset": "losses differ by log(TP): logits normalized over one TP shard only",
    "permuted-blocks": "the candidate equals the reference with shard blocks permuted: shard order",
    "pad-rows": "GTP pad rows are non-zero: padding leaked into the weight or received gradient",
    "replica-drift": "a replicated tensor differs across ranks: a partial gradient was not reduced",
    "missing-gradient": "the candidate gradient is zero where the reference is not",
    "stale-update": "the weight after the step equals the weight before it: the update did not land",
    "misrouted-samples": "ranks read the wrong samples (duplicated or missing sample ids)",
    "loss-report-only": "every tensor agrees, only the reported (reduced) loss differs",
    "logged-over-steps": "every tensor and the step's reduced loss agree; the loss the log line shows "
                         "is the mean of the reduced losses over several steps (the window named)",
    "partial-average": "the reported loss is the mean over some data ranks' samples only: reduced over a "
                       "group that leaves out ranks reading other samples (GTP peers are data ranks)",
    "grad-norm-only": "gradients agree, only the grad norm differs: double counting in the norm",
    "precision-loss": "within the format's tolerance of the reference, but further from the fp64 "
                      "golden than the reference's noise floor allows: precision lost (e.g. an "
                      "amax not reduced, a reduction in lower precision); named only where the "
                      "candidate has a precision mechanism (a recipe, bf16, or a precision below "
                      "the reference's)",
    "update-term": "the optimizer step's update (after - before) differs from the reference's by "
                   "a structure: a factor (an LR multiplier, a clip factor) or a term such as "
                   "-lr*wd*param (weight decay)",
    "extra-rounding": "one side is the other rounded once more to a narrower dtype (named): a "
                      "reduction or accumulation in bf16/fp16 where the other keeps fp32",
    "dtype-changed": "the same values held in another dtype (named per side): a buffer or a reduction built "
                     "in "
                     "another precision than the other side's",
    "not-bitwise": "the same operations on the same values (a bitwise expectation) gave other bits, with no "
                   "recognised pattern: an operation added, reordered or run in another kernel",
    "beyond-sum-bound": "a sum of the same terms differs by more than any order of summing them allows "
                        "(a bounded expectation): a term lost, added or rounded",
    "beyond-step-bound": "a weight after an Adam step differs by more than the two sides' own moments "
                         "and one step's rounding allow (a bounded expectation): the step applied wrongly",
    "mismatch": "values differ beyond the policy with no recognised pattern",
    "non-finite": "one side holds NaN or Inf where the other holds a finite value (counts, the side, the "
                  "region and ranks named): an overflow, a division by zero, or an uninitialized buffer read",
    "raised": "the code under test raised on one side only (the exception, its innermost frame in that "
              "code, the step and the phase named): a crash of the code under test is a divergence, not a "
              "failed run",
    "gemm-consumed-foreign-weight": "a GEMM consumed another parameter's weight: a GTP gather buffer "
                                    "was reused before the GEMM read it",
    "pad-rows-as-data": "the candidate is the reference with zero rows inserted and the rows behind "
                        "them shifted down: pad rows were counted as data (a saved GTP shard's padding)",
    "shared-weight-only": "only a weight used more than once per step differs, every weight used once "
                          "agrees: "
                          "per-weight state written for one use (one use's gradient lost or counted twice)",
    "labels-misaligned": "a loss differs while the logits it is computed from agree: it read other labels or "
                         "another loss mask (labels not shifted, or shifted by another depth)",
    "permuted-tensors": "the candidate's tensor is, bit for bit, the reference's tensor of another "
                        "parameter (named): whole tensors permuted, e.g. saved under another expert's "
                        "or layer's index",
}


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
    tp_dim0 = layout is not None and isinstance(layout.placement("tp"),
                                                Shard) and layout.placement("tp").dim == 0
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


def other_tensor(cand: torch.Tensor, key: tuple, tensors) -> str | None:
    """The name of the reference's other tensor of the same step and kind that ``cand`` equals
    bit for bit (``tensors``: the reference's logical tensors by (step, kind, name)), or None:
    whole tensors permuted between parameters (saved under another expert's or layer's index)."""
    step, kind, name = key
    if not bool(cand.any()):  # zeros equal any other zeros: no permutation is shown by them
        return None
    for other in tensors.keys():
        if other[:2] == (step, kind) and other[2] != name:
            ref = tensors[other]
            if ref.shape == cand.shape and ref.dtype == cand.dtype and torch.equal(ref, cand):
                return other[2]
    return None


NARROWER = (torch.bfloat16, torch.float16)
EXTRA_ROUNDING_ULPS = 2
"""How far (in ULPs of the narrower dtype) a side rounded once more may be from the other: one
rounding is half an ULP; a sum of a few terms each rounded to the narrower dtype stays within 2."""
ULP_SCALE = (1 / 8, 1.0)
"""The window of the median difference, in ULPs of the narrower dtype, that names it when
roundings to it happened inside a sum (partial sums rounded, then added in fp32): below, the
noise of a wider dtype (fp32 reordering is ~2^-16 bf16 ULP); above, a wrong value. bf16's and
fp16's windows do not overlap (fp16 has 3 more mantissa bits)."""
PARTIAL_SUM_ULPS = 8
"""The most any differing element may be off under ``ulp-scale``, in ULPs of the narrower dtype at
the larger of its magnitude and the tensor's RMS: a rounded partial sum is off by half an ULP of
its own magnitude, which near cancellation is the terms' (about the tensor's scale), not the
result's; a wrong value is off by its own size (hundreds of ULPs)."""


def extra_rounding(ref: torch.Tensor, cand: torch.Tensor) -> dict | None:
    """Was one side rounded (once more) to bf16 or fp16 on the way? Two patterns:

    - ``exact``: every value of one side is representable in the narrower dtype, the other's are
      not, and they differ by at most :data:`EXTRA_ROUNDING_ULPS` of its ULPs: the candidate (or
      the reference) is the other rounded to it;
    - ``ulp-scale``: the rounding happened to partial sums later summed in the wide dtype, so
      neither side is representable, but the differing elements' median difference is a
      fraction of the narrower dtype's ULP (:data:`ULP_SCALE`) and none is off by more than
      :data:`PARTIAL_SUM_ULPS` at the tensor's scale; the side with more values representable
      in it is named as the rounded one.

    Returns {"dtype", "rounded": "candidate" / "reference", "pattern", "elements",
    "median_ulps"} or None.
    """
    if ref.shape != cand.shape or ref.dtype != cand.dtype or not ref.is_floating_point() or torch.equal(ref,
        cand):
        return None
    both = torch.isfinite(ref) & torch.isfinite(cand)
    r, c = ref[both].double(), cand[both].double()
    differ = r != c
    if not bool(differ.any()):
        return None
    for narrow in NARROWER:
        if torch.finfo(narrow).bits >= torch.finfo(ref.dtype).bits:
            continue
        magnitude = torch.maximum(r.abs(), c.abs())[differ]
        info = torch.finfo(narrow)
        if bool(((magnitude < info.tiny) | (magnitude > info.max)).any()):
            continue  # outside its normal range a value rounded to it would be flushed or overflow
        ulps = (c - r).abs()[differ] / _ulp(magnitude, narrow)
        found = {"dtype": str(narrow).replace("torch.", ""), "elements": int(differ.sum()),
                 "median_ulps": float(ulps.median())}
        exact = {name: _representable(x, narrow) for name, x in (("reference", ref), ("candidate", cand))}
        if exact["reference"] != exact["candidate"] and float(ulps.max()) <= EXTRA_ROUNDING_ULPS:
            return {**found, "rounded": "candidate" if exact["candidate"] else "reference",
                    "pattern": "exact"}
        scale = max(float(r.pow(2).mean().sqrt()), float(c.pow(2).mean().sqrt()))
        worst = float(((c - r).abs()[differ] / _ulp(magnitude.clamp_min(scale), narrow)).max())
        if ULP_SCALE[0] <= found["median_ulps"] <= ULP_SCALE[1] and worst <= PARTIAL_SUM_ULPS:
            share = {name: float((x.to(narrow).double() == x).double().mean())
                     for name, x in (("reference", r), ("candidate", c))}
            return {**found, "rounded": max(share, key=share.get), "pattern": "ulp-scale"}
    return None


def _representable(x: torch.Tensor, narrow: torch.dtype) -> bool:
    finite = x[torch.isfinite(x)]
    return torch.equal(finite.to(narrow).to(x.dtype), finite)


def _ulp(magnitude: torch.Tensor, narrow: torch.dtype) -> torch.Tensor:
    """The narrower dtype's ULP at each magnitude of its normal range."""
    mantissa_bits = {torch.bfloat16: 7, torch.float16: 10}[narrow]
    _, exponent = torch.frexp(magnitude)  # m 2^e, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(magnitude), exponent - 1 - mantissa_bits)


def logged_window(step: int, rows) -> dict | None:
    """Which steps each side's logged loss (``loss_logged``) averages: the window ``[k, step]``
    whose reduced losses, summed in fp32 and divided by their count (as Megatron-LM's and
    Bridge's ``training_log`` accumulate them), print (``%.6E``) as the logged value. None
    unless both windows are found and differ (then the log lines, not the training, differ)."""
    scal = rows[rows["kind"] == "scalar"]
    reduced = {int(r.step): (r.ref_value, r.cand_value)
               for r in scal[scal["tensor"] == "reduced_loss"].itertuples()}
    logged = scal[(scal["tensor"] == "loss_logged") & (scal["step"] == step)]
    if logged.empty:
        return None
    windows = {}
    for i, side in enumerate(("reference", "candidate")):
        shown = f"{float(logged.iloc[0][('ref_value', 'cand_value')[i]]):.6E}"
        for first in range(step, 0, -1):
            values = [reduced[s][i] for s in range(first, step + 1) if s in reduced]
            if len(values) != step - first + 1:
                break
            total = torch.tensor(values, dtype=torch.float32).sum()  # fp32 accumulator, in step order
            if f"{float(total) / len(values):.6E}" == shown:
                windows[side] = [first, step]
                break
    if len(windows) < 2 or windows["reference"] == windows["candidate"]:
        return None
    return {"reference_window": windows["reference"], "candidate_window": windows["candidate"]}


def nonfinite_of(event: dict) -> dict | None:
    """What a failing event holds that is NaN or Inf where the other side is finite: per side, its
    NaN and Inf counts (a compared pair's, :data:`harness.compare.metrics.NONFINITE_KEYS`), or the
    pad rows' (a padding violation whose rows are not finite); None if nothing is."""
    if event.get("policy") == "padding":
        value = event.get("max_abs")
        if isinstance(value, float) and not math.isfinite(value):
            return {"side": "candidate", "in": "pad rows", "value": "NaN" if math.isnan(value) else "Inf"}
        return None
    if not _count(event.get("nonfinite_mismatch")):
        return None
    counts = {k: _count(event.get(k)) for k in NONFINITE_KEYS}
    side = "candidate" if counts["nan_cand"] + counts["inf_cand"] else "reference"
    if not any(counts.values()):
        side = "both"  # NaN against Inf, or Inf against -Inf: non-finite on both sides
    return {"side": side, **counts}


def _count(v) -> int:
    return int(v) if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v)) else 0
