"""The a-priori rounding bounds the comparisons and tests rely on (harness/bounds.py)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.compare import bounds
from harness.compare.assemble import Logical
from harness.compare.judge import _grad_norm_consistency, _scalar_row
from harness.scenario.schema import ComparePolicy

ROOT = Path(__file__).resolve().parent.parent


def test_gamma_is_n_u_over_one_minus_n_u():
    u = 2.0**-24
    assert bounds.unit_roundoff(torch.float32) == u
    assert bounds.gamma(10) == 10 * u / (1 - 10 * u)
    assert bounds.gamma(2**24) == math.inf  # n u >= 1: no bound left
    assert bounds.gamma(10, torch.float64) < bounds.gamma(10, torch.bfloat16) / 1e10


def test_two_summation_orders_stay_within_the_reorder_bound():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 64, generator=gen) * torch.logspace(-3, 3, 64)  # cancelling, wide range
    forward = x.sum(dim=0)
    backward = torch.zeros(64)
    for row in x.flip(0):  # one term at a time, the other way round
        backward += row
    bound = bounds.reorder_bound(x.shape[0], x.double().abs().sum(dim=0))
    assert ((forward.double() - backward.double()).abs() <= bound).all()
    assert not torch.equal(forward, backward)  # the orders really round differently


NORM_SCRIPT = """
import json, sys, torch
from harness.backends.megatron import compat
compat.install()  # megatron-core's norm places its result on 'cuda'
from megatron.core.utils import local_multi_tensor_l2_norm
gen = torch.Generator().manual_seed(1)
grads = [torch.randn(n, generator=gen) * s for n, s in ((12288, 1e-2), (4608, 3.0), (64, 1e-5))]
(norm,), _ = local_multi_tensor_l2_norm(0, None, [grads], False)
exact = sum(float(g.double().pow(2).sum()) for g in grads) ** 0.5
print(json.dumps([float(norm), exact, [g.numel() for g in grads]]))
"""


def _megatron_norm(script: str, timeout: float) -> tuple[float, float, list[int]]:
    """(megatron-core's norm, the exact norm, the tensors' sizes), from ``script`` run in a
    subprocess: the compat layer patches torch for the whole process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_megatron_cores_l2_norm_is_within_the_norm_bound():
    # megatron-core's own CPU fallback of the multi-tensor L2 norm, against the exact norm
    # (in a subprocess: the compat layer patches torch for the whole process).
    norm, exact, numels = _megatron_norm(NORM_SCRIPT, timeout=120)
    rel = bounds.norm_rel_error(max(numels), len(numels), ranks=1)
    assert abs(norm - exact) <= rel * exact
    assert norm != exact  # an fp32 norm: rounded


def _same_grads(numel: int) -> tuple[Logical, float]:
    g = torch.sin(torch.arange(numel, dtype=torch.float32))
    logical = Logical()
    logical.tensors[(0, "param", "w")] = torch.zeros_like(g)
    logical.tensors[(1, "main_grad", "w")] = g
    return logical, math.sqrt(float(g.double().pow(2).sum()))


@pytest.mark.slow
def test_grad_norm_rounding_allowance_grows_with_the_summed_elements():
    # The same gradients, two norms 1e-5 apart: rounding for a norm over 2^10 elements
    # (gamma ~ 6e-5), not for one over 16 (gamma ~ 1.5e-6).
    policy = ComparePolicy()
    verdicts = {}
    for numel in (16, 2**10):
        logical, norm = _same_grads(numel)
        row = _scalar_row(1, "grad_norm", norm, norm * (1 + 1e-5), None, policy)
        (row,) = _grad_norm_consistency([row], logical, logical, policy, (1, 1))
        assert row["policy"] == "consistency" and row["grad_diff_norm"] == 0.0
        verdicts[numel] = row["passed"]
    assert verdicts == {16: False, 2**10: True}


def test_norm_bound_is_finite_and_tight_at_model_scale():
    # Beyond 2^24 summed fp32 elements the deterministic gamma is vacuous; the bound used for
    # the grad norm stays finite and grows like sqrt(n), not n.
    assert bounds.gamma(2**25) == math.inf
    at_scale = [bounds.norm_rel_error(n, 40, 8) for n in (2**10, 2**21, 2**25, 2**30)]
    assert all(math.isfinite(b) for b in at_scale) and at_scale == sorted(at_scale)
    assert at_scale[2] / at_scale[1] < 2**4 / 2  # sqrt(16) = 4 times, not 16 times
    u = bounds.unit_roundoff(torch.float32)
    n = 2**25
    lam = math.sqrt(2 * math.log(2 * n / bounds.FAILURE_PROBABILITY))
    # lambda sqrt(n) u to first order: exp(x) - 1 = x (1 + x/2 + ...), and the n u^2 term
    x = lam * math.sqrt(n) * u
    assert bounds.probabilistic_gamma(n) == pytest.approx(x, rel=x + n * u * u / x)


SCALE_SCRIPT = """
import json, math, torch
from harness.backends.megatron import compat
compat.install()
from megatron.core.utils import local_multi_tensor_l2_norm
h, layers, vocab = 512, 4, 4096  # scenarios/scale_nightly.toml (FFN 8h), and one tensor past 2^24 elements
layer = [(3 * h, h), (h, h), (8 * h, h), (h, 8 * h), (h,), (h,)]
shapes = [(vocab, h)] + layer * layers + [(vocab, h), (2**25,)]
gen = torch.Generator().manual_seed(3)
grads = [torch.randn(*s, generator=gen) * 1e-3 for s in shapes]
(norm,), _ = local_multi_tensor_l2_norm(0, None, [grads], False)
chunks = [c.double() for g in grads for c in g.reshape(-1).split(1 << 20)]
exact = math.sqrt(sum(float(torch.dot(c, c)) for c in chunks))
print(json.dumps([float(norm), exact, [g.numel() for g in grads]]))
"""


@pytest.mark.slow
def test_megatron_cores_l2_norm_is_within_the_bound_at_model_scale():
    # megatron-core's own norm over gradients of a hidden-512, 4-layer GPT plus one tensor of
    # 2^25 elements (53M in all): within the bound, which is not vacuous there.
    norm, exact, numels = _megatron_norm(SCALE_SCRIPT, timeout=300)
    rel = bounds.norm_rel_error(max(numels), len(numels), ranks=1)
    assert sum(numels) > 25_000_000 and rel < 1e-2
    assert abs(norm - exact) <= rel * exact


def test_grad_norm_consistency_at_model_scale_passes_rounding_and_catches_double_counting():
    # A 2^25-element gradient, bitwise equal on both sides: two norms of it that differ by a
    # rounding-sized 3e-5 (the size of the hidden-512 GPT's GTP-vs-off difference) pass; a norm
    # over a group counted twice (sqrt 2 times too large for this one tensor) fails.
    policy = ComparePolicy()
    g = torch.full((2**25,), 1e-3)
    logical = Logical()
    logical.tensors[(0, "param", "w")] = torch.zeros(1)
    logical.tensors[(1, "main_grad", "w")] = g
    norm = math.sqrt(g.numel()) * 1e-3
    verdicts = []
    for cand in (norm * (1 + 3e-5), norm * math.sqrt(2)):
        row = _scalar_row(1, "grad_norm", norm, cand, None, policy)
        (row,) = _grad_norm_consistency([row], logical, logical, policy, (2, 1), {(1, "main_grad", "w"): 0.0})
        assert row["policy"] == "consistency" and math.isfinite(row["bound"])
        verdicts.append(row["passed"])
    assert verdicts == [True, False]
