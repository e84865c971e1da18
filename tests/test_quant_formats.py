"""Element formats: FP8 casts, E2M1 codes and packing, E8M0 exponents, the Hadamard transform.

Expected values come from the format definitions (sign / exponent / mantissa fields worked
out by hand) or from torch's own FP8 dtypes where those are exact.
"""

import math
import struct

import pytest
import torch

from harness.quant.formats import (
    E4M3,
    E5M2,
    cast_to_fp8,
    e2m1_decode,
    e2m1_encode,
    e8m0_decode,
    e8m0_from_float,
    e8m0_reciprocal,
    fp8_decode,
    pack_fp4,
    unpack_fp4,
)
from harness.quant.hadamard import apply_rht, rht_matrix, undo_rht


def f32(v: float) -> float:
    """Round a Python float to fp32."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def next_up(v: float) -> float:
    return torch.nextafter(torch.tensor(v), torch.tensor(math.inf)).item()


def bits_to_f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


# --------------------------------------------------------------------------- FP8 by definition


def decode_by_definition(code: int, ebits: int, mbits: int, bias: int, ieee_specials: bool) -> float:
    sign = -1.0 if code >> (ebits + mbits) else 1.0
    e = (code >> mbits) & ((1 << ebits) - 1)
    m = code & ((1 << mbits) - 1)
    top = (1 << ebits) - 1
    if ieee_specials and e == top:
        return sign * math.inf if m == 0 else math.nan
    if not ieee_specials and e == top and m == (1 << mbits) - 1:
        return math.nan
    if e == 0:
        return sign * (m / (1 << mbits)) * 2.0 ** (1 - bias)
    return sign * (1 + m / (1 << mbits)) * 2.0 ** (e - bias)


FORMATS = [
    pytest.param(E4M3, 4, 3, 7, False, id="e4m3"),
    pytest.param(E5M2, 5, 2, 15, True, id="e5m2"),
]


@pytest.mark.parametrize("fmt, ebits, mbits, bias, ieee", FORMATS)
def test_fp8_decode_matches_format_definition(fmt, ebits, mbits, bias, ieee):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = fp8_decode(codes, fmt)
    want = torch.tensor([decode_by_definition(c, ebits, mbits, bias, ieee) for c in range(256)])
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    finite = ~torch.isnan(want)
    assert torch.equal(got[finite], want[finite])
    assert got[finite & ~torch.isinf(want)].abs().max().item() == fmt.max


@pytest.mark.parametrize("fmt, ebits, mbits, bias, ieee", FORMATS)
def test_fp8_cast_rounds_to_nearest_even_between_every_pair(fmt, ebits, mbits, bias, ieee):
    decoded = {decode_by_definition(c, ebits, mbits, bias, ieee) for c in range(128)}
    values = sorted(v for v in decoded if math.isfinite(v))
    code_of = {decode_by_definition(c, ebits, mbits, bias, ieee): c for c in range(128)}
    for lo, hi in zip(values, values[1:]):
        mid = (lo + hi) / 2  # exact in fp32: both are FP8 values
        even = lo if code_of[lo] % 2 == 0 else hi
        xs = torch.tensor([mid, f32(mid) - (hi - lo) / 8, mid + (hi - lo) / 8, -mid])
        got = cast_to_fp8(xs, fmt).float().tolist()
        assert got == [even, lo, hi, -even], (lo, hi)


@pytest.mark.parametrize(
    "fmt, beyond, max_code",
    [(E4M3, [449.0, 464.0, 480.0, 1e30, math.inf], 0x7E),
     (E5M2, [57345.0, 61440.0, 65536.0, 1e30, math.inf], 0x7B)],
)
def test_fp8_cast_saturates_and_keeps_nan(fmt, beyond, max_code):
    xs = torch.tensor(beyond + [-v for v in beyond] + [math.nan])
    got = cast_to_fp8(xs, fmt).view(torch.uint8).tolist()
    n = len(beyond)
    assert got[:n] == [max_code] * n
    assert got[n : 2 * n] == [max_code | 0x80] * n
    assert math.isnan(cast_to_fp8(torch.tensor([math.nan]), fmt).float().item())


def test_fp8_hand_vectors_e4m3():
    # value -> byte, worked out from s.eeee.mmm with bias 7
    cases = {
        0.0: 0x00,
        2.0**-9: 0x01,  # smallest subnormal
        2.0**-10: 0x00,  # tie with 0 -> even
        3 * 2.0**-10: 0x02,  # tie 1 and 2 subnormal steps -> even
        2.0**-6: 0x08,  # smallest normal
        1.0: 0x38,
        1.0625: 0x38,  # tie 1.0 / 1.125 -> even mantissa
        1.1875: 0x3A,  # tie 1.125 / 1.25 -> even mantissa
        -1.0: 0xB8,
        448.0: 0x7E,
        240.0: 0x77,
    }
    got = cast_to_fp8(torch.tensor(list(cases)), E4M3).view(torch.uint8).tolist()
    assert got == list(cases.values())


def test_fp8_hand_vectors_e5m2():
    cases = {2.0**-16: 0x01, 2.0**-17: 0x00, 2.0**-14: 0x04, 1.0: 0x3C, 1.125: 0x3C, 1.375: 0x3E,
             57344.0: 0x7B}
    got = cast_to_fp8(torch.tensor(list(cases)), E5M2).view(torch.uint8).tolist()
    assert got == list(cases.values())


# --------------------------------------------------------------------------- E2M1


def test_e2m1_encode_hand_vectors():
    cases = {
        0.0: 0, 0.5: 1, 1.0: 2, 1.5: 3, 2.0: 4, 3.0: 5, 4.0: 6, 6.0: 7,
        0.25: 0, 0.75: 2, 1.25: 2, 1.75: 4, 2.5: 4, 3.5: 6, 5.0: 6,  # ties -> even mantissa
        0.26: 1, 0.74: 1, 2.51: 5, 4.99: 6, 5.01: 7,
        7.0: 7, 1e9: 7, math.inf: 7,  # saturate
        -0.5: 9, -6.0: 15, -100.0: 15, -0.1: 8, math.nan: 0,
    }
    got = e2m1_encode(torch.tensor(list(cases))).tolist()
    assert got == list(cases.values())
    assert e2m1_encode(torch.tensor([-0.0])).tolist() == [0]  # a dict key would merge it with 0.0


def test_e2m1_decode_table():
    want = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    got = e2m1_decode(torch.arange(16, dtype=torch.uint8))
    assert got.tolist() == want
    assert torch.signbit(got[8])


def brute_force_e2m1(v: float) -> int:
    """Nearest of the 16 codes by exhaustive search; ties to the even code; saturating."""
    grid = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    mag = min(abs(v), 6.0)
    best = min(range(8), key=lambda c: (abs(grid[c] - mag), c % 2))
    return best + 8 if v < 0 else best


def test_e2m1_matches_brute_force_nearest():
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4000, generator=gen) * 3, torch.arange(-56, 57) / 8.0])
    want = torch.tensor([brute_force_e2m1(v) for v in x.tolist()], dtype=torch.uint8)
    assert torch.equal(e2m1_encode(x), want)


def test_fp4_pack_layout_and_roundtrip():
    codes = torch.tensor([[1, 2, 15, 0, 7, 8]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x0F, 0x87]]  # even element in the low nibble
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(16, 16)
    assert torch.equal(pack_fp4(unpack_fp4(every_byte)), every_byte)
    as_fp4 = every_byte.view(torch.float4_e2m1fn_x2)
    assert torch.equal(unpack_fp4(as_fp4), unpack_fp4(every_byte))
    assert torch.equal(pack_fp4(unpack_fp4(as_fp4)).view(torch.float4_e2m1fn_x2).view(torch.uint8),
                       every_byte)
    with pytest.raises(ValueError):
        pack_fp4(torch.zeros(1, 3, dtype=torch.uint8))


@pytest.mark.parametrize("value, lo, hi",
                         [(2.3, 2.0, 3.0), (0.1, 0.0, 0.5), (-4.5, -4.0, -6.0), (1.2, 1.0, 1.5)])
def test_e2m1_stochastic_rounding_is_unbiased(value, lo, hi):
    n = 40000
    gen = torch.Generator().manual_seed(1234)
    got = e2m1_decode(e2m1_encode(torch.full((n,), value), stochastic=True, generator=gen))
    assert set(got.unique().tolist()) <= {lo, hi}
    p = (value - lo) / (hi - lo)
    sigma = abs(hi - lo) * math.sqrt(p * (1 - p) / n)
    assert abs(got.mean().item() - value) < 5 * sigma
    assert 0 < (got == hi).sum().item() < n


def test_e2m1_stochastic_rounding_is_seeded():
    x = torch.linspace(-6, 6, 1001)
    a = e2m1_encode(x, stochastic=True, generator=torch.Generator().manual_seed(7))
    b = e2m1_encode(x, stochastic=True, generator=torch.Generator().manual_seed(7))
    c = e2m1_encode(x, stochastic=True, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    grid = torch.tensor([0.5, 1, 1.5, 2, 3, 4, 6, -6.0])
    assert torch.equal(e2m1_encode(grid, stochastic=True, generator=torch.Generator()), e2m1_encode(grid))
    with pytest.raises(ValueError):
        e2m1_encode(x, stochastic=True)


# --------------------------------------------------------------------------- E8M0


def test_e8m0_rounds_exponent_up():
    cases = [
        (1.0, 127),
        (next_up(1.0), 128),
        (0.75, 127),
        (0.5, 126),
        (3.0 * 2.0**126, 254),
        (2.0**127, 254),
        (torch.finfo(torch.float32).max, 254),  # exponent 254 does not round up into NaN
        (bits_to_f32(0x00400000), 0),  # 2^-127, subnormal
        (bits_to_f32(0x00400001), 1),
        (bits_to_f32(0x00000001), 0),
        (0.0, 0),
        (math.inf, 254),
        (math.nan, 255),
    ]
    got = e8m0_from_float(torch.tensor([v for v, _ in cases])).tolist()
    assert got == [e for _, e in cases]


def test_e8m0_exact_powers_match_torch_dtype():
    k = torch.arange(-126, 128)
    powers = torch.ldexp(torch.ones(k.shape), k)
    assert torch.equal(e8m0_from_float(powers), powers.to(torch.float8_e8m0fnu).view(torch.uint8))


def test_e8m0_decode_and_reciprocal():
    e = torch.arange(255, dtype=torch.int32).to(torch.uint8)
    dec = e8m0_decode(e)
    assert dec[127].item() == 1.0 and dec[0].item() == bits_to_f32(0x00400000) and dec[254].item() == 2.0**127
    assert torch.equal(dec, torch.ldexp(torch.ones(255, dtype=torch.float64), e.double() - 127).float())
    rcp = e8m0_reciprocal(e)
    assert torch.equal((dec[1:254] * rcp[1:254]), torch.ones(253))
    assert rcp[254].item() == bits_to_f32(0x00400000) and rcp[0].item() == 2.0**127
    nan = torch.tensor([255], dtype=torch.uint8)
    assert torch.isnan(e8m0_decode(nan)).all() and torch.isnan(e8m0_reciprocal(nan)).all()


# --------------------------------------------------------------------------- Hadamard


def test_rht_matrix_is_orthonormal_with_te_rows_and_signs():
    m = rht_matrix()
    assert torch.equal(m @ m.T, torch.eye(16, dtype=torch.float64))
    h = rht_matrix(random_signs=False) * 4
    # rows of TE's get_hadamard_matrix (transformer_engine/pytorch/tensor/nvfp4_tensor.py)
    assert h[1].tolist() == [1, -1] * 8
    assert h[2].tolist() == [1, 1, -1, -1] * 4
    assert h[4].tolist() == ([1] * 4 + [-1] * 4) * 2
    assert h[8].tolist() == [1] * 8 + [-1] * 8
    signs = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]
    assert torch.equal(m * 4, torch.tensor(signs, dtype=torch.float64)[:, None] * h)


def test_apply_rht_on_unit_vectors_and_inverse():
    x = torch.zeros(2, 32)
    x[0, 0] = 1.0  # first group: row 0 of the matrix, all +1/4
    x[1, 16 + 3] = 2.0  # second group: 2 * row 3 (sign -1)
    y = apply_rht(x)
    assert y[0, :16].tolist() == [0.25] * 16 and y[0, 16:].abs().sum() == 0
    row3 = [1, -1, -1, 1] * 4
    assert y[1, 16:].tolist() == [-0.5 * s for s in row3]
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(8, 64, generator=gen)
    torch.testing.assert_close(undo_rht(apply_rht(z)), z, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(apply_rht(z).norm(dim=1), z.norm(dim=1), rtol=1e-6, atol=0)
    with pytest.raises(ValueError):
        apply_rht(torch.zeros(2, 24))
