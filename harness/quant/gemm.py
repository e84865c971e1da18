"""A Linear layer whose three GEMMs use quantized operands, as TE's Linear does.

    fprop: y  = q(input)       x q(weight)^T      (rowwise copies)
    dgrad: dx = q(grad_output) x q(weight)        (grad rowwise, weight columnwise)
    wgrad: dW = q(grad_output)^T x q(input)       (both columnwise)

Each GEMM dequantizes its operands to fp32 and multiplies in fp32, so the only error
modelled is quantization; TE's tensor-core accumulation order is not reproduced.
"""

from __future__ import annotations

from typing import Optional

import torch

from .qtensor import QuantizedTensor
from .recipes import LinearQuantizers, Recipe

__all__ = ["QuantizedLinear", "quantized_linear", "quantized_matmul"]


def quantized_matmul(a: QuantizedTensor, b: QuantizedTensor) -> torch.Tensor:
    """``a @ b.T`` in fp32 from two quantized matrices sharing their last (contraction) dim.

    When both operands were Hadamard transformed along the contraction dim the transforms
    cancel (the matrix is orthonormal), so they are used as stored, like TE's GEMM does;
    a single transformed operand is transformed back first.
    """
    both = a.hadamard and b.hadamard
    lhs = a.dequantize(torch.float32, undo_hadamard=not both)
    rhs = b.dequantize(torch.float32, undo_hadamard=not both)
    if lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"contraction dims differ: {tuple(lhs.shape)} x {tuple(rhs.shape)}^T")
    return lhs @ rhs.t()


class _QuantizedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, weight, bias, quantizers: LinearQuantizers):
        in_features = weight.shape[1]
        x2 = inp.reshape(-1, in_features)
        need_dgrad = inp.requires_grad
        need_wgrad = weight.requires_grad
        qx = quantizers.input.quantize(x2, rowwise=True, columnwise=need_wgrad)
        qw = quantizers.weight.quantize(weight, rowwise=True, columnwise=need_dgrad)
        y = quantized_matmul(qx.rowwise, qw.rowwise)
        if bias is not None:
            y = y + bias.to(torch.float32)
        if quantizers.auto_update:
            quantizers.update_forward()
        ctx.quantizers = quantizers
        ctx.qx_col = qx.columnwise
        ctx.qw_col = qw.columnwise
        ctx.shapes = (inp.shape, inp.dtype, weight.dtype, bias is not None)
        return y.to(inp.dtype).reshape(*inp.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        inp_shape, inp_dtype, w_dtype, has_bias = ctx.shapes
        quantizers: LinearQuantizers = ctx.quantizers
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        need_dgrad, need_wgrad, need_bgrad = ctx.needs_input_grad[:3]
        dx = dw = db = None
        if need_dgrad or need_wgrad:
            qg = quantizers.grad_output.quantize(g2, rowwise=need_dgrad, columnwise=need_wgrad)
            if need_dgrad:
                dx = quantized_matmul(qg.rowwise, ctx.qw_col).to(inp_dtype).reshape(inp_shape)
            if need_wgrad:
                dw = quantized_matmul(qg.columnwise, ctx.qx_col).to(w_dtype)
            if quantizers.auto_update:
                quantizers.update_backward()
        if has_bias and need_bgrad:
            db = g2.to(torch.float32).sum(0).to(grad_out.dtype)
        ctx.qx_col = ctx.qw_col = None
        return dx, dw, db, None


def quantized_linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    recipe: Recipe,
    state: Optional[LinearQuantizers] = None,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``input @ weight.T + bias`` with every GEMM operand quantized as ``recipe`` prescribes.

    ``state`` holds the layer's quantizers (``recipe.make_quantizers()``); it must persist
    across steps for delayed scaling, so it may only be omitted for stateless recipes.
    """
    if state is None:
        if recipe.name == "delayed":
            raise ValueError("delayed scaling keeps amax history: pass state=recipe.make_quantizers() and "
                             "reuse it")
        state = recipe.make_quantizers(device=input.device)
    elif state.recipe is not recipe and type(state.recipe) is not type(recipe):
        raise ValueError(
            f"state was made for {type(state.recipe).__name__}, not {type(recipe).__name__}"
        )
    return _QuantizedLinearFunction.apply(input, weight, bias, state)


class QuantizedLinear(torch.nn.Linear):
    """``torch.nn.Linear`` whose GEMMs are quantized by a recipe; keeps its quantizer state."""

    def __init__(self, in_features: int, out_features: int, *, recipe: Recipe, bias: bool = True,
                 device=None, dtype=None, amax_reduction=None, seed: int = 0) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = recipe
        self.quantizers = recipe.make_quantizers(
            device=self.weight.device, amax_reduction=amax_reduction, seed=seed
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Quantized ``F.linear``."""
        return quantized_linear(input, self.weight, self.recipe, self.quantizers, self.bias)
