"""Tolerances: how far apart two runs may be under the ``dtype`` policy, and under a recipe.

Shared by the comparison (the ``dtype`` policy's bound) and the localizer (telling a
precision loss, within the format's tolerance, from a wrong result).
"""

from __future__ import annotations

import torch

# Transformer Engine tests/pytorch/utils.py dtype_tols (rtol, atol).
DTYPE_TOLS = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1.3e-6, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float16: (1e-3, 1e-5),
}
# Transformer Engine's tolerances for a distributed run against a single-process one under a
# recipe (tests/pytorch/distributed/run_numerics.py ``_get_tolerances``; current scaling is the
# loosest there because each rank may hold its own scale_inv): the ``dtype`` policy's bound for
# scenarios with a recipe, and what tells a precision loss from a wrong result.
RECIPE_TOLS = {
    "delayed": (0.125, 0.0625), "float8_current_scaling": (0.4, 0.25), "mxfp8": (0.125, 0.0625),
    "float8_block_scaling": (0.125, 0.0625), "nvfp4": (0.125, 0.12),
}


def tolerances(recipe: str, dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol): the recipe's when it has one, else the dtype's (fp32's for other dtypes)."""
    return RECIPE_TOLS.get(recipe) or DTYPE_TOLS.get(dtype, DTYPE_TOLS[torch.float32])


def recipe_of(traces: dict) -> str:
    """The recipe a comparison runs under: the candidate's, else the reference's."""
    for role in ("candidate", "reference"):
        recipe = traces[role].manifest.get("recipe", "none") if role in traces else "none"
        if recipe != "none":
            return recipe
    return "none"


def within_tolerance(ref: torch.Tensor, cand: torch.Tensor, rtol: float, atol: float) -> bool:
    r, c = ref.double(), cand.double()
    return bool(((c - r).abs() <= atol + rtol * r.abs()).all())
