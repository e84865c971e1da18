"""The compiled loops (numba): the metrics pass over a (reference, candidate) pair, and the
statistics of a fingerprint. Each element is read from memory once.

The metrics pass (:func:`measure_pass`) takes every metric and judgement input from each pair
of elements.

Why compiled: in eager torch the pass is ~25 kernels per chunk, each a sweep of the chunk plus
its dispatch; here a block of :data:`BLOCK` elements is widened once into fp64 scratch that
stays in L1, and a few loops over it, which the compiler vectorizes, take every quantity. The
semantics are the eager pass's (tests/test_metrics.py checks them against whole-tensor fp64
computations):

- Each element is widened to fp64 (exact for fp32, bf16 and fp16) and every per-element value
  (``|c - r|``, ``|c - r| / |r|``, ``|c - r| - (atol + rtol |r|)``) is rounded once in fp64,
  with no fused multiply-add and no reordering of any expression: maxima, their first index
  and counts are a whole-tensor fp64 computation's, bit for bit. Maxima are taken over the values' bit
  patterns as integers (order-preserving for non-negative floats; other values go through
  :func:`_ordered`), which vectorizes where a float max does not.
- Sums (norms, dot product, squared differences, the RMS against the golden) are fp64, their
  additions reassociated into vector lanes (:func:`_values`, :func:`_golden`: the only
  functions compiled with that flag, and they hold no other chain it could reorder): each sum
  is within ``gamma_n sum |terms|`` in fp64 of any other order, below 1e-10 relative for
  n < 2^40.
- A block holding NaN or Inf in either side is measured again element by element
  (:func:`_nonfinite_block`): non-finite positions are compared as such and excluded from every
  other metric, except the judgement's ``dtype`` excess and the reference's largest magnitude,
  where NaN propagates as in a whole-tensor max. The golden's sums and largest magnitude
  propagate NaN in every block.
- ULP distances are the int64 distances of the order-preserving integers of the bit patterns;
  each goes into the 1/8-octave histogram as its float32 bits shifted by ``shift`` (the
  int -> float32 conversion rounds to nearest, as torch's does).

A fingerprint's statistics (:func:`moments`) are fp64 sums in vector lanes (the same bound as
above), and the finite values' extremes.

Compiled once per process, on first use (about 2 s for fp32 pairs, 1 s more for 16-bit ones,
0.4 s for fingerprint statistics): numba's on-disk cache (``cache=True``) stores and loads
pickles, and nothing pickled is loaded here.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
import torch
from numba import types
from numba.extending import intrinsic

from harness.common.dtypes import BITS_OF

BLOCK = 2048  # elements per block: its fp64 scratch (2 x 16 KiB) stays in L1
LANES = 4  # interleaved histograms (runs of one bucket do not serialize on one counter); _count unrolls 4
_MAGNITUDE = np.int64(0x7FFFFFFFFFFFFFFF)

# Indices of the float and integer results.
SS_R, SS_C, SS_D, DOT, MAX_ABS, MAX_REL, TOP, EXCESS, ABS_MAX_REF, SQ_RG, SQ_CG, ABS_MAX_G = range(12)
WORST, MISMATCHED, NONFINITE, MAX_ULP, COUNTED, BITS_DIFFER = range(6)
N_FLOAT, N_INT = 12, 6


# How the loops widen each dtype (see :func:`_widen`).
_MODE = {torch.float32: 0, torch.float64: 0, torch.bfloat16: 1, torch.float16: 2}
COMPILED = frozenset(_MODE)
_NONE32, _NONE64 = np.empty(0, dtype=np.float32), np.empty(0, dtype=np.float64)


def operands(t: torch.Tensor) -> tuple[np.ndarray, np.ndarray, int, np.ndarray]:
    """A contiguous 1-D tensor as the loops read it, without a copy: (its bit patterns, its
    values where numpy holds the dtype, the widening mode, the fp16 table where needed)."""
    t = t.detach()
    mode = _MODE[t.dtype]
    return (t.view(BITS_OF[t.dtype]).numpy(), t.numpy() if mode == 0 else _NONE32, mode,
            fp16_values() if mode == 2 else _NONE64)


@functools.cache
def fp16_values() -> np.ndarray:
    """fp64 value of every fp16 bit pattern, indexed by the pattern as unsigned (``lut``)."""
    return np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float64)


def new_results() -> tuple[np.ndarray, np.ndarray]:
    f = np.zeros(N_FLOAT, dtype=np.float64)
    f[MAX_ABS], f[EXCESS] = -1.0, -np.inf
    return f, np.zeros(N_INT, dtype=np.int64)


def _bitcast(src, dst):
    """An intrinsic reinterpreting a ``src`` scalar's bits as ``dst``."""

    @intrinsic
    def cast(typingctx, x):
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], context.get_value_type(dst))

        return dst(src), codegen

    return cast


_f64_bits = _bitcast(types.float64, types.int64)
_bits_f64 = _bitcast(types.int64, types.float64)
_f32_bits = _bitcast(types.float32, types.int32)
_bits_f32 = _bitcast(types.int32, types.float32)


@numba.njit(nogil=True, inline="always")
def _ordered(x):
    """An int64 in the order of the fp64 ``x`` (NaN excluded): the bit pattern, its magnitude
    bits flipped where the sign is set."""
    b = _f64_bits(x)
    return b ^ ((b >> 63) & _MAGNITUDE)


@numba.njit(nogil=True, inline="always")
def _unordered(k):
    """The fp64 whose :func:`_ordered` integer is ``k`` (the same flip undoes it)."""
    return _bits_f64(k ^ ((k >> 63) & _MAGNITUDE))


@numba.njit(nogil=True)
def _nan_max(m, x):
    """max that keeps NaN once met (as torch's max and Python's max over NaN-first do)."""
    if m == m and not (x <= m):
        return x
    return m


@numba.njit(nogil=True)
def _widen(bits, vals, mode, lut, out):
    """The block's elements as fp64 into ``out``. ``mode`` 0: fp32 or fp64 (``vals``); 1: bf16
    (the top half of the fp32 bits); 2: through ``lut`` (fp16)."""
    m = bits.size
    if mode == 0:
        for j in range(m):
            out[j] = vals[j]
    elif mode == 1:
        for j in range(m):
            out[j] = _bits_f32(np.int32(np.uint32(np.uint16(bits[j])) << np.uint32(16)))
    else:
        for j in range(m):
            out[j] = lut[np.uint16(bits[j])]


@numba.njit(nogil=True, fastmath={"reassoc"})
def _values(rd, cd):
    """The block's value metrics: fp64 sums (their additions reassociated into vector lanes:
    nothing else here is a chain the flag can reorder), the maxima of ``|c - r|``, ``|r|`` and
    ``|c - r| / |r|`` as bit patterns, the mismatches, and whether a NaN or Inf is present."""
    rr = cc = rc = dd = 0.0
    d_top = a_top = q_top = np.int64(0)
    mismatched = bad = 0
    for j in range(rd.size):
        r, c = rd[j], cd[j]
        delta = c - r
        rr += r * r
        cc += c * c
        rc += r * c
        dd += delta * delta
        d = abs(delta)
        a = abs(r)
        d_top = max(d_top, _f64_bits(d))
        a_top = max(a_top, _f64_bits(a))  # NaN's bits exceed Inf's: NaN propagates
        q = d / a if r != 0.0 else 0.0
        q_top = max(q_top, _f64_bits(q))
        mismatched += d > 0.0
        bad += (r - r != 0.0) | (c - c != 0.0)  # NaN or Inf
    return rr, cc, rc, dd, d_top, a_top, q_top, mismatched, bad


@numba.njit(nogil=True, fastmath={"reassoc"})
def _golden(rd, cd, g):
    """The block's squared errors against the golden and its largest magnitude's bits."""
    rg = cg = 0.0
    g_top = np.int64(0)
    for j in range(rd.size):
        e1, e2 = rd[j] - g[j], cd[j] - g[j]
        rg += e1 * e1
        cg += e2 * e2
        g_top = max(g_top, _f64_bits(abs(g[j])))  # NaN's bits exceed Inf's
    return rg, cg, g_top


@numba.njit(nogil=True)
def _excess(rd, cd, rtol, atol):
    """max (|c - r| - (atol + rtol |r|)) as an ordered integer, rounded as the eager pass."""
    e_top = np.int64(-0x7FFFFFFFFFFFFFFF)
    for j in range(rd.size):
        r, c = rd[j], cd[j]
        bound = rtol * abs(r)
        e_top = max(e_top, _ordered(abs(c - r) - (bound + atol)))
    return e_top


@numba.njit(nogil=True, inline="always")
def _ulp(ri, ci, magnitude):
    """ULPs between two bit patterns (sign-magnitude, widened to int64): the distance of
    their order-preserving integers ``-m`` / ``m`` (+0 and -0 both 0)."""
    ro = ((ri & magnitude) ^ (ri >> 63)) - (ri >> 63)
    co = ((ci & magnitude) ^ (ci >> 63)) - (ci >> 63)
    return abs(co - ro)


@numba.njit(nogil=True)
def _ulps(rb, cb, magnitude, shift, bucket):
    """The block's ULP distances from the bit patterns: their maximum, their histogram
    buckets into ``bucket``, and how many patterns differ (bitwise equality)."""
    u_top = np.int64(0)
    differ = 0
    for j in range(rb.size):
        ri, ci = np.int64(rb[j]), np.int64(cb[j])
        differ += ri != ci  # NaN payloads and -0 included
        u = _ulp(ri, ci, magnitude)
        u_top = max(u_top, u)
        bucket[j] = np.uint32(_f32_bits(np.float32(u)) >> shift)
    return u_top, differ


@numba.njit(nogil=True)
def _count(bucket, hist):
    """Histogram of the block's buckets into LANES interleaved histograms (``hist`` holds
    LANES x buckets, flat): consecutive elements land in different counters. Unsigned indices:
    no negative-index wrapping in the loop."""
    bins = np.uint32(hist.size // LANES)
    m = bucket.size - bucket.size % LANES
    for j in range(0, m, LANES):
        hist[bucket[j]] += 1
        hist[bins + bucket[j + 1]] += 1
        hist[2 * bins + bucket[j + 2]] += 1
        hist[3 * bins + bucket[j + 3]] += 1
    for j in range(m, bucket.size):
        hist[bucket[j]] += 1


@numba.njit(nogil=True)
def measure_pass(r_bits, c_bits, r_vals, c_vals, mode, lut, golden, has_golden, tols, has_tols,
                 shift, f_out, i_out, hist):
    """Add one pair's elements to the running results ``f_out`` (floats), ``i_out`` (ints) and
    ``hist`` (LANES x buckets, flat)."""
    n = r_bits.size
    rd = np.empty(BLOCK, np.float64)
    cd = np.empty(BLOCK, np.float64)
    bucket = np.empty(BLOCK, np.uint32)
    magnitude = (np.int64(1) << (8 * r_bits.itemsize - 1)) - 1  # every bit but the sign
    rtol, atol = tols[0], tols[1]
    # Maxima kept as bit patterns (non-negative values) or ordered integers (the excess).
    max_abs_b = _f64_bits(f_out[MAX_ABS]) if f_out[MAX_ABS] >= 0 else np.int64(-1)
    max_rel_b, top_b = _f64_bits(f_out[MAX_REL]), _f64_bits(f_out[TOP])
    excess, abs_max_ref, abs_max_g = f_out[EXCESS], f_out[ABS_MAX_REF], f_out[ABS_MAX_G]
    worst, max_ulp = i_out[WORST], i_out[MAX_ULP]
    for start in range(0, n, BLOCK):
        stop = min(start + BLOCK, n)
        m = stop - start
        rb, cb = r_bits[start:stop], c_bits[start:stop]
        r_blk, c_blk = rd[:m], cd[:m]
        _widen(rb, r_vals[start:stop] if mode == 0 else r_vals, mode, lut, r_blk)
        _widen(cb, c_vals[start:stop] if mode == 0 else c_vals, mode, lut, c_blk)
        if has_golden:
            rg, cg, g_top = _golden(r_blk, c_blk, golden[start:stop])
            f_out[SQ_RG] += rg
            f_out[SQ_CG] += cg
            abs_max_g = _nan_max(abs_max_g, _bits_f64(g_top))
        rr, cc, rc, dd, d_top, a_top, q_top, mismatched, bad = _values(r_blk, c_blk)
        u_top, differ = _ulps(rb, cb, magnitude, shift, bucket)
        i_out[BITS_DIFFER] += differ
        if bad:
            worst, max_abs_b, max_ulp, excess, abs_max_ref = _nonfinite_block(
                r_blk, c_blk, rb, cb, bucket, start, magnitude, tols, has_tols, f_out, i_out, hist,
                worst, max_abs_b, max_ulp, excess, abs_max_ref, _bits_f64(top_b), _bits_f64(max_rel_b))
            top_b, max_rel_b = _f64_bits(f_out[TOP]), _f64_bits(f_out[MAX_REL])
            continue
        f_out[SS_R] += rr
        f_out[SS_C] += cc
        f_out[DOT] += rc
        f_out[SS_D] += dd
        i_out[MISMATCHED] += mismatched
        i_out[COUNTED] += m
        if d_top > max_abs_b:  # the block holds a new maximum: its first position
            for j in range(m):
                if _f64_bits(abs(c_blk[j] - r_blk[j])) == d_top:
                    worst = start + j
                    break
            max_abs_b = d_top
        top_b, max_rel_b, max_ulp = max(top_b, a_top), max(max_rel_b, q_top), max(max_ulp, u_top)
        if has_tols:
            e_top = _excess(r_blk, c_blk, rtol, atol)
            excess = _nan_max(excess, _unordered(e_top))
            abs_max_ref = _nan_max(abs_max_ref, _bits_f64(a_top))
        _count(bucket[:m], hist)
    f_out[MAX_ABS] = _bits_f64(max_abs_b) if max_abs_b >= 0 else -1.0
    f_out[MAX_REL], f_out[TOP] = _bits_f64(max_rel_b), _bits_f64(top_b)
    f_out[EXCESS], f_out[ABS_MAX_REF], f_out[ABS_MAX_G] = excess, abs_max_ref, abs_max_g
    i_out[WORST], i_out[MAX_ULP] = worst, max_ulp


@numba.njit(nogil=True)
def _nonfinite_block(rd, cd, rb, cb, bucket, start, magnitude, tols, has_tols, f_out, i_out, hist,
                     worst, max_abs_b, max_ulp, excess, abs_max_ref, top, max_rel):
    """A block holding NaN or Inf, element by element: non-finite positions compared as such
    (NaN with NaN, Inf with the same Inf) and counted as ``|c - r| = 0`` elsewhere; the finite
    ones counted in the histogram from ``bucket`` (:func:`_ulps` filled it for the block)."""
    rtol, atol = tols[0], tols[1]
    max_abs = _bits_f64(max_abs_b) if max_abs_b >= 0 else -1.0
    for j in range(rd.size):
        r, c = rd[j], cd[j]
        d = abs(c - r)
        a = abs(r)
        if has_tols:
            excess = _nan_max(excess, d - (rtol * a + atol))
            abs_max_ref = _nan_max(abs_max_ref, a)
        if r - r == 0.0 and c - c == 0.0:
            delta = c - r
            f_out[SS_R] += r * r
            f_out[SS_C] += c * c
            f_out[DOT] += r * c
            f_out[SS_D] += delta * delta
            if d > max_abs:
                max_abs, worst = d, start + j
            if d > 0.0:
                i_out[MISMATCHED] += 1
                if r != 0.0:
                    max_rel = max(max_rel, d / a)
            top = max(top, a)
            max_ulp = max(max_ulp, _ulp(np.int64(rb[j]), np.int64(cb[j]), magnitude))
            hist[bucket[j]] += 1
            i_out[COUNTED] += 1
        else:
            if 0.0 > max_abs:
                max_abs, worst = 0.0, start + j
            r_nan, c_nan = r != r, c != c
            r_inf, c_inf = not r_nan and r - r != 0.0, not c_nan and c - c != 0.0
            if r_nan != c_nan or r_inf != c_inf or (r_inf and c_inf and r != c):
                i_out[NONFINITE] += 1
    f_out[TOP], f_out[MAX_REL] = top, max_rel
    return worst, (_f64_bits(max_abs) if max_abs >= 0 else np.int64(-1)), max_ulp, excess, abs_max_ref


@numba.njit(nogil=True, fastmath={"reassoc"})
def _block_moments(x):
    """Sum of all values (NaN and Inf propagate), then over the finite values: sum, sum of
    squares, ordered-integer extremes; NaN and non-finite counts (selects, no branches: the
    loop vectorizes)."""
    total = fin = squares = 0.0
    top, bottom = np.int64(0x7FFFFFFFFFFFFFFF), np.int64(-0x7FFFFFFFFFFFFFFF)
    lo, hi = top, bottom
    nan = nonfinite = 0
    for j in range(x.size):
        v = x[j]
        total += v
        finite = v - v == 0.0
        w = v if finite else 0.0
        fin += w
        squares += w * w
        k = _ordered(w)
        lo = min(lo, k if finite else top)
        hi = max(hi, k if finite else bottom)
        nan += v != v
        nonfinite += v - v != 0.0
    return total, fin, squares, lo, hi, nan, nonfinite - nan


@numba.njit(nogil=True)
def moments(bits, vals, mode, lut):
    """Fingerprint statistics of one block of elements (``bits``, ``vals``, ``mode`` and
    ``lut`` as for :func:`measure_pass`): (sum, finite sum, finite sum of squares, finite
    min, finite max, NaN count, Inf count); min and max are NaN when no value is finite."""
    buf = np.empty(BLOCK, np.float64)
    total = fin = squares = 0.0
    lo, hi = np.int64(0x7FFFFFFFFFFFFFFF), np.int64(-0x7FFFFFFFFFFFFFFF)
    nan = inf = 0
    for start in range(0, bits.size, BLOCK):
        stop = min(start + BLOCK, bits.size)
        x = buf[: stop - start]
        _widen(bits[start:stop], vals[start:stop] if mode == 0 else vals, mode, lut, x)
        b_total, b_fin, b_sq, b_lo, b_hi, b_nan, b_inf = _block_moments(x)
        total += b_total
        fin += b_fin
        squares += b_sq
        lo, hi = min(lo, b_lo), max(hi, b_hi)
        nan += b_nan
        inf += b_inf
    return total, fin, squares, _unordered(lo), _unordered(hi), nan, inf
