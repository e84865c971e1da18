"""Forward error bounds of floating-point sums, for judging two computations of one value.

Two correct runs that sum the same terms in another order (another reduction split, another
CPU's vector kernels) differ by rounding only; how much is bounded a priori by the standard
forward error analysis of summation and dot products (Higham, *Accuracy and Stability of
Numerical Algorithms*, 2nd ed., Lemma 3.1 and sections 3.1 and 4.2):

- ``u = eps / 2`` is the unit roundoff of the accumulation dtype;
- a product of ``n`` factors ``(1 + delta_i)^(+-1)``, ``|delta_i| <= u``, is ``1 + theta_n``
  with ``|theta_n| <= gamma_n = n u / (1 - n u)``, and ``gamma_a + gamma_b + gamma_a gamma_b
  <= gamma_(a+b)``;
- a sum of ``n`` terms in ANY order: ``|fl(sum x_i) - sum x_i| <= gamma_(n-1) sum |x_i|``;
  a dot product of length ``n``: ``gamma_n sum |x_i y_i|``.

These hold for every summation order and every machine that rounds to nearest in a dtype at
least as precise as the one named, which is what makes them bounds rather than observations.

They grow with ``n`` and are vacuous once ``n u >= 1`` (``n >= 2^24`` in fp32): a model's
largest weight passes that. For large ``n`` the comparison uses the probabilistic bound of
Higham and Mary (*A New Approach to Probabilistic Rounding Error Analysis*, SIAM J. Sci.
Comput. 41(5), 2019, Theorems 3.1 and 4.1): if the rounding errors ``delta_i`` are
independent random variables of mean zero, then for any ``lambda > 0`` a product of ``n``
factors ``(1 + delta_i)^(+-1)`` is ``1 + theta_n`` with ``|theta_n| <= gamma~_n(lambda) =
exp(lambda sqrt(n) u + n u^2 / (1 - u)) - 1`` (``~ lambda sqrt(n) u``) with probability at
least ``P(lambda) = 1 - 2 exp(-lambda^2 (1 - u)^2 / 2)``, and a sum or dot product of ``n``
terms is within ``gamma~_n(lambda) sum |x_i y_i|`` with probability at least ``1 - n (1 -
P(lambda))`` (a union bound over the terms). :func:`gamma_at_scale` picks ``lambda`` so that
this failure probability is at most :data:`FAILURE_PROBABILITY` and returns the smaller of
the two bounds. Blocked and pairwise summation, as torch's reductions sum, have still
smaller errors, so the bound is conservative for them too.
"""

from __future__ import annotations

import math

import torch


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """``gamma_n = n u / (1 - n u)`` of ``dtype`` (infinite once ``n u >= 1``: no bound left)."""
    nu = n * unit_roundoff(dtype)
    return nu / (1 - nu) if nu < 1 else math.inf


FAILURE_PROBABILITY = 1e-9
"""Largest accepted chance that correct rounding exceeds the probabilistic bound: a false
alarm once in a billion norms, under the model of independent mean-zero rounding errors."""


def probabilistic_gamma(n: int, dtype: torch.dtype = torch.float32,
                        failure: float = FAILURE_PROBABILITY) -> float:
    """Higham and Mary's ``gamma~_n(lambda)``, ``lambda`` such that a sum of ``n`` terms breaks
    it with probability at most ``failure``: ``n * 2 exp(-lambda^2 (1 - u)^2 / 2) = failure``."""
    if n <= 0:
        return 0.0
    u = unit_roundoff(dtype)
    lam = math.sqrt(2 * math.log(2 * n / failure)) / (1 - u)
    return math.expm1(lam * math.sqrt(n) * u + n * u * u / (1 - u))


def gamma_at_scale(n: int, dtype: torch.dtype = torch.float32) -> float:
    """The smaller of the deterministic ``gamma_n`` and the probabilistic ``gamma~_n`` (the
    latter holds with probability at least ``1 - FAILURE_PROBABILITY``); finite for any ``n``."""
    return min(gamma(n, dtype), probabilistic_gamma(n, dtype))


def reorder_bound(n_terms: int, abs_sum, dtype: torch.dtype = torch.float32):
    """Largest difference between two sums of the same ``n_terms`` terms in any two orders:
    each is within ``gamma_(n-1) sum |x_i|`` of the exact sum. ``abs_sum`` may be a tensor
    (element-wise bound)."""
    return 2 * gamma(max(n_terms - 1, 0), dtype) * abs_sum


def norm_roundings(largest_tensor: int, tensors: int, ranks: int) -> int:
    """Roundings on one term's path through a global L2 norm ``sqrt(sum_ranks sum_tensors |g|^2)``,
    as megatron-core computes it (the torch backend's fp64 path has fewer and smaller ones).

    Per rank, ``torch.norm`` of each local tensor squares (1) and sums its ``n`` squares
    (``n - 1``, any order) then takes a root; the norm of those norms squares each (the root and
    the square: 3 more on the squared value), sums ``tensors`` of them (``tensors - 1``) and takes
    a root that ``** 2`` undoes (3); the all-reduce sums ``ranks`` values (``ranks - 1``), and the
    final root adds one on the norm (|sqrt(1 + theta) - 1| <= |theta|). Total:
    ``n + tensors + ranks + 5``, so the computed norm is within ``gamma`` of that times the exact
    norm of the stored gradients.
    """
    return largest_tensor + tensors + ranks + 5


def norm_rel_error(largest_tensor: int, tensors: int, ranks: int,
                   dtype: torch.dtype = torch.float32) -> float:
    """Relative error bound of a computed global grad norm (see :func:`norm_roundings`): finite
    at any size, probabilistic where the deterministic bound is the looser
    (:func:`gamma_at_scale`)."""
    return gamma_at_scale(norm_roundings(largest_tensor, tensors, ranks), dtype)


def sum_reorder_bound(n_terms: int, abs_terms, dtype: torch.dtype = torch.float32):
    """Largest difference between two computations of one sum of ``n_terms`` terms in two
    orders and groupings, from ``abs_terms``, the measured ``sum |x_i|`` (element-wise), in
    the accumulation ``dtype``.

    Each side: at most ``n - 1`` additions and ``n`` scalings of a term or a partial sum (a
    pre-scale by 1/G, DDP's 1/DP; exact where they are powers of two, counted anyway), so each
    is within ``gamma_(2n) sum |x_i|`` of the exact sum (Higham, Lemma 3.1 with section 4.2);
    two sides, twice that. The measured ``abs_terms`` is itself a sum of ``n`` terms read as
    the rounded accumulation's increments (each within ``u`` of its partial sum, at most
    ``sum |x_i|``), which :func:`harness.backends.megatron.terms` sums in fp64: it is at least
    ``(1 - gamma_n) sum |x_i|``, and the bound divides by that factor.
    """
    g = gamma(2 * max(n_terms, 1), dtype)
    return 2 * g * abs_terms / (1 - gamma(max(n_terms, 1), dtype))
