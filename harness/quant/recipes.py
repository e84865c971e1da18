"""Transformer Engine's quantization recipes as keyword-only dataclasses.

Field names and defaults mirror transformer_engine/common/recipe/__init__.py, including the
defaults TE reads from environment variables. Which quantizer serves which tensor follows
the ``*RecipeState.make_quantizers`` methods of transformer_engine/pytorch/quantization.py.
Features the emulation does not model are refused in ``__post_init__`` with a ValueError
rather than silently ignored.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Mapping, Optional, Union

import torch

from .formats import E2M1, E4M3, E5M2, FloatFormat
from .nvfp4 import NVFP4Quantizer
from .quantizers import (
    AmaxReduction,
    CurrentScalingQuantizer,
    DelayedScalingQuantizer,
    Float8BlockQuantizer,
    MXFP8Quantizer,
    OperandSpec,
    Quantizer,
)

__all__ = [
    "RECIPES",
    "DelayedScaling",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Format",
    "GemmOperand",
    "LinearQuantizers",
    "MMParams",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "QParams",
    "Recipe",
]

TENSOR_KINDS = ("input", "weight", "grad_output")


class Format(enum.Enum):
    """Element formats for (forward, backward) tensors, as TE's ``recipe.Format``."""

    E2M1 = "E2M1"
    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"

    def __repr__(self) -> str:
        return f"Format.{self.name}"

    @property
    def fwd(self) -> FloatFormat:
        """Format of input and weight."""
        return _FORMATS[self][0]

    @property
    def bwd(self) -> FloatFormat:
        """Format of grad_output."""
        return _FORMATS[self][1]


_FORMATS = {
    Format.E2M1: (E2M1, E2M1),
    Format.E4M3: (E4M3, E4M3),
    Format.E5M2: (E5M2, E5M2),
    Format.HYBRID: (E4M3, E5M2),
}


class GemmOperand(enum.Enum):
    """The six operands of a Linear layer's GEMMs, as (tensor, copy used).

    fprop = input x weight; dgrad = grad_output x weight; wgrad = input x grad_output.
    The rowwise copy has blocks along the tensor's last dim, the columnwise one along its
    first dim (the contraction dim of dgrad's weight and of both wgrad operands).
    """

    FPROP_INPUT = ("input", "rowwise")
    FPROP_WEIGHT = ("weight", "rowwise")
    DGRAD_GRAD_OUTPUT = ("grad_output", "rowwise")
    DGRAD_WEIGHT = ("weight", "columnwise")
    WGRAD_INPUT = ("input", "columnwise")
    WGRAD_GRAD_OUTPUT = ("grad_output", "columnwise")

    @property
    def tensor(self) -> str:
        """"input", "weight" or "grad_output"."""
        return self.value[0]

    @property
    def usage(self) -> str:
        """"rowwise" or "columnwise"."""
        return self.value[1]


@dataclass(frozen=True, kw_only=True, slots=True)
class QParams:
    """Per-tensor quantization options, TE's ``recipe.QParams``."""

    power_2_scale: bool = False
    """Round scales down to powers of two."""
    amax_epsilon: float = 0.0
    """Floor for amaxes."""
    random_hadamard_transform: bool = False
    """Hadamard transform on the columnwise copy (NVFP4)."""
    stochastic_rounding: bool = False
    """Stochastic rounding of elements (NVFP4)."""
    fp4_2d_quantization: bool = False
    """16x16 scale blocks (NVFP4)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MMParams:
    """GEMM options, TE's ``recipe.MMParams``. Kept for configuration parity only: the
    emulated GEMM always accumulates in fp32, so fast accumulation is not modelled."""

    use_split_accumulator: bool = True
    """False selects cuBLAS FP8 fast accumulation on Hopper."""


def _env_flag(name: str) -> Callable[[], bool]:
    return lambda: os.getenv(name, "0") == "1"


def _backward_override() -> Optional[str]:
    return os.getenv("NVTE_BACKWARD_OVERRIDE", None)


def _as_reductions(amax_reduction) -> dict[str, Optional[AmaxReduction]]:
    if amax_reduction is None or callable(amax_reduction):
        return {kind: amax_reduction for kind in TENSOR_KINDS}
    unknown = set(amax_reduction) - set(TENSOR_KINDS)
    if unknown:
        raise ValueError(f"amax_reduction keys must be among {TENSOR_KINDS}, got {sorted(unknown)}")
    return {kind: amax_reduction.get(kind) for kind in TENSOR_KINDS}


@dataclass(kw_only=True)
class LinearQuantizers:
    """The quantizers of one Linear layer, and the state that persists between steps."""

    recipe: "Recipe"
    """Recipe the quantizers were made from."""
    input: Quantizer
    """Quantizer of the layer input (fprop, wgrad)."""
    weight: Quantizer
    """Quantizer of the weight (fprop, dgrad)."""
    grad_output: Quantizer
    """Quantizer of the output gradient (dgrad, wgrad)."""
    auto_update: bool = True
    """Update delayed scales right after each forward and each backward, as TE does at
    autocast exit and at the end of backward for a single module. Turn off to call
    ``update_forward`` / ``update_backward`` yourself (several modules, several micro-batches)."""

    def quantizer(self, tensor: str) -> Quantizer:
        """Quantizer for "input", "weight" or "grad_output"."""
        if tensor not in TENSOR_KINDS:
            raise ValueError(f"tensor must be one of {TENSOR_KINDS}, got {tensor!r}")
        return getattr(self, tensor)

    def update_forward(self) -> None:
        """Delayed scaling: reduce amaxes and update the input and weight scales."""
        for q in (self.input, self.weight):
            if isinstance(q, DelayedScalingQuantizer):
                q.update()

    def update_backward(self) -> None:
        """Delayed scaling: reduce the amax and update the grad_output scale."""
        if isinstance(self.grad_output, DelayedScalingQuantizer):
            self.grad_output.update()


class Recipe:
    """Base of the recipes: builds quantizers and describes the GEMM operands."""

    __slots__ = ()
    name: ClassVar[str] = ""

    def _quantizer(self, tensor: str, *, device, amax_reduction, generator) -> Quantizer:
        raise NotImplementedError

    def make_quantizers(
        self,
        *,
        device: Union[torch.device, str] = "cpu",
        amax_reduction: Union[AmaxReduction, Mapping[str, AmaxReduction], None] = None,
        generator: Optional[torch.Generator] = None,
        seed: int = 0,
    ) -> LinearQuantizers:
        """Fresh quantizers for one Linear layer.

        ``amax_reduction`` is one in-place reducer for all tensors or a mapping by tensor
        kind ("input", "weight", "grad_output"): e.g. an all-reduce MAX over the group whose
        shards must share a per-tensor scale. ``generator`` (or a CPU generator seeded with
        ``seed``) drives stochastic rounding.
        """
        reductions = _as_reductions(amax_reduction)
        if generator is None:
            generator = torch.Generator(device="cpu").manual_seed(seed)
        made = {
            kind: self._quantizer(kind, device=device, amax_reduction=reductions[kind], generator=generator)
            for kind in TENSOR_KINDS
        }
        return LinearQuantizers(recipe=self, **made)

    def operand_specs(self) -> dict[GemmOperand, OperandSpec]:
        """Format, blocks and scale type of each of the six GEMM operands."""
        q = self.make_quantizers()
        return {op: q.quantizer(op.tensor).spec(op.usage) for op in GemmOperand}


def _check_common(recipe, fmt: Format) -> None:
    if fmt == Format.E5M2:
        raise ValueError(f"{type(recipe).__name__}: pure E5M2 training is not supported "
                         "(TE asserts the same)")
    if fmt == Format.E2M1:
        raise ValueError(f"{type(recipe).__name__}: E2M1 is the NVFP4 recipe's format")
    if getattr(recipe, "backward_override", None) is not None:
        raise ValueError(
            f"{type(recipe).__name__}: backward_override={recipe.backward_override!r} is not emulated "
            "(set from NVTE_BACKWARD_OVERRIDE?)"
        )
    if getattr(recipe, "fp8_dpa", False) or getattr(recipe, "fp8_mha", False):
        raise ValueError(f"{type(recipe).__name__}: FP8 attention (fp8_dpa / fp8_mha) is not emulated")


@dataclass(kw_only=True, slots=True)
class DelayedScaling(Recipe):
    """Per-tensor FP8 with scales from an amax history of earlier steps."""

    name: ClassVar[str] = "delayed"
    margin: int = 0
    """Scale = fp8_max / amax / 2**margin."""
    fp8_format: Format = Format.HYBRID
    """E4M3 or HYBRID (E4M3 forward, E5M2 backward)."""
    amax_history_len: int = 1024
    """Length of the amax history window."""
    amax_compute_algo: Union[str, Callable] = "max"
    """"max", "most_recent" or ``f(amax_history) -> amax``."""
    scaling_factor_compute_algo: Optional[Callable] = None
    """``f(amax, scale, fp8_max, recipe) -> scale``; None for the default formula."""
    reduce_amax: bool = True
    """Reduce amaxes across the amax group (the ``amax_reduction`` given to make_quantizers)."""
    fp8_dpa: bool = False
    """FP8 attention; not emulated, must stay False."""
    fp8_mha: bool = False
    """FP8 multi-head attention; not emulated, must stay False."""
    backward_override: Optional[str] = field(default_factory=_backward_override)
    """TE: None only for delayed scaling."""

    def __post_init__(self) -> None:
        _check_common(self, self.fp8_format)
        if not (callable(self.amax_compute_algo) or self.amax_compute_algo in ("max", "most_recent")):
            raise ValueError(f"amax_compute_algo must be 'max', 'most_recent' or callable, got "
                             f"{self.amax_compute_algo!r}")
        if self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be >= 1, got {self.amax_history_len}")

    def _quantizer(self, tensor, *, device, amax_reduction, generator) -> Quantizer:
        fmt = self.fp8_format.bwd if tensor == "grad_output" else self.fp8_format.fwd
        return DelayedScalingQuantizer(
            fmt=fmt, margin=self.margin, amax_history_len=self.amax_history_len,
            amax_compute_algo=self.amax_compute_algo,
                scaling_factor_compute_algo=self.scaling_factor_compute_algo,
            amax_reduction=amax_reduction if self.reduce_amax else None, recipe=self, device=device,
        )


@dataclass(kw_only=True, slots=True)
class Float8CurrentScaling(Recipe):
    """Per-tensor FP8 with the scale from the tensor's own amax."""

    name: ClassVar[str] = "float8_current_scaling"
    use_power_2_scales: bool = field(default_factory=_env_flag("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES"))
    """Round scales down to powers of two (the quantizers read this field, as TE's do)."""
    fp8_format: Format = Format.HYBRID
    """E4M3 or HYBRID."""
    fp8_quant_fwd_inp: QParams = field(init=False)
    """Derived from use_power_2_scales, for reports."""
    fp8_quant_fwd_weight: QParams = field(init=False)
    """Derived from use_power_2_scales, for reports."""
    fp8_quant_bwd_grad: QParams = field(init=False)
    """Derived from use_power_2_scales, for reports."""
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
    """TE's fprop GEMM uses fast accumulation; not modelled."""
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    """dgrad GEMM options."""
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    """wgrad GEMM options."""
    fp8_dpa: bool = False
    """Not emulated, must stay False."""
    fp8_mha: bool = False
    """Not emulated, must stay False."""
    backward_override: Optional[str] = field(default_factory=_backward_override)
    """Only None is emulated."""

    def __post_init__(self) -> None:
        _check_common(self, self.fp8_format)
        qp = QParams(power_2_scale=self.use_power_2_scales, amax_epsilon=0.0)
        self.fp8_quant_fwd_inp = self.fp8_quant_fwd_weight = self.fp8_quant_bwd_grad = qp

    def _quantizer(self, tensor, *, device, amax_reduction, generator) -> Quantizer:
        fmt = self.fp8_format.bwd if tensor == "grad_output" else self.fp8_format.fwd
        return CurrentScalingQuantizer(fmt=fmt, power_2_scale=self.use_power_2_scales,
                                       amax_reduction=amax_reduction)


@dataclass(kw_only=True, slots=True)
class MXFP8BlockScaling(Recipe):
    """FP8 with an E8M0 scale per 32 elements, rowwise and columnwise."""

    name: ClassVar[str] = "mxfp8"
    margin: int = 0
    """Present in TE's recipe; unused by MXFP8 quantization."""
    fp8_format: Format = Format.E4M3
    """E4M3 or HYBRID (E5M2 grads)."""
    fp8_dpa: bool = False
    """Not emulated, must stay False."""
    fp8_mha: bool = False
    """Not emulated, must stay False."""
    backward_override: Optional[str] = field(default_factory=_backward_override)
    """Only None is emulated."""
    enable_2d_quantization: bool = False
    """32x32 scale blocks for the weight (forward weight quantizer only)."""

    def __post_init__(self) -> None:
        _check_common(self, self.fp8_format)

    def _quantizer(self, tensor, *, device, amax_reduction, generator) -> Quantizer:
        fmt = self.fp8_format.bwd if tensor == "grad_output" else self.fp8_format.fwd
        return MXFP8Quantizer(fmt=fmt, with_2d_quantization=self.enable_2d_quantization
                              and tensor == "weight")


def _block_qparams() -> QParams:
    # Evaluated from the environment like TE's class attributes; TE does not derive these
    # from the use_f32_scales field, so passing use_f32_scales=True alone keeps power-of-2
    # scales there, and here.
    return QParams(power_2_scale=os.getenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0") != "1",
                   amax_epsilon=0.0)


@dataclass(kw_only=True, slots=True)
class Float8BlockScaling(Recipe):
    """FP8 with fp32 scales per 1x128 (activations, grads) or 128x128 (weights) block."""

    name: ClassVar[str] = "float8_block_scaling"
    use_f32_scales: bool = field(default_factory=_env_flag("NVTE_FP8_BLOCK_SCALING_FP32_SCALES"))
    """Mirrors TE's field; the quantizers read the QParams below, as TE's do."""
    fp8_format: Format = Format.E4M3
    """E4M3 or HYBRID."""
    fp8_quant_fwd_inp: QParams = field(default_factory=_block_qparams)
    """Input scales: power of two unless NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1."""
    fp8_quant_fwd_weight: QParams = field(default_factory=_block_qparams)
    """Weight scales."""
    fp8_quant_bwd_grad: QParams = field(default_factory=_block_qparams)
    """Gradient scales."""
    x_block_scaling_dim: int = 1
    """1 (1x128) or 2 (128x128) for inputs."""
    w_block_scaling_dim: int = 2
    """1 or 2 for weights."""
    grad_block_scaling_dim: int = 1
    """1 or 2 for grads."""
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=True)
    """Must use split accumulation."""
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    """Must use split accumulation."""
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    """Must use split accumulation."""
    fp8_dpa: bool = False
    """Not supported by TE for this recipe."""
    fp8_mha: bool = False
    """Not supported by TE for this recipe."""
    backward_override: Optional[str] = field(default_factory=_backward_override)
    """Only None is emulated."""

    def __post_init__(self) -> None:
        dims = {"x": self.x_block_scaling_dim, "w": self.w_block_scaling_dim,
                "grad": self.grad_block_scaling_dim}
        for key, dim in dims.items():
            if dim not in (1, 2):
                raise ValueError(f"{key}_block_scaling_dim must be 1 or 2, got {dim}")
        for a, b in (("x", "w"), ("x", "grad"), ("w", "grad")):
            if dims[a] == 2 and dims[b] == 2:
                raise ValueError(f"2D by 2D block GEMM not supported ({a} and {b} both 2)")
        for gemm in ("fprop", "dgrad", "wgrad"):
            if not getattr(self, f"fp8_gemm_{gemm}").use_split_accumulator:
                raise ValueError(f"split accumulator required for {gemm}")
        _check_common(self, self.fp8_format)

    def _quantizer(self, tensor, *, device, amax_reduction, generator) -> Quantizer:
        if tensor == "weight":
            qp, dim, fmt = self.fp8_quant_fwd_weight, self.w_block_scaling_dim, self.fp8_format.fwd
        elif tensor == "grad_output":
            qp, dim, fmt = self.fp8_quant_bwd_grad, self.grad_block_scaling_dim, self.fp8_format.bwd
        else:
            qp, dim, fmt = self.fp8_quant_fwd_inp, self.x_block_scaling_dim, self.fp8_format.fwd
        return Float8BlockQuantizer(
            fmt=fmt, block_scaling_dim=dim, power_2_scale=qp.power_2_scale, amax_epsilon=qp.amax_epsilon
        )


@dataclass(kw_only=True, slots=True)
class NVFP4BlockScaling(Recipe):
    """NVFP4: 2D weight blocks, RHT on wgrad operands, stochastic rounding of grads."""

    name: ClassVar[str] = "nvfp4"
    disable_rht: bool = field(default_factory=_env_flag("NVTE_NVFP4_DISABLE_RHT"))
    """No Hadamard transform anywhere."""
    disable_stochastic_rounding: bool = field(
        default_factory=_env_flag("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING"))
    """Round grads to nearest even (changes the recipe, as in TE)."""
    disable_2d_quantization: bool = field(default_factory=_env_flag("NVTE_NVFP4_DISABLE_2D_QUANTIZATION"))
    """1x16 blocks for weights too."""
    row_scaled_activation: bool = field(default_factory=_env_flag("NVTE_NVFP4_ROW_SCALED_ACTIVATION"))
    """Per-row amax for activations; not emulated, must stay False."""
    nvfp4_4over6: str = field(default_factory=lambda: os.getenv("NVTE_NVFP4_4OVER6", "none"))
    """4over6 block selection; not emulated, must stay "none"."""
    nvfp4_4over6_e4m3_use_256: str = field(default_factory=lambda: os.getenv("NVTE_NVFP4_4OVER6_E4M3_USE_256",
                                                                             "all"))
    """Only meaningful with 4over6."""
    nvfp4_4over6_err_mode: str = field(default_factory=lambda: os.getenv("NVTE_NVFP4_4OVER6_ERR_MODE",
                                                                         "MAE").upper())
    """Only meaningful with 4over6."""
    fp4_format: Format = Format.E2M1
    """Element format; E2M1 only."""
    fp8_format: Format = Format.E4M3
    """Block scale format; E4M3 only."""
    fp8_dpa: bool = False
    """Not emulated, must stay False."""
    fp8_mha: bool = False
    """Not emulated, must stay False."""
    backward_override: Optional[str] = field(default_factory=_backward_override)
    """Only None is emulated."""
    rne: bool = False
    """Emulation switch, not in TE: keep the recipe as TE runs it but round the stochastic
    operands to nearest even, for bit-reproducible runs. (TE's hardware stochastic rounding
    cannot be reproduced bit for bit; disable_stochastic_rounding changes the TE run instead.)"""
    fp4_quant_fwd_inp: QParams = field(init=False)
    """Derived: RHT on the input's columnwise copy."""
    fp4_quant_fwd_weight: QParams = field(init=False)
    """Derived: 2D blocks for weights."""
    fp4_quant_bwd_grad: QParams = field(init=False)
    """Derived: RHT and stochastic rounding for grads."""

    def __post_init__(self) -> None:
        if self.fp4_format != Format.E2M1:
            raise ValueError("only E2M1 is supported for NVFP4 scaling")
        if self.fp8_format != Format.E4M3:
            raise ValueError("only E4M3 block scales are supported for NVFP4 scaling")
        if self.row_scaled_activation:
            raise ValueError("row_scaled_activation (NVTE_NVFP4_ROW_SCALED_ACTIVATION) is not emulated")
        if self.nvfp4_4over6 != "none":
            raise ValueError(f"nvfp4_4over6={self.nvfp4_4over6!r} (NVTE_NVFP4_4OVER6) is not emulated")
        _check_common(self, Format.E4M3)
        # RHT only on the columnwise (wgrad) copies, TE's NVFP4BlockScaling.__post_init__.
        self.fp4_quant_fwd_inp = QParams(random_hadamard_transform=not self.disable_rht)
        self.fp4_quant_fwd_weight = QParams(fp4_2d_quantization=not self.disable_2d_quantization)
        self.fp4_quant_bwd_grad = QParams(
            random_hadamard_transform=not self.disable_rht,
            stochastic_rounding=not self.disable_stochastic_rounding,
        )

    def _quantizer(self, tensor, *, device, amax_reduction, generator) -> Quantizer:
        qp = {"input": self.fp4_quant_fwd_inp, "weight": self.fp4_quant_fwd_weight}.get(tensor,
            self.fp4_quant_bwd_grad)
        return NVFP4Quantizer(
            with_rht=qp.random_hadamard_transform,
            with_2d_quantization=qp.fp4_2d_quantization,
            stochastic_rounding=qp.stochastic_rounding and not self.rne,
            generator=generator,
            amax_reduction=amax_reduction,
        )


RECIPES: dict[str, type[Recipe]] = {
    cls.name: cls
    for cls in (DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, Float8BlockScaling,
                NVFP4BlockScaling)
}
"""Recipe classes by name (the names of TE's ``Recipe`` predicates)."""
