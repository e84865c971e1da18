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


# The statistic each policy's ``bound`` applies to (results.csv's ``bound_on``, the report's "bound on"):
# a bound is only readable beside the number it limits.
BOUND_ON = {
    "exact": "bits (every bit equal)", "bitwise": "bits (every bit equal)", "fingerprint": "bits (hashes)",
    "noise-floor": "rms error vs golden (cand_err_golden <= k ref_err_golden + floor)",
    "noise-floor-pooled": "abs error vs golden (|c - g| <= k x the step's worst sample + floor)",
    "dtype": "each element (|c - r| <= atol + rtol |r|; bound at max |r|)",
    "bounded": "each element (|c - r| <= 2 gamma_2n sum |x_i|; bound at its largest)",
    "consistency": "abs difference of the norms (| |g_c| - |g_r| | <= |g_c - g_r| + rounding)",
}


def with_bound_on(df):
    """Rows with the ``bound_on`` column: what each row's ``bound`` is a bound of (empty where no
    number bounds the judgement: a shape, a non-finite value, an invariant)."""
    if not df.empty and "policy" in df.columns:
        df = df.assign(bound_on=[BOUND_ON.get(p, "") if isinstance(p, str) else "" for p in df["policy"]])
    return df


def within_tolerance(ref: torch.Tensor, cand: torch.Tensor, rtol: float, atol: float) -> bool:
    r, c = ref.double(), cand.double()
    return bool(((c - r).abs() <= atol + rtol * r.abs()).all())
