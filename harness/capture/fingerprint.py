"""Fingerprints: what fingerprint-mode capture records of a tensor in place of its values.

A whole-tensor digest of the raw bytes, checksums of up to :data:`FINGERPRINT_BLOCKS` blocks
along dim 0 (their bytes again; each digest recorded under its algorithm's name), and
statistics: NaN and Inf counts; min, max, mean and L2 norm of the finite values.

Nothing is copied: the hashes read the tensor's buffer in place, and each block's statistics
are one compiled pass over it (:func:`harness.common.kernels.moments`: values widened to fp64, sums
added in fp64 vector lanes, the finite values' extremes); integer tensors take an eager fp64
pass. The blocks' partials are added in Python floats (fp64).

Fingerprints can run on the step (the step pays for them) or in the capture's writer thread
on a copy (``[capture] fingerprint_async``: the step pays for the copy only).
"""

from __future__ import annotations

import hashlib
import math
import zlib

import torch
import xxhash

from harness.capture.trace import tensor_bytes

FINGERPRINT_BLOCKS = 16
DIGESTS = {"sha256": lambda buf: hashlib.sha256(buf).hexdigest(), "xxh3_128": xxhash.xxh3_128_hexdigest}
BLOCK_DIGESTS = {"crc32": lambda buf: f"{zlib.crc32(buf):08x}", "xxh3_64": xxhash.xxh3_64_hexdigest}
WHOLE_DIGEST, BLOCK_DIGEST = "xxh3_128", "xxh3_64"
"""The digests recorded, each under its own name: those ``compare_fingerprints`` reads today.
xxh3_128 and xxh3_64 hash ~25x and ~10x faster (the benchmark measures both sets); a fingerprint
recorded with them is compared once the compare looks its digests up by name."""


def fingerprint(t: torch.Tensor, whole: str | None = None, block: str | None = None) -> dict:
    """Statistics, a bitwise hash and per-block checksums (blocks along dim 0); ``whole`` and
    ``block`` name the digests (default :data:`WHOLE_DIGEST`, :data:`BLOCK_DIGEST`)."""
    whole, block = whole or WHOLE_DIGEST, block or BLOCK_DIGEST
    flat = t.detach().contiguous().reshape(-1)
    rows = t.shape[0] if t.dim() else 1
    blocks, total, squares, lo, hi, nan, inf = [], 0.0, 0.0, math.inf, -math.inf, 0, 0
    for rows_chunk in (flat.reshape(rows, -1).chunk(min(FINGERPRINT_BLOCKS, rows)) if t.numel() else []):
        chunk = rows_chunk.reshape(-1)
        b_sum, b_fin, b_sq, b_lo, b_hi, b_nan, b_inf = _moments(chunk)
        total, squares, nan, inf = total + b_fin, squares + b_sq, nan + b_nan, inf + b_inf
        if b_nan + b_inf < chunk.numel():
            lo, hi = min(lo, b_lo), max(hi, b_hi)
        blocks.append({"rows": int(rows_chunk.shape[0]), "sum": b_sum,
                       block: BLOCK_DIGESTS[block](tensor_bytes(chunk))})
    finite = t.numel() - nan - inf
    stats = ({"nan": nan, "inf": inf, "min": lo, "max": hi, "mean": total / finite, "l2": math.sqrt(squares)}
             if finite else {"nan": nan, "inf": inf, "min": None, "max": None, "mean": None, "l2": None})
    return {whole: DIGESTS[whole](tensor_bytes(flat)), "numel": int(t.numel()), **stats, "blocks": blocks}


def _moments(x: torch.Tensor) -> tuple:
    """(sum, finite sum, finite sum of squares, finite min, finite max, NaN count, Inf count)
    of a block: fp64 sums in one compiled pass (:func:`harness.common.kernels.moments`) for the
    floating-point dtypes it reads, an eager fp64 pass for others."""
    from harness.common import kernels as K  # numba: imported only where a fingerprint is taken

    if x.dtype not in K.COMPILED:
        return _eager_moments(x)
    s, f, q, lo, hi, nan, inf = K.moments(*K.operands(x))
    return float(s), float(f), float(q), float(lo), float(hi), int(nan), int(inf)


def _eager_moments(x: torch.Tensor) -> tuple:
    """The same statistics in fp64, eagerly (integer blocks)."""
    x = x.double()
    good = x[torch.isfinite(x)]
    lo, hi = torch.aminmax(good) if good.numel() else (math.nan, math.nan)
    return (float(x.sum()), float(good.sum()), float(good.square().sum()), float(lo), float(hi),
            int(torch.isnan(x).sum()), int(torch.isinf(x).sum()))
