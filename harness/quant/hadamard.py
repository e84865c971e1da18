"""The 16-point random Hadamard transform (RHT) NVFP4 applies to its wgrad operands."""

from __future__ import annotations

import math

import torch

__all__ = ["RHT_SIZE", "RHT_SIGNS", "apply_rht", "undo_rht", "rht_matrix"]

RHT_SIZE = 16

# Fixed sign vector of TE's get_wgrad_sign_vector
# (transformer_engine/pytorch/tensor/nvfp4_tensor.py, same in custom_recipes/reference_nvfp4.py).
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def _sylvester(size: int) -> torch.Tensor:
    h = torch.ones((1, 1), dtype=torch.float64)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return h


def rht_matrix(device: torch.device | str = "cpu", *, random_signs: bool = True) -> torch.Tensor:
    """The 16x16 orthonormal RHT matrix ``diag(signs) @ H16 / 4`` in float64.

    Rows of the Sylvester Hadamard matrix are flipped by TE's sign vector and the whole is
    scaled by 1/sqrt(16), as in TE's ``_build_hadamard_matrix`` / ``_apply_rht``
    (transformer_engine/pytorch/custom_recipes/reference_nvfp4.py).
    """
    h = _sylvester(RHT_SIZE)
    if random_signs:
        h = torch.tensor(RHT_SIGNS, dtype=torch.float64)[:, None] * h
    return (h / math.sqrt(RHT_SIZE)).to(device)


def apply_rht(x: torch.Tensor, *, random_signs: bool = True) -> torch.Tensor:
    """Transform each consecutive group of 16 elements along the last dim: ``x_g @ M``.

    TE computes this product in the input dtype; here it is computed in float64 and rounded
    once to the input dtype. Every product is an exact multiple of 1/4 of an input element,
    so the float64 sum is exact for all but extreme dynamic ranges and the result is the
    correctly rounded transform on every device (a float32 matmul's summation order, and
    so its last bit, is not fixed across devices).
    """
    if x.shape[-1] % RHT_SIZE:
        raise ValueError(
            f"the Hadamard transform needs the last dim to be a multiple of {RHT_SIZE}, "
            f"got shape {tuple(x.shape)}"
        )
    m = rht_matrix(x.device, random_signs=random_signs)
    groups = x.to(torch.float64).reshape(-1, RHT_SIZE)
    return (groups @ m).reshape(x.shape).to(x.dtype)


def undo_rht(y: torch.Tensor, *, random_signs: bool = True) -> torch.Tensor:
    """Inverse of :func:`apply_rht` (the matrix is orthonormal, so its inverse is its transpose)."""
    if y.shape[-1] % RHT_SIZE:
        raise ValueError(f"last dim must be a multiple of {RHT_SIZE}, got shape {tuple(y.shape)}")
    m = rht_matrix(y.device, random_signs=random_signs)
    groups = y.to(torch.float64).reshape(-1, RHT_SIZE)
    return (groups @ m.T).reshape(y.shape).to(y.dtype)
