"""Metrics of one (reference, candidate) pair in one streaming pass, in bounded memory.

Both tensors are read once, chunk by chunk (:data:`CHUNK` elements, widened into fp64 buffers
kept between passes: the working set is fixed whatever the tensor's size, and no chunk
allocates). Every per-element quantity (``|c - r|``, ``|c - r| / |r|``, ``(c - r)^2``) is
rounded once in fp64, as a whole-tensor fp64 computation rounds it: the same values bit for
bit (``c - r`` of two fp32 values is exact in fp64 whenever their exponents differ by less
than 29). Maxima, their index and counts are therefore identical to a whole-tensor pass. The
fp64 sums (norms, dot products, RMS errors) are added chunk by chunk, so each differs from the
whole-tensor sum by at most ``gamma_(n/CHUNK + CHUNK) sum|x|`` in fp64 (below 1e-10 relative
for n < 2^40), far below anything the report prints.

The same pass measures what the judgement needs (the RMS errors against the golden, the
golden's largest magnitude, the excess over a ``dtype`` tolerance), so it never re-reads the
tensors. Chunks holding NaN/Inf take a masked path with the same semantics.

ULP distances are integer differences of the bit patterns in the dtype's own width (fp32 as
int32, bf16 and fp16 as int16), widened to int64 only in a chunk where some pair of values
differs in sign. The maximum is exact. The p99 is APPROXIMATE: it is read from a histogram of
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

import torch

from harness.tolerance import DTYPE_TOLS

CHUNK = 1 << 17  # 1 MiB per fp64 buffer: the five buffers stay in the last-level cache
HIST_SHIFT = 20  # float32 bits >> 20: 8 exponent bits and 3 mantissa bits, 1/8-octave buckets
HIST_BINS = 1 << (31 - HIST_SHIFT)
P99_REL_ERROR = 1 / 16 + 2**-23
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


class _Buffers:
    """The pass's fp64 and integer scratch (chunk-sized), kept per thread between passes: a
    fixed overhead, and no pass pays for fresh pages."""

    def __init__(self, n: int, int_t: torch.dtype | None):
        self.rd, self.cd, self.d, self.s = (torch.empty(n, dtype=torch.float64) for _ in range(4))
        self.i, self.x, self.y = (torch.empty(n, dtype=torch.int32) for _ in range(3)) if int_t else (None,) * 3
        self.f = torch.empty(n, dtype=torch.float32)


_KEPT = threading.local()


def _buffers(n: int, int_t: torch.dtype | None) -> _Buffers:
    """Scratch for chunks of ``n`` elements: the kept chunk-sized buffers, or small ones."""
    if n < CHUNK:
        return _Buffers(n, int_t)
    kept = getattr(_KEPT, "by_dtype", None)
    if kept is None or kept[0] != CHUNK:
        kept = _KEPT.by_dtype = (CHUNK, {})
    if int_t not in kept[1]:
        kept[1][int_t] = _Buffers(CHUNK, int_t)
    return kept[1][int_t]


class _Acc:
    """Running state of one pass."""

    def __init__(self):
        self.ss_r = self.ss_c = self.ss_d = self.dot = 0.0
        self.max_abs, self.worst, self.max_rel = -1.0, 0, 0.0
        self.top = 0.0  # max |r| over finite elements
        self.max_ulp, self.mismatched, self.nonfinite = 0, 0, 0
        self.hist = torch.zeros(HIST_BINS, dtype=torch.int64)  # finite elements' ULP distances
        self.counted = 0
        self.any_finite = False

    def take_max(self, diff: torch.Tensor, start: int) -> None:
        value = float(diff.max())
        if value > self.max_abs:  # strictly: the first worst element, as argmax gives
            self.max_abs, self.worst = value, start + int(diff.argmax())

    def take_ulp(self, u: torch.Tensor, f: torch.Tensor) -> None:
        """``u``: non-negative integer distances; ``f``: float32 scratch of at least its size."""
        if u.numel():
            self.max_ulp = max(self.max_ulp, int(u.max()))
            bits = f[: u.numel()].copy_(u).view(torch.int32)
            bits >>= HIST_SHIFT
            self.hist += torch.bincount(bits, minlength=HIST_BINS)
            self.counted += u.numel()

    def take_zero_ulps(self, n: int) -> None:
        self.max_ulp, self.counted = max(self.max_ulp, 0), self.counted + n
        self.hist[0] += n


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
    buf = _buffers(min(CHUNK, ref.numel()), _INT_OF[ref.dtype] if fast else None)
    for start in range(0, ref.numel(), CHUNK):
        r, c = r_flat[start:start + CHUNK], c_flat[start:start + CHUNK]
        n = r.numel()
        rd, cd = buf.rd[:n].copy_(r), buf.cd[:n].copy_(c)
        if g_flat is not None:
            _golden_chunk(stats, rd, cd, g_flat[start:start + CHUNK], buf.s[:n])
        if not (fast and _finite_chunk(acc, stats, buf, r, c, start, with_ulp, out["bitwise_equal"])):
            if tols is not None:
                _tolerance_chunk(stats, rd, cd, tols)
            _masked_chunk(acc, rd, cd, r, c, start, with_ulp)
    stats.sq_diff = acc.ss_d
    return _finish(out, acc, ref, cand, r_flat, c_flat, with_ulp), stats


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


def _finite_chunk(acc: _Acc, stats: PairStats, buf: _Buffers, r, c, start: int, with_ulp: bool,
                  equal: bool) -> bool:  # fmt: skip
    """A chunk of fp32/bf16/fp16 values; False (nothing taken) if it holds NaN or Inf."""
    n = r.numel()
    rd, cd = buf.rd[:n], buf.cd[:n]
    ss_r = float(torch.dot(rd, rd))
    ss_c = ss_r if equal else float(torch.dot(cd, cd))
    if not math.isfinite(ss_r + ss_c):  # fp64 squares of these dtypes cannot overflow
        return False
    dot = ss_r if equal else float(torch.dot(rd, cd))
    acc.ss_r, acc.ss_c, acc.dot = acc.ss_r + ss_r, acc.ss_c + ss_c, acc.dot + dot
    acc.any_finite = True
    top = _abs_max(r)
    acc.top = max(acc.top, top)
    if tols := stats.tols:
        stats.abs_max_ref = max(stats.abs_max_ref, top)
    if equal:
        if acc.max_abs < 0:
            acc.max_abs, acc.worst = 0.0, start
        if tols:  # |c - r| = 0: the excess is largest where |r| is smallest
            least = float(rd.abs_().min())
            stats.dtype_excess = max(stats.dtype_excess, -(tols[1] + tols[0] * least))
        if with_ulp:
            acc.take_zero_ulps(n)
        return True
    diff = torch.sub(cd, rd, out=buf.d[:n])
    acc.ss_d += float(torch.dot(diff, diff))
    diff.abs_()  # |c - r|, rounded once in fp64 as the masked path
    acc.take_max(diff, start)
    ra = rd.abs_()
    if tols:
        rtol, atol = tols
        bound = torch.mul(ra, rtol, out=buf.s[:n]).add_(atol)  # atol + rtol |r|, rounded as the masked path
        stats.dtype_excess = max(stats.dtype_excess, float(torch.sub(diff, bound, out=bound).max()))
    rel = torch.div(diff, ra, out=buf.s[:n])  # fp64: finite wherever r != 0
    largest = float(rel.max())
    if not math.isfinite(largest):  # r == 0 somewhere: 0 there, as the masked path
        largest = float(rel.nan_to_num_(nan=0.0, posinf=0.0).max())
    acc.max_rel = max(acc.max_rel, largest)
    # c == r exactly where the ULP distance is 0 (+0 and -0 included): the mismatches are the
    # chunk's elements outside the histogram's zero bucket (no count over the fp64 differences).
    zeros = int(acc.hist[0])
    _ulp_chunk(acc, buf, r, c, r.dtype == torch.float32 and top < 2 and _abs_max(c) < 2)
    acc.mismatched += n - (int(acc.hist[0]) - zeros)
    return True


def _abs_max(x: torch.Tensor) -> float:
    lo, hi = torch.aminmax(x)
    return max(-float(lo), float(hi))


def _ulp_chunk(acc: _Acc, buf: _Buffers, r, c, below_two: bool) -> None:
    """ULP distances of a finite chunk in int32: ``|m_c - m_r|`` of the magnitude bits where the
    signs agree, ``m_c + m_r`` where they differ (as ``m_c - (m_r ^ s) + s``, ``s`` the smeared
    sign difference). bf16 and fp16 magnitudes are below 2^15, so the sum never overflows;
    fp32 magnitudes below 2^30 (``|x| < 2``: ``below_two``) neither. Otherwise the elements
    whose signs differ are counted apart, by the int64 ordered distance."""
    n = r.numel()
    wide = buf.i.dtype != _INT_OF[r.dtype]
    ri, ci = r.view(_INT_OF[r.dtype]), c.view(_INT_OF[r.dtype])
    if wide or below_two:
        low = torch.iinfo(_INT_OF[r.dtype]).max  # the magnitude bits
        m_r = torch.bitwise_and(ri, low, out=buf.x[:n])
        m_c = torch.bitwise_and(ci, low, out=buf.i[:n])
        s = torch.bitwise_xor(ri, ci, out=buf.y[:n])
        s >>= 31 if not wide else 15  # -1 where the signs differ, else 0
        m_r ^= s
        m_r -= s  # -m_r where the signs differ
        acc.take_ulp(m_c.sub_(m_r).abs_(), buf.f)
        return
    u = torch.sub(ci, ri, out=buf.i[:n]).abs_()
    signs = torch.bitwise_xor(ci, ri, out=buf.x[:n])
    if int(signs.min()) < 0:
        apart = (signs < 0).nonzero().squeeze(1)
        u.index_fill_(0, apart, 0)
        acc.hist[0] -= apart.numel()  # counted below with their own distance
        acc.counted -= apart.numel()
        acc.take_ulp(ulp_distance(r[apart], c[apart]), buf.f)
    acc.take_ulp(u, buf.f)


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
        u = ulp_distance(r, c)[finite]
        acc.take_ulp(u, torch.empty(u.numel(), dtype=torch.float32))


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
    acc.take_ulp(u.reshape(-1), torch.empty(u.numel(), dtype=torch.float32))
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
