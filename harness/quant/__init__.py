"""Pure-PyTorch emulation of Transformer Engine's FP8 / FP4 quantization recipes.

- ``formats``: E4M3, E5M2, E2M1 and E8M0 casts, bit-exact and device independent.
- ``quantizers``: per-tensor (current, delayed), FP8 block and MXFP8 quantizers.
- ``nvfp4`` / ``hadamard``: the NVFP4 quantizer and its random Hadamard transform.
- ``recipes``: TE's recipe dataclasses and the quantizer each GEMM operand uses.
- ``gemm``: a Linear autograd function and module with quantized fprop, dgrad and wgrad.
"""

from .formats import E2M1, E4M3, E5M2, FloatFormat
from .gemm import QuantizedLinear, quantized_linear, quantized_matmul
from .nvfp4 import NVFP4Quantizer
from .quantizers import (
    CurrentScalingQuantizer,
    DelayedScalingQuantizer,
    Float8BlockQuantizer,
    MXFP8Quantizer,
    OperandSpec,
    Quantized,
    QuantizedTensor,
    Quantizer,
    scale_from_amax,
)
from .recipes import (
    RECIPES,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    GemmOperand,
    LinearQuantizers,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)

__all__ = [
    "E2M1",
    "E4M3",
    "E5M2",
    "RECIPES",
    "CurrentScalingQuantizer",
    "DelayedScaling",
    "DelayedScalingQuantizer",
    "Float8BlockQuantizer",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "FloatFormat",
    "Format",
    "GemmOperand",
    "LinearQuantizers",
    "MXFP8BlockScaling",
    "MXFP8Quantizer",
    "NVFP4BlockScaling",
    "NVFP4Quantizer",
    "OperandSpec",
    "Quantized",
    "QuantizedLinear",
    "QuantizedTensor",
    "Quantizer",
    "Recipe",
    "quantized_linear",
    "quantized_matmul",
    "scale_from_amax",
]
