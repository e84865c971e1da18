"""Metrics of one (reference, candidate) pair in one streaming pass, in bounded memory.

Both tensors are read once, chunk by chunk (:data:`CHUNK` elements: the fp64 temporaries of a
chunk stay in the CPU's cache, so the dozen element-wise steps per chunk run at cache speed
and the working set is fixed whatever the tensor's size). Each chunk is widened to fp64,
where every per-element quantity (``|c - r|``, ``|c - r| / |r|``, ``(c - r)^2``) is rounded
once, as a whole-tensor fp64 computation rounds it: the same values bit for bit (``c - r`` of
two fp32 values is exact in fp64 whenever their exponents differ by less than 29). Maxima,
their index and counts are therefore identical to a whole-tensor pass; only the fp64 sums
(norms, dot products, RMS errors) are added in another order: chunk sums added in sequence,
so each differs from the whole-tensor sum by at most
``gamma_(n/CHUNK + CHUNK) sum|x|`` in fp64 (below 1e-10 relative for n < 2^40), far below
anything the report prints.

The same pass measures what the judgement needs (the RMS errors against the golden, the
golden's largest magnitude, the excess over a ``dtype`` tolerance), so it never re-reads the
tensors in fp64. Chunks holding NaN/Inf take a masked path with the same semantics.

The p99 ULP distance is exact, as ``torch.quantile`` gives it, over the first
:data:`P99_SAMPLE` finite elements (a fixed-size sample: bounded memory), selected with two
``kthvalue`` calls instead of a sort.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from harness.tolerance import DTYPE_TOLS

CHUNK = 1 << 16
P99_SAMPLE = 1_000_000
BINCOUNT_LIMIT = 1 << 20  # largest ULP distance counted per value for the p99 (8 MiB of counts)
_INT_OF = {torch.float64: torch.int64, torch.float32: torch.int32,
           torch.bfloat16: torch.int16, torch.float16: torch.int16}  # fmt: skip
_FAST = (torch.float32, torch.bfloat16, torch.float16)  # squares cannot overflow in fp64


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """ULPs between same-dtype float tensors (ordered-integer distance of their bit patterns)."""
    return (_ordered(a).long() - _ordered(b).long()).abs_()


def _ordered(x: torch.Tensor) -> torch.Tensor:
    """Sign-magnitude bit patterns -> integers in the order of the floats (+0 and -0 both 0),
    in the dtype's own integer width: ``-magnitude`` for negatives, as ``(m ^ s) - s`` with
    ``s`` the sign smeared over the word (0 or -1)."""
    int_t = _INT_OF[x.dtype]
    i = x.contiguous().view(int_t)
    s = i >> (torch.iinfo(int_t).bits - 1)
    return ((i & torch.iinfo(int_t).max) ^ s) - s


@dataclass
class PairStats:
    """What one pass measures beyond the report's metrics: the judgement's inputs."""

    abs_max_ref: float = 0.0  # max |r| over all elements (NaN propagates), the dtype bound's scale
    sq_ref_golden: float = 0.0  # sum (r - g)^2, fp64
    sq_cand_golden: float = 0.0
    abs_max_golden: float = 0.0
    dtype_excess: float = -math.inf  # max (|c - r| - (atol + rtol |r|)); NaN propagates
    numel: int = 0
    sq_diff: float = 0.0  # sum (c - r)^2 over finite elements, fp64
    has_golden: bool = False
    tols: tuple[float, float] | None = None

    def rms(self, which: str) -> float:
        total = self.sq_ref_golden if which == "ref" else self.sq_cand_golden
        return math.sqrt(total / self.numel) if self.numel else float("nan")


class _Acc:
    """Running state of one pass."""

    def __init__(self):
        self.ss_r = self.ss_c = self.ss_d = self.dot = 0.0
        self.max_abs, self.worst, self.max_rel = -1.0, 0, 0.0
        self.top = 0.0  # max |r| over finite elements
        self.max_ulp, self.mismatched, self.nonfinite = 0, 0, 0
        self.ulp_sample: list[torch.Tensor] = []
        self.sampled = 0
        self.any_finite = False

    def take_max(self, diff: torch.Tensor, start: int) -> None:
        value, idx = diff.max(0)
        if float(value) > self.max_abs:  # strictly: the first worst element, as argmax gives
            self.max_abs, self.worst = float(value), start + int(idx)

    def take_ulp(self, u: torch.Tensor) -> None:
        if u.numel():
            self.max_ulp = max(self.max_ulp, int(u.max()))
            if self.sampled < P99_SAMPLE:
                part = u[: P99_SAMPLE - self.sampled]
                self.ulp_sample.append(part)
                self.sampled += part.numel()


def measure(ref: torch.Tensor, cand: torch.Tensor, golden: torch.Tensor | None = None,
            tols: tuple[float, float] | None = None) -> tuple[dict, PairStats]:
    """The report's metrics of one pair (same shape) and the judgement's inputs, in one pass.

    ``golden`` adds the RMS errors against it; ``tols`` = (rtol, atol) the ``dtype`` excess.
    """
    out: dict = {"numel": ref.numel()}
    same_dtype = ref.dtype == cand.dtype
    r_flat, c_flat = ref.contiguous().reshape(-1), cand.contiguous().reshape(-1)
    out["bitwise_equal"] = bool(same_dtype and ref.shape == cand.shape and torch.equal(
        r_flat.view(torch.uint8) if ref.dtype.is_floating_point else r_flat,
        c_flat.view(torch.uint8) if cand.dtype.is_floating_point else c_flat))  # fmt: skip
    with_ulp = same_dtype and ref.dtype in DTYPE_TOLS and ref.numel() > 0
    fast = same_dtype and ref.dtype in _FAST
    g_flat = golden.contiguous().reshape(-1) if golden is not None else None
    acc, stats = _Acc(), PairStats(numel=ref.numel(), has_golden=golden is not None, tols=tols)
    for start in range(0, ref.numel(), CHUNK):
        r, c = r_flat[start:start + CHUNK], c_flat[start:start + CHUNK]
        rd, cd = r.double(), c.double()
        if g_flat is not None:
            _golden_chunk(stats, rd, cd, g_flat[start:start + CHUNK].double())
        if tols is not None:
            _tolerance_chunk(stats, rd, cd, tols)
        if not (fast and _finite_chunk(acc, rd, cd, r, c, start, with_ulp, out["bitwise_equal"])):
            _masked_chunk(acc, rd, cd, r, c, start, with_ulp)
        stats.abs_max_ref = _nan_max(stats.abs_max_ref, rd.abs().max()) if tols is not None else 0.0
    stats.sq_diff = acc.ss_d
    return _finish(out, acc, ref, cand, r_flat, c_flat, with_ulp), stats


def _nan_max(a: float, b: torch.Tensor) -> float:
    b = float(b)
    return b if math.isnan(b) or math.isnan(a) else max(a, b)


def _golden_chunk(stats: PairStats, rd, cd, gd) -> None:
    stats.sq_ref_golden += float(torch.dot(rd - gd, rd - gd))
    stats.sq_cand_golden += float(torch.dot(cd - gd, cd - gd))
    stats.abs_max_golden = _nan_max(stats.abs_max_golden, gd.abs().max())


def _tolerance_chunk(stats: PairStats, rd, cd, tols) -> None:
    rtol, atol = tols
    excess = float(((cd - rd).abs() - (atol + rtol * rd.abs())).max())
    stats.dtype_excess = excess if math.isnan(excess) else max(stats.dtype_excess, excess)


def _finite_chunk(acc: _Acc, rd, cd, r, c, start: int, with_ulp: bool, equal: bool) -> bool:
    """A chunk of fp32/bf16/fp16 values; False (nothing taken) if it holds NaN or Inf."""
    ss_r, ss_c = float(torch.dot(rd, rd)), float(torch.dot(cd, cd))
    if not math.isfinite(ss_r + ss_c):  # fp64 squares of these dtypes cannot overflow
        return False
    dot = ss_r if equal else float(torch.dot(rd, cd))
    acc.ss_r, acc.ss_c, acc.dot = acc.ss_r + ss_r, acc.ss_c + ss_c, acc.dot + dot
    acc.any_finite = True
    if equal:
        acc.top = max(acc.top, float(rd.abs().max()))
        acc.take_max(torch.zeros(1, dtype=torch.float64), start)
        if with_ulp:
            zeros = min(r.numel(), max(0, P99_SAMPLE - acc.sampled)) or 1  # equal: 0 ULP everywhere
            acc.take_ulp(torch.zeros(zeros, dtype=torch.int64))
        return True
    diff = cd.sub_(rd).abs_()  # |c - r|, in fp64 as the masked path
    ra = rd.abs_()
    acc.top = max(acc.top, float(ra.max()))
    acc.ss_d += float(torch.dot(diff, diff))
    acc.take_max(diff, start)
    acc.mismatched += int(torch.count_nonzero(diff))
    rel = diff.div_(ra).nan_to_num_(nan=0.0, posinf=0.0)  # r == 0: 0, as the masked path
    acc.max_rel = max(acc.max_rel, float(rel.max()))
    if with_ulp:
        acc.take_ulp(ulp_distance(r, c))
    return True


def _masked_chunk(acc: _Acc, rd, cd, r, c, start: int, with_ulp: bool) -> None:
    """Any chunk: non-finite positions compared as such, excluded from every other metric."""
    r_nan, c_nan, r_inf, c_inf = rd.isnan(), cd.isnan(), rd.isinf(), cd.isinf()
    acc.nonfinite += int(((r_nan != c_nan) | (r_inf != c_inf) | (r_inf & c_inf & (rd != cd))).sum())
    finite = rd.isfinite() & cd.isfinite()
    diff = torch.where(finite, (cd - rd).abs(), torch.zeros_like(rd))
    rel = diff / rd.abs().clamp_min(torch.finfo(torch.float64).tiny)
    rel = torch.where(finite & (rd != 0), rel, torch.zeros_like(rd))
    acc.take_max(diff, start)
    acc.max_rel = max(acc.max_rel, float(rel.max()))
    acc.mismatched += int((diff > 0).sum())
    rf, cf = rd[finite], cd[finite]
    if rf.numel():
        acc.any_finite = True
        acc.top = max(acc.top, float(rf.abs().max()))
        acc.ss_r += float(torch.dot(rf, rf))
        acc.ss_c += float(torch.dot(cf, cf))
        acc.ss_d += float(torch.dot(cf - rf, cf - rf))
        acc.dot += float(torch.dot(rf, cf))
    if with_ulp:
        acc.take_ulp(ulp_distance(r, c)[finite])


def _finish(out: dict, acc: _Acc, ref, cand, r_flat, c_flat, with_ulp: bool) -> dict:
    n = ref.numel()
    out["nonfinite_mismatch"] = acc.nonfinite
    out["max_abs"] = max(acc.max_abs, 0.0) if n else 0.0
    out["max_rel"] = acc.max_rel
    worst = acc.worst if n else 0
    index = torch.unravel_index(torch.tensor(worst), ref.shape) if ref.dim() and n else []
    out["worst_index"] = [int(i) for i in index]
    out["ref_at_worst"] = float(r_flat[worst]) if n else 0.0
    out["cand_at_worst"] = float(c_flat[worst]) if n else 0.0
    if with_ulp:
        out["max_ulp"] = float(acc.max_ulp) if acc.sampled else 0.0
        out["p99_ulp"] = _p99(torch.cat(acc.ulp_sample)) if acc.sampled else 0.0
        # Error in ULPs of the tensor's largest magnitude: near-cancelled elements make the
        # element-wise ULP distance explode under any change of summation order.
        top = acc.top
        spacing = torch.finfo(ref.dtype).eps * 2.0 ** math.floor(math.log2(top)) if top > 0 else 0.0
        out["scaled_ulp"] = out["max_abs"] / spacing if spacing else 0.0
    else:
        out["max_ulp"] = out["p99_ulp"] = out["scaled_ulp"] = float("nan")
    rn, cn = math.sqrt(acc.ss_r), math.sqrt(acc.ss_c)
    out["rel_l2"] = math.sqrt(acc.ss_d) / rn if rn > 0 else (0.0 if out["max_abs"] == 0 else math.inf)
    out["cosine"] = acc.dot / (rn * cn) if rn > 0 and cn > 0 else float("nan")
    out["mismatched"] = acc.mismatched
    return out


def _p99(u: torch.Tensor) -> float:
    """``torch.quantile(u, 0.99)`` (linear interpolation) by selection, not a sort: from the
    counts of each distance when they are small (bf16, and fp32 within 2^20 ULPs), else from a
    partial top-k."""
    pos = 0.99 * (u.numel() - 1)
    lo = math.floor(pos)
    largest = int(u.max())
    if largest < BINCOUNT_LIMIT:
        below = torch.bincount(u, minlength=largest + 1).cumsum(0)  # below[v]: elements <= v
        ranks = torch.tensor([lo, min(lo + 1, u.numel() - 1)])
        v_lo, v_hi = torch.searchsorted(below, ranks, right=True).double()  # value at ascending rank
    else:
        top = u.topk(u.numel() - lo).values  # descending: [-1] is ascending rank lo, [-2] lo + 1
        v_lo, v_hi = top[-1].double(), (top[-2] if pos > lo else top[-1]).double()
    return float(torch.lerp(v_lo, v_hi, pos - lo))


def metrics(ref: torch.Tensor, cand: torch.Tensor) -> dict:
    """Every metric of one pair (same shape); floats in fp64."""
    return measure(ref, cand)[0]
