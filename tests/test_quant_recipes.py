"""Recipes: TE's field names and defaults, validation, and the quantizer of each GEMM operand."""

import dataclasses

import pytest
import torch

from harness.quant import recipes as R
from harness.quant.quantizers import DelayedScalingQuantizer


def field_defaults(cls) -> dict:
    out = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def test_registry_names_and_classes():
    assert set(R.RECIPES) == {"delayed", "float8_current_scaling", "mxfp8", "float8_block_scaling", "nvfp4"}
    for name, cls in R.RECIPES.items():
        assert cls.name == name and issubclass(cls, R.Recipe)


def test_defaults_mirror_transformer_engine(monkeypatch):
    for var in ("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "NVTE_FP8_BLOCK_SCALING_FP32_SCALES",
                "NVTE_NVFP4_DISABLE_RHT", "NVTE_BACKWARD_OVERRIDE"):
        monkeypatch.delenv(var, raising=False)
    # values from transformer_engine/common/recipe/__init__.py
    d = field_defaults(R.DelayedScaling)
    assert d["margin"] == 0 and d["fp8_format"] is R.Format.HYBRID and d["amax_history_len"] == 1024
    assert (d["amax_compute_algo"] == "max" and d["reduce_amax"] is True
            and d["scaling_factor_compute_algo"] is None)
    assert field_defaults(R.Float8CurrentScaling)["use_power_2_scales"] is False
    assert field_defaults(R.MXFP8BlockScaling)["fp8_format"] is R.Format.E4M3
    b = R.Float8BlockScaling()
    assert (b.x_block_scaling_dim, b.w_block_scaling_dim, b.grad_block_scaling_dim) == (1, 2, 1)
    assert b.fp8_quant_fwd_weight.power_2_scale is True
    n = R.NVFP4BlockScaling()
    assert n.fp4_quant_fwd_inp.random_hadamard_transform and not n.fp4_quant_fwd_inp.stochastic_rounding
    assert n.fp4_quant_fwd_weight.fp4_2d_quantization and not n.fp4_quant_fwd_weight.random_hadamard_transform
    assert n.fp4_quant_bwd_grad.random_hadamard_transform and n.fp4_quant_bwd_grad.stochastic_rounding


def test_environment_defaults(monkeypatch):
    monkeypatch.setenv("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "1")
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1")
    monkeypatch.setenv("NVTE_NVFP4_DISABLE_RHT", "1")
    assert R.Float8CurrentScaling().use_power_2_scales is True
    assert R.Float8BlockScaling().fp8_quant_fwd_inp.power_2_scale is False
    assert not R.NVFP4BlockScaling().fp4_quant_bwd_grad.random_hadamard_transform
    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", "high_precision")
    with pytest.raises(ValueError, match="backward_override"):
        R.Float8CurrentScaling()


def test_keyword_only_and_validation():
    with pytest.raises(TypeError):
        R.DelayedScaling(1)
    with pytest.raises(ValueError, match="E5M2"):
        R.DelayedScaling(fp8_format=R.Format.E5M2)
    with pytest.raises(ValueError, match="amax_compute_algo"):
        R.DelayedScaling(amax_compute_algo="mean")
    with pytest.raises(ValueError, match="2D by 2D"):
        R.Float8BlockScaling(x_block_scaling_dim=2)
    with pytest.raises(ValueError, match="split accumulator"):
        R.Float8BlockScaling(fp8_gemm_fprop=R.MMParams(use_split_accumulator=False))
    with pytest.raises(ValueError, match="4over6"):
        R.NVFP4BlockScaling(nvfp4_4over6="all")
    with pytest.raises(ValueError, match="attention"):
        R.MXFP8BlockScaling(fp8_dpa=True)


OP = R.GemmOperand


def test_hybrid_formats_per_operand():
    for cls in (R.DelayedScaling, R.Float8CurrentScaling, R.MXFP8BlockScaling, R.Float8BlockScaling):
        specs = cls(fp8_format=R.Format.HYBRID).operand_specs()
        grads = {OP.DGRAD_GRAD_OUTPUT, OP.WGRAD_GRAD_OUTPUT}
        assert {op for op, s in specs.items() if s.fmt == "E5M2"} == grads, cls.__name__
        specs = cls(fp8_format=R.Format.E4M3).operand_specs()
        assert {s.fmt for s in specs.values()} == {"E4M3"}


def test_block_shapes_per_operand():
    mx = R.MXFP8BlockScaling().operand_specs()
    assert [mx[op].block for op in OP] == [(1, 32), (1, 32), (1, 32), (32, 1), (32, 1), (32, 1)]
    mx2 = R.MXFP8BlockScaling(enable_2d_quantization=True).operand_specs()
    assert mx2[OP.FPROP_WEIGHT].block == mx2[OP.DGRAD_WEIGHT].block == (32, 32)
    assert mx2[OP.FPROP_INPUT].block == (1, 32) and mx2[OP.WGRAD_GRAD_OUTPUT].block == (32, 1)
    fb = R.Float8BlockScaling().operand_specs()
    assert fb[OP.FPROP_WEIGHT].block == fb[OP.DGRAD_WEIGHT].block == (128, 128)
    assert fb[OP.FPROP_INPUT].block == (1, 128) and fb[OP.WGRAD_INPUT].block == (128, 1)
    assert fb[OP.FPROP_INPUT].scale_format == "fp32 power-of-2"
    per_tensor = R.Float8CurrentScaling(use_power_2_scales=True).operand_specs()
    assert all(s.block is None and s.scale_format == "fp32 power-of-2" for s in per_tensor.values())


def test_nvfp4_operand_table():
    specs = R.NVFP4BlockScaling().operand_specs()
    assert {op for op, s in specs.items() if s.hadamard} == {OP.WGRAD_INPUT, OP.WGRAD_GRAD_OUTPUT}
    assert {op for op, s in specs.items() if s.stochastic_rounding} == {OP.DGRAD_GRAD_OUTPUT,
                                                                        OP.WGRAD_GRAD_OUTPUT}
    assert specs[OP.FPROP_WEIGHT].block == specs[OP.DGRAD_WEIGHT].block == (16, 16)
    assert specs[OP.FPROP_INPUT].block == (1, 16) and specs[OP.WGRAD_INPUT].block == (16, 1)
    assert not any(s.stochastic_rounding for s in R.NVFP4BlockScaling(rne=True).operand_specs().values())
    plain = R.NVFP4BlockScaling(disable_rht=True, disable_2d_quantization=True).operand_specs()
    assert not any(s.hadamard for s in plain.values()) and plain[OP.FPROP_WEIGHT].block == (1, 16)


def test_make_quantizers_state_and_reductions():
    calls = []
    q = R.DelayedScaling(amax_history_len=4).make_quantizers(amax_reduction=lambda t: calls.append(t.item()))
    assert all(isinstance(getattr(q, k), DelayedScalingQuantizer) for k in ("input", "weight", "grad_output"))
    q.input.quantize(torch.tensor([2.0]))
    q.weight.quantize(torch.tensor([4.0]))
    q.update_forward()
    assert calls == [2.0, 4.0] and q.input.scale.item() == 224.0 and q.grad_output.scale.item() == 1.0
    no_reduce = R.DelayedScaling(reduce_amax=False).make_quantizers(amax_reduction=lambda t: calls.append(-1))
    no_reduce.input.quantize(torch.ones(2))
    no_reduce.update_forward()
    assert -1 not in calls
    per_kind = R.Float8CurrentScaling().make_quantizers(amax_reduction={"weight": lambda t: t.fill_(7.0)})
    assert per_kind.weight.quantize(torch.ones(2)).rowwise.scale_inv.item() == 1 / 64
    assert per_kind.input.quantize(torch.ones(2)).rowwise.scale_inv.item() == torch.tensor(1 / 448).item()
    with pytest.raises(ValueError):
        R.Float8CurrentScaling().make_quantizers(amax_reduction={"bias": lambda t: None})
