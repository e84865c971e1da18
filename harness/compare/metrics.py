"""Metrics of one (reference, candidate) pair in one streaming pass, in bounded memory.

Both tensors are read once. fp32, bf16 and fp16 pairs go through one compiled loop
(:mod:`harness.common.kernels`: blocks of a few thousand elements widened to fp64 in L1,
every quantity taken from them in vectorized loops); other dtypes, and pairs of two dtypes,
through an eager pass over chunks of :data:`CHUNK` elements widened into fp64 buffers kept
between passes. Either way the working set is fixed whatever the tensor's size, and both
have the same semantics: every per-element quantity (``|c - r|``, ``|c - r| / |r|``,
``(c - r)^2``) is rounded once in fp64, as a whole-tensor fp64 computation rounds it: the same
values bit for bit (``c - r`` of two fp32 values is exact in fp64 whenever their exponents
differ by less than 29). Maxima, their index and counts are therefore identical to a
whole-tensor pass. The fp64 sums (norms, dot products, RMS errors) are added block by block
(in vector lanes in the compiled loop), so each differs from the whole-tensor sum by at most
``gamma_n sum|x|`` in fp64 (below 1e-10 relative for n < 2^40), far below anything the
report prints.

The same pass measures what the judgement needs (the RMS errors against the golden, the
golden's largest magnitude, the excess over a ``dtype`` tolerance) and whether the pair is
bitwise equal, so it never re-reads the tensors. Elements holding NaN/Inf are compared as such
and left out of the other metrics; where they differ (one side non-finite where the other is not)
the difference is unbounded: max_abs, max_rel, rel_l2, cosine and the ULP metrics read NaN, never a finite
value, and the counts of each side's NaN and Inf (:data:`NONFINITE_KEYS`) name them.

ULP distances are the int64 distances of the order-preserving integers of the bit patterns
(+0 and -0 both 0). The maximum is exact. The p99 is APPROXIMATE: it is read from a histogram of
every finite element's distance in buckets of an eighth of an octave (the float32 exponent
and the top three mantissa bits of the distance, :data:`HIST_SHIFT`), each bucket standing for
the middle of the integers it holds. Distances below 16 have a bucket each, so a p99 below
16 ULP is ``torch.quantile``'s exactly; above, each of the two order statistics the quantile
interpolates is off by at most half a bucket, an eighth of an octave wide: under 1/16 of its
value (plus 2^-24 where float32 rounds a distance beyond 2^24 into the next bucket), hence
``|p99 - torch.quantile(u, 0.99)| <= (1/16 + 2^-23) torch.quantile(u, 0.99)``
(:data:`P99_REL_ERROR`).
"""

from __future__ import annotations

import math
import struct
import threading
from dataclasses import dataclass

import numpy as np
import torch

from harness.common.dtypes import BITS_OF
from harness.compare.tolerance import DTYPE_TOLS

CHUNK = 1 << 17  # the eager pass: 1 MiB per fp64 buffer, the three stay in the last-level cache
HIST_SHIFT = 20  # float32 bits >> 20: 8 exponent bits and 3 mantissa bits, 1/8-octave buckets
HIST_BINS = 1 << (31 - HIST_SHIFT)
P99_REL_ERROR = 1 / 16 + 2**-23
_FAST = (torch.float32, torch.bfloat16, torch.float16)  # the compiled loop's dtypes


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """ULPs between same-dtype float tensors (ordered-integer distance of their bit patterns)."""
    return (_ordered(a).long() - _ordered(b).long()).abs_()


def _ordered(x: torch.Tensor) -> torch.Tensor:
    """Sign-magnitude bit patterns -> integers in the order of the floats (+0 and -0 both 0),
    in the dtype's own integer width: ``-magnitude`` for negatives, as ``(m ^ s) - s`` with
    ``s`` the sign smeared over the word (0 or -1)."""
    int_t = BITS_OF[x.dtype]
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


class _Buffers:
    """The eager pass's fp64 scratch (chunk-sized), kept per thread between passes: a fixed
    overhead, and no pass pays for fresh pages."""

    def __init__(self, n: int):
        self.rd, self.cd, self.s = (torch.empty(n, dtype=torch.float64) for _ in range(3))


_KEPT = threading.local()


def _buffers(n: int) -> _Buffers:
    """Scratch for chunks of ``n`` elements: the kept chunk-sized buffers, or small ones."""
    if n < CHUNK:
        return _Buffers(n)
    if getattr(_KEPT, "buffers", None) is None:
        _KEPT.buffers = _Buffers(CHUNK)
    return _KEPT.buffers


class _Acc:
    """Running state of one pass."""

    def __init__(self):
        self.ss_r = self.ss_c = self.ss_d = self.dot = 0.0
        self.max_abs, self.worst, self.max_rel = -1.0, 0, 0.0
        self.top = 0.0  # max |r| over finite elements
        self.max_ulp, self.mismatched, self.nonfinite = 0, 0, 0
        self.hist = torch.zeros(HIST_BINS, dtype=torch.int64)  # finite elements' ULP distances
        self.counted = 0

    def take_max(self, diff: torch.Tensor, start: int) -> None:
        value = float(diff.max())
        if value > self.max_abs:  # strictly: the first worst element, as argmax gives
            self.max_abs, self.worst = value, start + int(diff.argmax())

    def take_ulp(self, u: torch.Tensor) -> None:
        """``u``: non-negative integer distances."""
        if u.numel():
            self.max_ulp = max(self.max_ulp, int(u.max()))
            bits = u.to(torch.float32).view(torch.int32) >> HIST_SHIFT
            self.hist += torch.bincount(bits, minlength=HIST_BINS)
            self.counted += u.numel()


def measure(ref: torch.Tensor, cand: torch.Tensor, golden: torch.Tensor | None = None,
            tols: tuple[float, float] | None = None, finite_only: bool = False) -> tuple[dict, PairStats]:
    """The report's metrics of one pair (same shape) and the judgement's inputs, in one pass.

    ``golden`` adds the RMS errors against it; ``tols`` = (rtol, atol) the ``dtype`` excess.
    fp32, bf16 and fp16 pairs take the compiled loop (:mod:`harness.common.kernels`); other
    dtypes, and pairs of two dtypes, the eager chunked pass with the same semantics.
    ``finite_only``: the metrics of the finite elements even where non-finite ones differ (which
    otherwise read NaN, see the module docstring): what the loops' tests check.
    """
    if cand.numel() != ref.numel() or (golden is not None and golden.numel() != ref.numel()):
        raise ValueError(f"measure: sizes differ: {ref.numel()}, {cand.numel()}"
                         f"{'' if golden is None else f', golden {golden.numel()}'}")
    out: dict = {"numel": ref.numel()}
    same_dtype = ref.dtype == cand.dtype
    r_flat, c_flat = ref.contiguous().reshape(-1), cand.contiguous().reshape(-1)
    with_ulp = same_dtype and ref.dtype in DTYPE_TOLS and ref.numel() > 0
    g_flat = golden.contiguous().reshape(-1) if golden is not None else None
    acc, stats = _Acc(), PairStats(numel=ref.numel(), has_golden=golden is not None, tols=tols)
    if same_dtype and ref.dtype in _FAST:
        differ = _compiled_pass(acc, stats, r_flat, c_flat, g_flat)
        out["bitwise_equal"] = ref.shape == cand.shape and differ == 0
    else:
        out["bitwise_equal"] = bool(same_dtype and ref.shape == cand.shape and torch.equal(
            r_flat.view(torch.uint8) if ref.dtype.is_floating_point else r_flat,
            c_flat.view(torch.uint8) if cand.dtype.is_floating_point else c_flat))
        buf = _buffers(min(CHUNK, ref.numel()))
        for start in range(0, ref.numel(), CHUNK):
            r, c = r_flat[start:start + CHUNK], c_flat[start:start + CHUNK]
            n = r.numel()
            rd, cd = buf.rd[:n].copy_(r), buf.cd[:n].copy_(c)
            if g_flat is not None:
                _golden_chunk(stats, rd, cd, g_flat[start:start + CHUNK], buf.s[:n])
            if tols is not None:
                _tolerance_chunk(stats, rd, cd, tols)
            _masked_chunk(acc, rd, cd, r, c, start, with_ulp)
    stats.sq_diff = acc.ss_d
    out = _finish(out, acc, ref, cand, r_flat, c_flat, with_ulp)
    if acc.nonfinite and not finite_only:
        _nonfinite(out, r_flat, c_flat, ref.shape, acc.nonfinite)
    return out, stats


def _compiled_pass(acc: _Acc, stats: PairStats, r: torch.Tensor, c: torch.Tensor,
                   g: torch.Tensor | None) -> int:
    """The whole pair in :func:`harness.common.kernels.measure_pass`, on zero-copy views;
    returns how many elements' bit patterns differ."""
    from harness.common import kernels as K  # numba: imported only where a pair is measured

    r_bits, r_vals, mode, lut = K.operands(r)
    c_bits, c_vals, _, _ = K.operands(c)
    golden = g.detach().to(torch.float64).numpy() if g is not None else _NO_GOLDEN
    tols = np.array(stats.tols or (0.0, 0.0), dtype=np.float64)
    f, i = K.new_results()
    hist = np.zeros(K.LANES * HIST_BINS, dtype=np.int64)
    K.measure_pass(r_bits, c_bits, r_vals, c_vals, mode, lut, golden, g is not None, tols,
                   stats.tols is not None,
                   HIST_SHIFT, f, i, hist)
    f = f.tolist()  # Python floats from here on
    acc.ss_r, acc.ss_c, acc.ss_d, acc.dot = f[K.SS_R], f[K.SS_C], f[K.SS_D], f[K.DOT]
    acc.max_abs, acc.max_rel, acc.top = f[K.MAX_ABS], f[K.MAX_REL], f[K.TOP]
    acc.worst, acc.mismatched, acc.nonfinite = int(i[K.WORST]), int(i[K.MISMATCHED]), int(i[K.NONFINITE])
    acc.max_ulp, acc.counted = int(i[K.MAX_ULP]), int(i[K.COUNTED])
    acc.hist = torch.from_numpy(hist.reshape(K.LANES, HIST_BINS).sum(0))
    if stats.tols is not None:
        stats.dtype_excess, stats.abs_max_ref = float(f[K.EXCESS]), float(f[K.ABS_MAX_REF])
    if g is not None:
        stats.sq_ref_golden, stats.sq_cand_golden = float(f[K.SQ_RG]), float(f[K.SQ_CG])
        stats.abs_max_golden = float(f[K.ABS_MAX_G])
    return int(i[K.BITS_DIFFER])


_NO_GOLDEN = np.empty(0, dtype=np.float64)


def _nan_max(a: float, b: torch.Tensor | float) -> float:
    b = float(b)
    return b if math.isnan(b) or math.isnan(a) else max(a, b)


def _golden_chunk(stats: PairStats, rd, cd, g, s) -> None:
    torch.sub(rd, g, out=s)
    stats.sq_ref_golden += float(torch.dot(s, s))
    torch.sub(cd, g, out=s)
    stats.sq_cand_golden += float(torch.dot(s, s))
    lo, hi = torch.aminmax(g)
    stats.abs_max_golden = _nan_max(stats.abs_max_golden, max(-float(lo), float(hi)) if lo == lo else lo)


def _tolerance_chunk(stats: PairStats, rd, cd, tols) -> None:
    """Any chunk (NaN propagates): max (|c - r| - (atol + rtol |r|)) and max |r|."""
    rtol, atol = tols
    excess = float(((cd - rd).abs() - (atol + rtol * rd.abs())).max())
    stats.dtype_excess = excess if math.isnan(excess) else max(stats.dtype_excess, excess)
    stats.abs_max_ref = _nan_max(stats.abs_max_ref, rd.abs().max())


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
    out["worst_index"] = _unravel(worst, ref.shape) if ref.dim() and n else []
    out["ref_at_worst"] = float(r_flat[worst]) if n else 0.0
    out["cand_at_worst"] = float(c_flat[worst]) if n else 0.0
    if with_ulp:
        out["max_ulp"] = float(acc.max_ulp) if acc.counted else 0.0
        out["p99_ulp"] = p99_from_histogram(acc.hist, acc.counted) if acc.counted else 0.0
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


NONFINITE_KEYS = ("nan_cand", "inf_cand", "nan_ref", "inf_ref")
"""A pair with non-finite mismatches: NaN / Inf elements of one side where the other is finite."""


def _nonfinite(out: dict, r: torch.Tensor, c: torch.Tensor, shape, count: int) -> None:
    """A pair whose non-finite elements differ (rare: a second pass over it). The error is
    unbounded there, so no metric of the difference reads a finite value (a tensor wholly NaN
    against a finite one never reads 0): max_abs, max_rel, rel_l2 and the ULP metrics are NaN,
    the mismatches count the non-finite ones, and the worst element is the first non-finite one
    of the candidate where the reference is finite (else of the reference where the candidate is)."""
    r_fin, c_fin = r.isfinite(), c.isfinite()
    new_c, new_r = ~c_fin & r_fin, ~r_fin & c_fin
    out.update(nan_cand=int((c.isnan() & r_fin).sum()), inf_cand=int((c.isinf() & r_fin).sum()),
               nan_ref=int((r.isnan() & c_fin).sum()), inf_ref=int((r.isinf() & c_fin).sum()))
    both = (r.isnan() != c.isnan()) | (r.isinf() & c.isinf() & (r != c))  # NaN against Inf, Inf against -Inf
    where = new_c if bool(new_c.any()) else new_r if bool(new_r.any()) else both
    worst = int(where.to(torch.uint8).argmax())
    out["worst_index"] = _unravel(worst, shape) if len(shape) else []
    out["ref_at_worst"], out["cand_at_worst"] = float(r[worst]), float(c[worst])
    for k in ("max_abs", "max_rel", "rel_l2", "cosine", "max_ulp", "p99_ulp", "scaled_ulp"):
        out[k] = float("nan")
    out["mismatched"] += count


def _unravel(flat: int, shape) -> list[int]:
    """``torch.unravel_index`` of one index, in Python (it runs once per pair)."""
    index = []
    for size in reversed(shape):
        flat, i = divmod(flat, size)
        index.append(i)
    return index[::-1]


def ulp_histogram(u: torch.Tensor) -> torch.Tensor:
    """The histogram the pass keeps, of non-negative integer distances ``u``."""
    acc = _Acc()
    acc.take_ulp(u.reshape(-1))
    return acc.hist


def p99_from_histogram(hist: torch.Tensor, count: int) -> float:
    """``torch.quantile(u, 0.99)`` (linear interpolation between the order statistics at ranks
    ``floor(0.99 (count - 1))`` and the next), each order statistic read as the middle of the
    integers its bucket holds; see the module docstring for the error bound."""
    pos = 0.99 * (count - 1)
    lo = math.floor(pos)
    below = hist.cumsum(0)  # below[b]: elements in buckets <= b
    b_lo, b_hi = torch.searchsorted(below, torch.tensor([lo, min(lo + 1, count - 1)]), right=True).tolist()
    v_lo, v_hi = _bucket_middle(b_lo), _bucket_middle(b_hi)
    return v_lo + (pos - lo) * (v_hi - v_lo)


def _bucket_middle(b: int) -> float:
    """The middle of the integers whose float32 bits, shifted by HIST_SHIFT, are ``b``."""
    low, high = struct.unpack("<2f", struct.pack("<2I", b << HIST_SHIFT, (b + 1) << HIST_SHIFT))
    first, last = math.ceil(low), math.ceil(high) - 1
    return (first + max(first, last)) / 2


def metrics(ref: torch.Tensor, cand: torch.Tensor) -> dict:
    """Every metric of one pair (same shape); floats in fp64."""
    return measure(ref, cand)[0]
