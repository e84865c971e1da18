"""The streaming metrics pass (harness/metrics.py) against whole-tensor fp64 computations."""

import math

import pytest
import torch

from harness.compare import metrics as M


def _pair(dtype, numel, nonfinite):
    gen = torch.Generator().manual_seed(numel)
    r = torch.randn(numel, generator=gen)
    c = (r + 1e-3 * torch.randn(numel, generator=gen)).to(dtype)
    r = r.to(dtype)
    if nonfinite:
        r[5], c[7], r[M.CHUNK + 1], c[M.CHUNK + 1] = float("nan"), float("inf"), 0.0, 1.0
    return r, c


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nonfinite", [False, True])
def test_one_pass_over_chunks_equals_whole_tensor_fp64(dtype, nonfinite):
    r, c = _pair(dtype, 3 * M.CHUNK + 17, nonfinite)  # several chunks and a partial one
    m = M.measure(r, c, finite_only=True)[0]
    rd, cd = r.double(), c.double()
    finite = rd.isfinite() & cd.isfinite()
    diff = torch.where(finite, (cd - rd).abs(), torch.zeros_like(rd))
    # Per-element values and their maxima: bit for bit a whole-tensor fp64 pass.
    assert m["max_abs"] == float(diff.max()) and m["worst_index"] == [int(diff.argmax())]
    assert m["mismatched"] == int((diff > 0).sum())
    assert m["nonfinite_mismatch"] == (2 if nonfinite else 0)
    ulp = M.ulp_distance(r, c)[finite].double()
    assert m["max_ulp"] == float(ulp.max())
    # p99 from the 1/8-octave histogram: within the bound the module derives.
    assert m["p99_ulp"] == pytest.approx(float(torch.quantile(ulp, 0.99)), rel=M.P99_REL_ERROR)
    # Sums: fp64 in another order, within gamma of the terms (n of them) in fp64.
    n = r.numel()
    rel_l2 = float((cd - rd)[finite].norm() / rd[finite].norm())
    assert m["rel_l2"] == pytest.approx(rel_l2, rel=4 * n * 2**-53)
    cosine = float((rd[finite] * cd[finite]).sum() / (rd[finite].norm() * cd[finite].norm()))
    assert m["cosine"] == pytest.approx(cosine, rel=4 * n * 2**-53)


def test_judgement_inputs_come_from_the_same_pass():
    r, c = _pair(torch.float32, 2 * M.CHUNK + 3, False)
    g = r.double() + 1e-4
    _, stats = M.measure(r, c, g, tols=(1.3e-6, 1e-5))
    ref_rms = math.sqrt(float((r.double() - g).pow(2).mean()))
    assert stats.rms("ref") == pytest.approx(ref_rms, rel=4 * r.numel() * 2**-53)
    assert stats.abs_max_golden == float(g.abs().max())
    excess = float(((c.double() - r.double()).abs() - (1e-5 + 1.3e-6 * r.double().abs())).max())
    assert stats.dtype_excess == excess and stats.abs_max_ref == float(r.double().abs().max())


# exact buckets; 1/8 octave; float32 rounding
@pytest.mark.parametrize("largest", [15, 3000, 1 << 22, 1 << 32])
def test_p99_from_histogram_within_its_derived_bound(largest):
    gen = torch.Generator().manual_seed(largest % 9973)
    for n in (1, 2, 101, 10_001):
        u = torch.randint(0, largest, (n,), generator=gen, dtype=torch.int64)
        p99 = M.p99_from_histogram(M.ulp_histogram(u), n)
        exact = float(torch.quantile(u.double(), 0.99))
        if largest <= 16:  # a bucket per distance below 16: torch.quantile's value
            assert p99 == pytest.approx(exact, rel=1e-15, abs=1e-12)
        else:
            assert abs(p99 - exact) <= M.P99_REL_ERROR * exact


def test_ulp_distance_in_the_dtype_width_equals_the_int64_ordered_distance():
    """Same-sign chunks subtract bit patterns in int32 / int16; sign changes take int64."""
    # fp32 |x| < 2: int32
    for dtype, scale in ((torch.float32, 1.0), (torch.float32, 0.25), (torch.bfloat16, 1.0)):
        r = (scale * torch.randn(3 * M.CHUNK, generator=torch.Generator().manual_seed(1))).to(dtype)
        c = r.clone()
        c[M.CHUNK:] = (r[M.CHUNK:].float() * (1 + 1e-2 * torch.rand(2 * M.CHUNK))).to(dtype)  # same signs
        c[2 * M.CHUNK + 3] = -c[2 * M.CHUNK + 3]  # one sign change in the last chunk
        c[5] = float(torch.finfo(dtype).max) if scale == 1 else -1.9  # largest distance in the first chunk
        for part in (slice(0, M.CHUNK), slice(M.CHUNK, 2 * M.CHUNK), slice(2 * M.CHUNK, None), slice(None)):
            assert M.metrics(r[part], c[part])["max_ulp"] == float(M.ulp_distance(r[part], c[part]).max())


def _measured_both_ways(r, c, g, tols):
    """The compiled loop on a 16/32-bit pair and the eager pass on the same values in fp64."""
    return (M.measure(r, c, g, tols, finite_only=True),
            M.measure(r.double(), c.double(), g, tols, finite_only=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_loop_and_eager_pass_agree_with_nan_and_inf_everywhere(dtype):
    """Non-finite values in the reference, the candidate and the golden, in the first, a middle
    and the partial last block: the two implementations agree on every value widening keeps
    (ULP metrics are the dtype's, so they are checked against the dtype's distances)."""
    n = 5 * 2048 + 77
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(n, generator=gen)
    r, c = base.to(dtype), (base + 1e-2 * torch.randn(n, generator=gen)).to(dtype)
    r[3], c[3] = float("nan"), float("nan")  # matching NaNs: not a mismatch
    r[2048 * 2 + 5], c[2048 * 2 + 5] = float("inf"), float("-inf")  # opposite infinities
    c[n - 2] = float("inf")
    c[0] = 0.0  # a zero candidate, and below a zero reference (relative error skipped there)
    r[9] = 0.0
    g = base.double()
    g[2048 * 3] = float("nan")
    tols = (1.6e-2, 1e-5)
    (m, stats), (m_ref, stats_ref) = _measured_both_ways(r, c, g, tols)
    for k in ("max_abs", "worst_index", "ref_at_worst", "cand_at_worst", "max_rel", "mismatched",
              "nonfinite_mismatch", "bitwise_equal"):
        assert m[k] == m_ref[k], k
    assert m["nonfinite_mismatch"] == 2
    for k in ("rel_l2", "cosine"):  # fp64 sums in another order: gamma_n of the terms
        assert m[k] == pytest.approx(m_ref[k], rel=4 * n * 2**-53), k
    assert stats.dtype_excess != stats.dtype_excess  # inf - inf: NaN propagates, as in a whole-tensor max
    assert stats_ref.dtype_excess != stats_ref.dtype_excess
    assert math.isnan(stats.abs_max_ref) and math.isnan(stats_ref.abs_max_ref)  # r[3] is NaN
    assert (math.isnan(stats.abs_max_golden) and math.isnan(stats.sq_ref_golden)
            and math.isnan(stats.sq_cand_golden))
    finite = r.double().isfinite() & c.double().isfinite()
    ulp = M.ulp_distance(r, c)[finite].double()
    assert m["max_ulp"] == float(ulp.max())
    assert m["p99_ulp"] == pytest.approx(float(torch.quantile(ulp, 0.99)), rel=M.P99_REL_ERROR)


def test_compiled_loop_and_eager_pass_agree_on_judgement_inputs():
    n = 3 * 2048 + 1
    gen = torch.Generator().manual_seed(3)
    r = torch.randn(n, generator=gen)
    c = r + 1e-6 * torch.randn(n, generator=gen)
    g = r.double() + 1e-7 * torch.randn(n, generator=gen, dtype=torch.float64)
    (_, stats), (_, stats_ref) = _measured_both_ways(r, c, g, (1.3e-6, 1e-5))
    assert stats.dtype_excess == stats_ref.dtype_excess  # a maximum of values rounded alike
    assert stats.abs_max_ref == stats_ref.abs_max_ref and stats.abs_max_golden == stats_ref.abs_max_golden
    for k in ("sq_ref_golden", "sq_cand_golden", "sq_diff"):
        assert getattr(stats, k) == pytest.approx(getattr(stats_ref, k), rel=4 * n * 2**-53), k


def test_bitwise_equal_is_about_bits():
    """+0 against -0 and two NaN payloads are equal values but not equal bits."""
    r = torch.tensor([0.0, 1.0, float("nan")])
    c = r.clone()
    assert M.metrics(r, c)["bitwise_equal"]
    c[0] = -0.0
    m = M.metrics(r, c)
    assert not m["bitwise_equal"] and m["max_abs"] == 0.0 and m["mismatched"] == 0 and m["max_ulp"] == 0
    c = r.clone()
    c.view(torch.int32)[2] += 1  # another NaN payload
    m = M.metrics(r, c)
    assert not m["bitwise_equal"] and m["nonfinite_mismatch"] == 0
