"""The quantized Linear: exact where the formats are exact, within TE's tolerances otherwise."""

import pytest
import torch

from harness.compare import bounds
from harness.quant import recipes as R
from harness.quant.gemm import QuantizedLinear, quantized_linear, quantized_matmul
from harness.quant.hadamard import apply_rht
from harness.quant.nvfp4 import NVFP4Quantizer

# tests/pytorch/utils.py dtype_tols of Transformer Engine
TOLS = {"E4M3": dict(rtol=0.125, atol=0.0675), "E5M2": dict(rtol=0.25, atol=0.125),
        "E2M1": dict(rtol=0.25, atol=0.125)}


def reference(x, w, dy):
    """fp32 fprop, dgrad and wgrad without quantization."""
    return x @ w.t(), dy @ w, dy.t() @ x


def run(recipe, x, w, dy, state=None):
    xi = x.clone().requires_grad_()
    wi = w.clone().requires_grad_()
    state = state or recipe.make_quantizers()
    y = quantized_linear(xi, wi, recipe, state)
    y.backward(dy)
    return y.detach(), xi.grad, wi.grad


def on_grid(shape, step: float, gen: torch.Generator, top: int = 7) -> torch.Tensor:
    """Values k * step, |k| <= top, with the amax top * step reached in row 0."""
    k = torch.randint(-top, top + 1, shape, generator=gen).float()
    k[0, 0] = top
    return k * step


EXACT = [
    pytest.param(R.DelayedScaling(), id="delayed"),
    pytest.param(R.Float8CurrentScaling(), id="current"),
    pytest.param(R.Float8CurrentScaling(use_power_2_scales=True, fp8_format=R.Format.E4M3),
                 id="current-e4m3-pow2"),
    pytest.param(R.MXFP8BlockScaling(), id="mxfp8"),
    pytest.param(R.MXFP8BlockScaling(fp8_format=R.Format.HYBRID, enable_2d_quantization=True),
                 id="mxfp8-hybrid-2d"),
    pytest.param(R.Float8BlockScaling(), id="block"),
    pytest.param(R.Float8BlockScaling(fp8_format=R.Format.HYBRID, x_block_scaling_dim=2,
                                      w_block_scaling_dim=1), id="block-x2d"),
]


@pytest.mark.parametrize("recipe", EXACT)
def test_exact_when_values_are_representable(recipe):
    # Half-integers up to 3.5 are E4M3 and E5M2 values; 3.5 = 448 / 2^7 = 57344 / 2^14, so
    # per-tensor scales are powers of two, and block scales are powers of two by construction.
    gen = torch.Generator().manual_seed(0)
    x, w, dy = on_grid((64, 96), 0.5, gen), on_grid((32, 96), 0.25, gen), on_grid((64, 32), 0.5, gen)
    got = run(recipe, x, w, dy)
    for name, a, b in zip(("fprop", "dgrad", "wgrad"), got, reference(x, w, dy)):
        assert torch.equal(a, b), name


def nvfp4_exact_operand(shape, gen):
    """E2M1 grid values times 7/8 with +-6 in every 16-block along both dims.

    The amax 5.25 gives S_enc = 2688 / 5.25 = 512 and block scales e4m3(448), so the decode
    factor 448 / 512 = 7 / 8 is exact and every element is its own E2M1 code.
    """
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6.0])
    q = grid[torch.randint(0, 8, shape, generator=gen)] * torch.where(torch.rand(shape, generator=gen) < 0.5,
                                                                      -1.0, 1.0)
    i, j = torch.arange(shape[0])[:, None], torch.arange(shape[1])[None, :]
    q = torch.where((i + j) % 16 == 0, torch.tensor(6.0), q)
    return q * 0.875


def test_nvfp4_exact_without_rht_and_stochastic_rounding():
    gen = torch.Generator().manual_seed(1)
    x, w, dy = (nvfp4_exact_operand(s, gen) for s in ((64, 48), (32, 48), (64, 32)))
    got = run(R.NVFP4BlockScaling(disable_rht=True, rne=True), x, w, dy)
    for name, a, b in zip(("fprop", "dgrad", "wgrad"), got, reference(x, w, dy)):
        assert torch.equal(a, b), name


def random_operands(seed, m=128, k=96, n=64):
    """Normal values clipped to +-3.5 (grads to +-1.75).

    The clip keeps every E2M1 block scale below 3.5 / 6 * 17/16, where nearest rounding
    (half a grid step) meets E2M1's atol/rtol and stochastic rounding (a full step) meets
    twice those, so the operand checks below cannot fail by chance.
    """
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    dy = torch.randn(m, n, generator=gen)
    return x.clamp(-3.5, 3.5), w.clamp(-3.5, 3.5), dy.clamp(-3.5, 3.5) / 2


def propagated_bound(a, b, tol_a, tol_b):
    """Largest |a' @ b'.T - a @ b.T| when every |a' - a| <= atol + rtol |a| (same for b)."""
    ea = tol_a["atol"] + tol_a["rtol"] * a.abs()
    eb = tol_b["atol"] + tol_b["rtol"] * b.abs()
    return ea @ b.abs().t() + a.abs() @ eb.t() + ea @ eb.t()


CASES = [
    pytest.param(R.DelayedScaling(), id="delayed"),
    pytest.param(R.Float8CurrentScaling(), id="current"),
    pytest.param(R.MXFP8BlockScaling(fp8_format=R.Format.HYBRID), id="mxfp8"),
    pytest.param(R.Float8BlockScaling(), id="block"),
    pytest.param(R.NVFP4BlockScaling(), id="nvfp4"),
    pytest.param(R.NVFP4BlockScaling(rne=True, disable_2d_quantization=True), id="nvfp4-rne-1d"),
]


@pytest.mark.parametrize("recipe", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_gemm_operands_and_results_within_te_tolerances(recipe, seed):
    x, w, dy = random_operands(seed)
    y, dx, dw = run(recipe, x, w, dy)
    q = recipe.make_quantizers()  # fresh state, same seed: the copies the layer used
    qx, qw, qg = q.input.quantize(x), q.weight.quantize(w), q.grad_output.quantize(dy)
    gemms = {
        "fprop": (y, qx.rowwise, qw.rowwise, x, w),
        "dgrad": (dx, qg.rowwise, qw.columnwise, dy, w.t()),
        "wgrad": (dw, qg.columnwise, qx.columnwise, dy.t(), x.t()),
    }
    for name, (out, qa, qb, a, b) in gemms.items():
        assert torch.equal(out, quantized_matmul(qa, qb)), f"{name} used other operand copies"
        if qa.hadamard and qb.hadamard:  # wgrad under NVFP4: compare in the transformed domain
            a, b = apply_rht(a.contiguous()), apply_rht(b.contiguous())
        tol_a, tol_b = TOLS[qa.fmt.name], TOLS[qb.fmt.name]
        if name != "fprop" and q.grad_output.spec("rowwise").stochastic_rounding:
            # stochastic rounding may move a full grid step, twice the nearest-rounding error
            tol_a = {key: 2 * v for key, v in tol_a.items()}
        torch.testing.assert_close(qa.dequantize(), a, **tol_a, msg=lambda m: f"{name} first operand: {m}")
        torch.testing.assert_close(qb.dequantize(), b, **tol_b, msg=lambda m: f"{name} second operand: {m}")
        err = (out - a @ b.t()).abs()
        assert (err <= propagated_bound(a, b, tol_a, tol_b)).all(), name
        assert err.max() > 0, f"{name} was not quantized at all"


def test_rht_cancels_in_wgrad():
    gen = torch.Generator().manual_seed(2)
    x, dy = torch.randn(64, 32, generator=gen), torch.randn(64, 48, generator=gen)
    q = NVFP4Quantizer(with_rht=True)
    qx, qg = q.quantize(x, rowwise=False).columnwise, q.quantize(dy, rowwise=False).columnwise
    direct = quantized_matmul(qg, qx)  # both in the Hadamard domain, used as stored
    undone = qg.dequantize(undo_hadamard=True) @ qx.dequantize(undo_hadamard=True).t()
    # Two fp32 GEMMs of length K of one exact product (the transform is orthonormal; undoing it
    # is exact in fp64 and rounded once, u per operand element): each within gamma_K |a| |b|^T
    # of its operands' exact product, the rounded operands 2u (1 + u) further.
    hd = [t.dequantize().double().abs() for t in (qg, qx)]
    plain = [t.dequantize(undo_hadamard=True).double().abs() for t in (qg, qx)]
    k = x.shape[0]  # the contraction: tokens
    bound = bounds.gamma(k + 3) * (hd[0] @ hd[1].t() + plain[0] @ plain[1].t())
    assert ((direct.double() - undone.double()).abs() <= bound).all()
    one_sided = quantized_matmul(qg, NVFP4Quantizer().quantize(x, rowwise=False).columnwise)
    exact = dy.t() @ x
    for result in (direct, one_sided):
        assert ((result - exact).norm() / exact.norm()).item() < 0.25


def test_delayed_scaling_updates_through_the_gemm():
    recipe = R.DelayedScaling(amax_history_len=2)
    state = recipe.make_quantizers()
    x, w, dy = random_operands(3)
    run(recipe, x, w, dy, state)
    assert state.input.scale.item() == torch.tensor(448.0) / x.abs().max()
    assert state.weight.scale.item() == torch.tensor(448.0) / w.abs().max()
    assert state.grad_output.scale.item() == torch.tensor(57344.0) / dy.abs().max()
    manual = recipe.make_quantizers()
    manual.auto_update = False
    run(recipe, x, w, dy, manual)
    assert manual.input.scale.item() == 1.0 and manual.input.amax_history[0] == x.abs().max()
    with pytest.raises(ValueError, match="state"):
        quantized_linear(x, w, recipe)


def test_module_bias_and_batched_input():
    torch.manual_seed(0)
    recipe = R.MXFP8BlockScaling()
    layer = QuantizedLinear(64, 32, recipe=recipe)
    x = torch.randn(2, 16, 64).clamp(-3.5, 3.5).requires_grad_()
    y = layer(x)
    assert y.shape == (2, 16, 32)
    y.backward(torch.ones_like(y))
    # the module is the functional form on flattened tokens plus an unquantized bias
    x2 = x.detach().reshape(32, 64).requires_grad_()
    w2 = layer.weight.detach().clone().requires_grad_()
    y2 = quantized_linear(x2, w2, recipe, recipe.make_quantizers()) + layer.bias.detach()
    y2.backward(torch.ones_like(y2))
    assert torch.equal(y.detach().reshape(32, 32), y2.detach())
    assert torch.equal(x.grad.reshape(32, 64), x2.grad) and torch.equal(layer.weight.grad, w2.grad)
    assert torch.equal(layer.bias.grad, torch.full((32,), 32.0))
    with pytest.raises(ValueError, match="made for"):
        quantized_linear(x, layer.weight, R.Float8CurrentScaling(), layer.quantizers)
