"""Quantizers: scale rules, delayed-scaling state, MXFP8, FP8 block and NVFP4 layouts.

Expected scales and bytes are worked out by hand from TE's rules (cited per test) or taken
from torch's FP8 casts of values that are exact after a power-of-two scale.
"""

import math
import struct

import pytest
import torch

from harness.quant.formats import E4M3, E5M2, e2m1_decode, unpack_fp4
from harness.quant.hadamard import apply_rht
from harness.quant.nvfp4 import NVFP4Quantizer, nvfp4_global_encode_scale
from harness.quant.quantizers import (
    CurrentScalingQuantizer,
    DelayedScalingQuantizer,
    Float8BlockQuantizer,
    MXFP8Quantizer,
    scale_from_amax,
)

FLT_MAX = torch.finfo(torch.float32).max


def f32(v: float) -> float:
    return struct.unpack("<f", struct.pack("<f", v))[0]


def next_up(v: float) -> float:
    return torch.nextafter(torch.tensor(v), torch.tensor(math.inf)).item()


def fp8_bytes(values, fmt) -> torch.Tensor:
    """torch's own cast, for values already exactly representable."""
    return torch.as_tensor(values, dtype=torch.float32).to(fmt.torch_dtype).view(torch.uint8)


# --------------------------------------------------------------------------- scale rules


def test_scale_from_amax_edge_cases():
    amax = torch.tensor([0.0, math.inf, math.nan, 448.0, 1.0, 1e-40, 3.0])
    got = scale_from_amax(amax, 448.0).tolist()
    assert got[:3] == [1.0, 1.0, 1.0]  # recipe_common.cuh: amax 0 / inf / NaN -> 1
    assert got[3:5] == [1.0, 448.0]
    assert got[5] == FLT_MAX  # 448 / 1e-40 overflows fp32 -> FLT_MAX
    assert got[6] == f32(448.0 / 3.0)


def test_scale_from_amax_power_of_two_and_epsilon():
    amax = torch.tensor([3.0, 448.0, 500.0, 1e-40, 0.0])
    got = scale_from_amax(amax, 448.0, power_2=True).tolist()
    assert got == [128.0, 1.0, 0.5, 2.0**127, 1.0]
    eps = scale_from_amax(torch.tensor([1e-6, 0.0, 2.0]), 448.0, epsilon=1e-3).tolist()
    assert eps == [f32(448.0 / f32(1e-3))] * 2 + [224.0]
    bf16_inf = scale_from_amax(torch.tensor([1e-40]), 448.0, value_for_inf=torch.finfo(torch.bfloat16).max)
    assert bf16_inf.item() == torch.finfo(torch.bfloat16).max


# --------------------------------------------------------------------------- current scaling


def test_current_scaling_bytes_and_transpose():
    x = torch.tensor([[1.0, -2.0], [0.5, 3.5]])  # amax 3.5 -> scale 448 / 3.5 = 128
    q = CurrentScalingQuantizer(fmt=E4M3).quantize(x)
    assert q.rowwise.scale_inv.item() == 1 / 128
    assert torch.equal(q.rowwise.data, fp8_bytes([[128.0, -256.0], [64.0, 448.0]], E4M3))
    assert torch.equal(q.columnwise.data, q.rowwise.data.t())
    assert torch.equal(q.rowwise.dequantize(), x)
    g = CurrentScalingQuantizer(fmt=E5M2).quantize(x)  # 57344 / 3.5 = 16384
    assert g.rowwise.scale_inv.item() == 2.0**-14 and torch.equal(g.rowwise.dequantize(), x)


def test_current_scaling_amax_override_and_reduction():
    x = torch.tensor([1.0, -2.0, 0.5, 3.5])
    q = CurrentScalingQuantizer(fmt=E4M3).quantize(x, amax=torch.tensor(7.0))
    assert q.rowwise.scale_inv.item() == 1 / 64 and q.rowwise.amax.item() == 7.0
    seen = []

    def reduce_max(t):
        seen.append(t.item())
        t.fill_(max(t.item(), 7.0))

    r = CurrentScalingQuantizer(fmt=E4M3, amax_reduction=reduce_max).quantize(x)
    assert seen == [3.5] and r.rowwise.scale_inv.item() == 1 / 64


def test_current_scaling_zero_inf_nan_tensors():
    z = CurrentScalingQuantizer(fmt=E4M3).quantize(torch.zeros(3, 4))
    assert z.rowwise.scale_inv.item() == 1.0 and z.rowwise.data.sum() == 0
    x = torch.tensor([1.0, math.inf, -2.0, math.nan])
    q = CurrentScalingQuantizer(fmt=E4M3).quantize(x)  # amax inf -> scale 1; inf saturates
    assert q.rowwise.scale_inv.item() == 1.0
    assert q.rowwise.data.tolist() == [[0x38, 0x7E, 0xC0, 0x7F]]
    n = CurrentScalingQuantizer(fmt=E4M3).quantize(torch.tensor([2.0, math.nan]))  # NaN ignored by amax
    assert n.rowwise.scale_inv.item() == 2 / 448 or n.rowwise.scale_inv.item() == f32(1 / f32(448 / 2))
    assert n.rowwise.data.tolist()[0][0] == 0x7E and n.rowwise.data.tolist()[0][1] == 0x7F
    q = CurrentScalingQuantizer(fmt=E4M3).quantize(torch.ones(2), amax=torch.tensor(math.nan))
    assert q.rowwise.scale_inv.item() == 1.0


def test_current_scaling_power_of_two_scale():
    x = torch.tensor([3.0, -1.0])  # 448 / 3 = 149.3 -> 128
    q = CurrentScalingQuantizer(fmt=E4M3, power_2_scale=True).quantize(x)
    assert q.rowwise.scale_inv.item() == 1 / 128
    assert torch.equal(q.rowwise.data, fp8_bytes([[384.0, -128.0]], E4M3))


# --------------------------------------------------------------------------- delayed scaling


def test_delayed_scaling_history_and_update():
    q = DelayedScalingQuantizer(fmt=E4M3, amax_history_len=4)
    first = q.quantize(torch.tensor([2.0, -1.0]))
    assert first.rowwise.scale_inv.item() == 1.0  # initial scale 1
    assert q.amax_history.tolist() == [2.0, 0, 0, 0]
    q.update()
    assert q.scale.item() == 224.0 and q.amax_history.tolist() == [0, 0, 0, 2.0]
    second = q.quantize(torch.tensor([4.0]))
    assert second.rowwise.scale_inv.item() == f32(1 / 224)  # the scale from the previous step
    q.update()
    assert q.scale.item() == 112.0 and q.amax_history.tolist() == [0, 0, 2.0, 4.0]
    q.quantize(torch.tensor([1.0]))
    q.update()  # max over the window still 4
    assert q.scale.item() == 112.0 and q.amax_history.tolist() == [0, 2.0, 4.0, 1.0]


def test_delayed_scaling_most_recent_margin_and_accumulated_amax():
    q = DelayedScalingQuantizer(fmt=E4M3, amax_history_len=8, amax_compute_algo="most_recent", margin=1)
    q.quantize(torch.tensor([8.0]))
    q.update()
    q.quantize(torch.tensor([1.0]))
    q.quantize(torch.tensor([-2.0]))  # two casts in one step: max recorded
    assert q.amax_history[0].item() == 2.0
    q.update()
    assert q.scale.item() == 448 / 2 / 2


def test_delayed_scaling_zero_nonfinite_and_tiny_amax():
    q = DelayedScalingQuantizer(fmt=E4M3, amax_history_len=3)
    q.quantize(torch.tensor([4.0]))
    q.update()
    assert q.scale.item() == 112.0
    q.quantize(torch.zeros(2))
    before = q.amax_history.clone()
    q.update()  # fused kernel: amax 0 -> no roll, scale kept
    assert q.scale.item() == 112.0 and torch.equal(q.amax_history, before)
    r = DelayedScalingQuantizer(fmt=E4M3, amax_history_len=1, amax_compute_algo="most_recent")
    r.quantize(torch.tensor([1.0]), amax=torch.tensor(math.inf))
    r.update()
    assert r.scale.item() == 1.0  # not finite -> keep old scale
    r.quantize(torch.tensor([1e-45]))
    r.update()
    assert r.scale.item() == FLT_MAX and r.amax_history.tolist() == [0.0]


def test_delayed_scaling_reduction_hook_and_callable_algo():
    calls = []

    def reduce_max(t):
        calls.append(t.clone())
        t.fill_(8.0)

    q = DelayedScalingQuantizer(fmt=E5M2, amax_history_len=2, amax_reduction=reduce_max)
    q.quantize(torch.tensor([1.0]))
    q.update()
    assert len(calls) == 1 and calls[0].item() == 1.0
    assert q.scale.item() == 57344 / 8 and q.amax_history.tolist() == [0.0, 8.0]
    u = DelayedScalingQuantizer(fmt=E4M3, amax_history_len=3, amax_compute_algo=lambda h: h.max() * 2)
    u.quantize(torch.tensor([7.0]))
    u.update()  # unfused path: amax 14 -> 32, roll then zero slot 0
    assert u.scale.item() == 32.0 and u.amax_history.tolist() == [0.0, 0.0, 7.0]


# --------------------------------------------------------------------------- MXFP8


@pytest.mark.parametrize("k", [-3, 0, 2])
def test_mxfp8_exponent_at_and_above_power_of_two(k):
    x = torch.full((32, 32), 448.0 * 2.0**k)
    x[1] = 1.0
    x[1, 7] = next_up(448.0 * 2.0**k)  # one ulp above -> rounds up to k + 1
    q = MXFP8Quantizer(fmt=E4M3).quantize(x, columnwise=False).rowwise
    assert q.scale_inv[:2].tolist() == [[127 + k], [128 + k]]  # amax 448 * 2^k -> exponent k
    assert torch.equal(q.data[0], fp8_bytes(x[0] * 2.0**-k, E4M3))
    assert torch.equal(q.data[1], fp8_bytes((x[1] * 2.0 ** -(k + 1)).to(torch.float8_e4m3fn).float(), E4M3))


def test_mxfp8_rowwise_and_columnwise_are_separate():
    x = torch.ones(32, 64)
    x[0, 0] = 448.0  # only the first row block and the first column block see it
    q = MXFP8Quantizer(fmt=E4M3).quantize(x)
    row_e = q.rowwise.scale_inv
    col_e = q.columnwise.scale_inv  # blocks of 32 down each column, stored transposed
    assert row_e.shape == (32, 2) and col_e.shape == (64, 1)
    assert row_e[0, 0] == 127 and row_e[1, 0] == 127 - 8  # amax 1 -> ceil(log2(1/448)) = -8
    assert col_e[0, 0] == 127 and col_e[1, 0] == 119
    assert torch.equal(q.columnwise.dequantize(), x.t())


def test_mxfp8_2d_blocks_and_zero_block():
    x = torch.zeros(64, 64)
    exps = [[-2, -1], [0, 1]]  # the hand-built case of TE's test_mxfp8_2d_quantize.py
    for br in range(2):
        for bc in range(2):
            amax = 448.0 * 2.0 ** exps[br][bc]
            x[br * 32 : br * 32 + 32, bc * 32 : bc * 32 + 32] = amax * 0.5
            x[br * 32, bc * 32] = amax
    q = MXFP8Quantizer(fmt=E4M3, with_2d_quantization=True).quantize(x)
    assert q.rowwise.scale_inv.tolist() == [[125, 126], [127, 128]]
    assert torch.equal(q.columnwise.scale_inv, q.rowwise.scale_inv.t())
    assert torch.equal(q.columnwise.data, q.rowwise.data.t())
    z = MXFP8Quantizer(fmt=E4M3).quantize(torch.zeros(32, 32)).rowwise
    assert z.scale_inv.sum() == 0 and z.data.sum() == 0


def test_mxfp8_e5m2_and_shape_errors():
    x = torch.full((32, 32), 3.5)
    q = MXFP8Quantizer(fmt=E5M2).quantize(x).rowwise  # 3.5 / 57344 = 2^-14 exactly
    assert (q.scale_inv == 127 - 14).all() and torch.equal(q.dequantize(), x)
    for shape in [(32, 48), (40, 32), (31,)]:
        with pytest.raises(ValueError, match="multiples of 32"):
            MXFP8Quantizer(fmt=E4M3).quantize(torch.ones(shape))
    with pytest.raises(ValueError):
        MXFP8Quantizer(fmt=E4M3).quantize(torch.ones(32, 32), amax=torch.tensor(1.0))


# --------------------------------------------------------------------------- FP8 block


def test_float8_block_1d_partial_blocks():
    x = torch.ones(130, 200)
    x[0, 0] = 3.0  # row 0, block 0: 448 / 3 -> pow2 128
    x[1, 150] = 6.0  # row 1, block 1 (partial, 72 wide): 448 / 6 -> 64
    q = Float8BlockQuantizer(fmt=E4M3, block_scaling_dim=1).quantize(x)
    s = q.rowwise.scale_inv
    assert s.shape == (130, 2)
    assert s[0, 0] == 1 / 128 and s[1, 1] == 1 / 64 and s[2, 0] == 1 / 256  # amax 1 -> 448 -> 256
    assert torch.equal(q.rowwise.dequantize(), x)
    c = q.columnwise
    assert c.shape == (200, 130) and c.scale_inv.shape == (200, 2)  # 128x1 blocks of x, stored as x.T
    assert c.scale_inv[0, 0] == 1 / 128 and c.scale_inv[150, 0] == 1 / 64 and c.scale_inv[0, 1] == 1 / 256
    assert torch.equal(c.dequantize(), x.t())


def test_float8_block_fp32_scales_and_2d():
    x = torch.ones(256, 128)
    x[200, 3] = 3.0
    q = Float8BlockQuantizer(fmt=E4M3, block_scaling_dim=2, power_2_scale=False).quantize(x)
    assert q.rowwise.scale_inv.shape == (2, 1)
    assert (q.rowwise.scale_inv[1, 0].item() == f32(1 / f32(448 / 3))
            and q.rowwise.scale_inv[0, 0].item() == f32(1 / 448))
    assert torch.equal(q.columnwise.data, q.rowwise.data.t())
    torch.testing.assert_close(q.rowwise.dequantize(), x, rtol=0.0625, atol=0)


# --------------------------------------------------------------------------- NVFP4


def test_nvfp4_global_scale_rules():
    amax = torch.tensor([2688.0, 0.0, math.inf, math.nan, 1e-40, 6.0])
    got = nvfp4_global_encode_scale(amax).tolist()
    assert got == [1.0, 1.0, 1.0, FLT_MAX, FLT_MAX, 448.0]


def test_nvfp4_exact_codes_when_global_scale_is_one():
    grid = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    x = torch.zeros(16, 32)
    x[:, :16] = torch.tensor([grid[i % 8] * (-1) ** (i // 8) for i in range(16)])
    x[:, :16][:, 7] = 6.0  # every row block in the first half reaches 6
    x[0, 16] = 2688.0  # global amax 2688 -> S_enc = 1
    q = NVFP4Quantizer().quantize(x, columnwise=False).rowwise
    assert q.global_scale_inv.item() == 1.0
    scales = q.block_scale_factors()
    assert scales[:, 0].tolist() == [1.0] * 16  # e4m3(6 * (1 * 1/6)) = 1
    assert scales[0, 1].item() == 448.0 and scales[1, 1].item() == 0.0
    codes = unpack_fp4(q.data)
    want = [i % 8 + 8 * (i // 8) for i in range(16)]
    want[7] = 7
    want[8] = 0  # -0 of the input is +0 code, as TE's cast_to_fp4x2
    assert codes[3, :16].tolist() == want
    assert codes[0, 16].item() == 7 and codes[0, 17:].sum() == 0
    assert torch.equal(q.dequantize(), x)


def test_nvfp4_scales_match_formula():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=gen) * 5
    q = NVFP4Quantizer().quantize(x, columnwise=False).rowwise
    amax = x.abs().max()
    s_enc = torch.tensor(2688.0) / amax
    block_amax = x.abs().reshape(32, 4, 16).amax(-1)
    want = (block_amax * (s_enc * torch.tensor(1 / 6.0))).to(torch.float8_e4m3fn)
    assert torch.equal(q.scale_inv, want.view(torch.uint8))
    assert q.global_scale_inv.item() == (1 / s_enc).item()
    err = (q.dequantize() - x).abs() / (block_amax.repeat_interleave(16, 1))
    assert err.max() <= 1 / 6 * 1.1  # half a step at the top of E2M1 is 1 in 6


def test_nvfp4_2d_blocks_columnwise_and_shape_errors():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(32, 48, generator=gen)
    q = NVFP4Quantizer(with_2d_quantization=True).quantize(w)
    assert q.rowwise.scale_inv.shape == (2, 3) and q.rowwise.block == (16, 16)
    assert torch.equal(q.columnwise.scale_inv, q.rowwise.scale_inv.t())
    assert torch.equal(unpack_fp4(q.columnwise.data), unpack_fp4(q.rowwise.data).t())
    for shape in [(32, 40), (24, 32)]:
        with pytest.raises(ValueError, match="multiples of 16"):
            NVFP4Quantizer().quantize(torch.ones(shape))


def test_nvfp4_rht_columnwise():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 32, generator=gen)
    x[5, 3] = 40.0  # an outlier the transform spreads out
    q = NVFP4Quantizer(with_rht=True).quantize(x)
    assert not q.rowwise.hadamard and q.columnwise.hadamard
    assert q.columnwise.amax.item() == apply_rht(x.t().contiguous()).abs().max().item()
    assert q.rowwise.amax.item() == 40.0
    # Error bound per element in the transformed domain: half the widest E2M1 step (1 of 6)
    # of the block amax, plus 1/16 for the E4M3 block scale's rounding.
    t = apply_rht(x.t().contiguous())
    block_amax = t.abs().reshape(32, 4, 16).amax(-1, keepdim=True)
    bound = (block_amax / 6 * (1 + 1 / 16)).expand(32, 4, 16).reshape(32, 64)
    assert ((q.columnwise.dequantize() - t).abs() <= bound).all()
    # The transform is orthonormal: undoing it keeps each group's error norm.
    back = q.columnwise.dequantize(undo_hadamard=True)
    err_norm = (back - x.t()).reshape(32, 4, 16).norm(dim=-1)
    assert (err_norm <= bound.reshape(32, 4, 16).norm(dim=-1) * (1 + 1e-5)).all()


def test_nvfp4_stochastic_rounding_seeded_and_unbiased():
    x = torch.full((256, 256), 2.3)
    x[0, 0] = 6.0  # global amax 6 -> S_enc = 448
    a = NVFP4Quantizer(stochastic_rounding=True, generator=torch.Generator().manual_seed(3)).quantize(x)
    b = NVFP4Quantizer(stochastic_rounding=True, generator=torch.Generator().manual_seed(3)).quantize(x)
    assert torch.equal(a.rowwise.data, b.rowwise.data) and torch.equal(a.columnwise.data, b.columnwise.data)
    q = a.rowwise
    # Blocks of 2.3: S_dec = e4m3(2.3 * 448 / 6) = 176 (e4m3 step 16 there), so each element is
    # 2.3 * 448 / 176 = 5.8545..., between the E2M1 points 4 and 6.
    assert q.block_scale_factors()[1:, :].unique().tolist() == [176.0]
    v = f32(2.3) * f32(1 / f32(176.0 * f32(1 / 448.0)))
    codes = e2m1_decode(unpack_fp4(q.data))[1:]
    assert set(codes.unique().tolist()) == {4.0, 6.0}
    p = (v - 4.0) / 2.0
    n = codes.numel()
    sigma = 2.0 * math.sqrt(p * (1 - p) / n)
    assert abs(codes.mean().item() - v) < 5 * sigma
    rne = NVFP4Quantizer().quantize(x).rowwise
    assert (e2m1_decode(unpack_fp4(rne.data))[1:] == 6.0).all()  # nearest is 6: RNE is biased
    with pytest.raises(ValueError):
        NVFP4Quantizer(stochastic_rounding=True).quantize(x)


# --------------------------------------------------------------------------- GTP shards


def test_shard_with_reduced_amax_matches_full_quantization():
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(64, 32, generator=gen)
    w[50, 7] = 9.0  # the full tensor's amax lives in the second shard
    for quantizer in (CurrentScalingQuantizer(fmt=E4M3), NVFP4Quantizer(with_2d_quantization=True)):
        full = quantizer.quantize(w, columnwise=False).rowwise
        shard = w[:32]
        amax = w.abs().max()
        shared = quantizer.quantize(shard, amax=amax, columnwise=False).rowwise
        local = quantizer.quantize(shard, columnwise=False).rowwise
        full_rows = full.data[: shared.data.shape[0]]
        assert torch.equal(shared.data, full_rows)
        assert not torch.equal(local.data, full_rows)  # the parity hazard a local amax creates
