"""The noise-floor policy's parts that are not per-tensor: k at step 1, losses pooled over the
step's samples, and the grad norm judged by the gradients that were compared."""

import math

import pytest
import torch

from harness.compare.assemble import Logical
from harness.compare.judge import _grad_norm_consistency, _pool_loss_noise, _scalar_row, judge, metrics
from harness.scenario.schema import ComparePolicy

FP8 = ComparePolicy(k=4.0, k_first_step=1.25, floor=0.25)


def _pair(ratio: float):
    """(ref, cand, golden) whose candidate is ``ratio`` times as far from the golden."""
    g = torch.linspace(-1, 1, 256, dtype=torch.float64)
    noise = torch.sin(torch.arange(256, dtype=torch.float64)) * 1e-2
    return (g + noise).float(), (g + ratio * noise).float(), g


@pytest.mark.parametrize("step, ratio, passes", [(1, 1.2, True), (1, 1.5, False), (2, 1.5, True),
                                                  (2, 4.5, False)])
def test_k_first_step_applies_to_step_1_only(step, ratio, passes):
    ref, cand, golden = _pair(ratio)
    ok, used, bound, *_ = judge(FP8, step, ref, cand, golden, metrics(ref, cand))
    assert (ok, used) == (passes, "noise-floor")
    ref_err = float((ref.double() - golden).pow(2).mean().sqrt())
    assert bound == pytest.approx(FP8.k_at(step) * ref_err, rel=1e-3)


def test_without_k_first_step_k_holds_throughout():
    assert ComparePolicy(k=3.0).k_at(1) == ComparePolicy(k=3.0).k_at(7) == 3.0


def _losses(step, ref, cand, gold):
    rows = []
    for sid, (r, c, g) in enumerate(zip(ref, cand, gold)):
        row = _scalar_row(step, f"loss[sample {sid}]", r, c, g, FP8)
        row.update(kind="loss", sample_ids=[sid])
        rows.append(row)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return rows + [_scalar_row(step, "reduced_loss", mean(ref), mean(cand), mean(gold), FP8)]


def test_reduced_loss_is_judged_against_the_worst_sample():
    # The reference's mean lands on the golden by cancellation (+0.01, -0.01): a single-scalar
    # noise floor would demand the candidate be exact; the samples say 0.01 is noise.
    rows = _pool_loss_noise(_losses(2, [5.01, 4.99], [5.015, 4.99], [5.0, 5.0]), FP8)
    reduced = rows[-1]
    assert reduced["policy"] == "noise-floor-pooled" and reduced["passed"], reduced
    assert reduced["bound"] == pytest.approx(4.0 * 0.01, rel=1e-3)
    # A report over the wrong samples is far beyond it.
    rows = _losses(2, [5.01, 4.99], [5.01, 4.99], [5.0, 5.0])[:-1]
    rows.append(_scalar_row(2, "reduced_loss", 5.0, 5.2, 5.0, FP8))
    assert not _pool_loss_noise(rows, FP8)[-1]["passed"]


def _grads(seed: float, names=("a", "b")):
    g = {n: torch.sin(torch.arange(64, dtype=torch.float32) * (i + 1) + seed) for i, n in enumerate(names)}
    logical = Logical()
    for n, t in g.items():
        logical.tensors[(0, "param", n)] = torch.zeros_like(t)
        logical.tensors[(1, "main_grad", n)] = t
    return logical, math.sqrt(sum(float(t.double().pow(2).sum()) for t in g.values()))


def test_grad_norm_explained_by_the_gradients_passes_however_the_golden_falls():
    ref, ref_norm = _grads(0.0)
    cand, cand_norm = _grads(1e-3)
    golden = ref_norm  # the reference's norm is exact by chance: the noise floor would be 0
    row = _scalar_row(1, "grad_norm", ref_norm, cand_norm, golden, FP8)
    assert not row["passed"]  # judged as a lone scalar
    (row,) = _grad_norm_consistency([row], ref, cand, FP8)
    assert row["policy"] == "consistency" and row["passed"], row
    assert abs(cand_norm - ref_norm) <= row["grad_diff_norm"]


def test_grad_norm_that_double_counts_a_tensor_fails():
    ref, ref_norm = _grads(0.0)
    cand, _ = _grads(0.0)  # the very same gradients ...
    b = float(cand.tensors[(1, "main_grad", "b")].double().pow(2).sum())
    counted_twice = math.sqrt(ref_norm**2 + b)  # ... and "b" summed twice into the norm
    row = _scalar_row(1, "grad_norm", ref_norm, counted_twice, ref_norm, FP8)
    (row,) = _grad_norm_consistency([row], ref, cand, FP8)
    assert row["policy"] == "consistency" and not row["passed"]
    assert row["grad_diff_norm"] == 0.0


def test_grad_norm_keeps_its_own_judgement_without_every_main_grad():
    ref, ref_norm = _grads(0.0)
    cand, cand_norm = _grads(1e-3)
    del cand.tensors[(1, "main_grad", "b")]  # captured for some tensors only
    row = _scalar_row(1, "grad_norm", ref_norm, cand_norm, ref_norm, FP8)
    before = dict(row)
    (after,) = _grad_norm_consistency([row], ref, cand, FP8)
    assert after == before


@pytest.mark.parametrize("recipe, passes", [("none", False), ("mxfp8", True), ("nvfp4", True)])
def test_dtype_policy_takes_the_recipe_tolerance(recipe, passes):
    # 5% apart: far outside fp32's dtype_tols, inside TE's distributed FP8 / FP4 tolerances.
    ref = torch.linspace(0.5, 1.0, 64)
    cand = ref * 1.05
    ok, used, bound, *_ = judge(ComparePolicy(policy="dtype"), 1, ref, cand, None, metrics(ref, cand), recipe)
    assert (ok, used) == (passes, "dtype")


@pytest.mark.parametrize("args, says",
                         [(["--k", "-1"], "--k: must be a finite number >= 0"),
                          (["--floor", "x"], "not a number"),
                                        (["--policy", "loose"], "invalid choice")])
def test_compare_cli_rejects_bad_policy_arguments(args, says, capsys):
    from harness import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(["compare", "ref", "cand", *args])
    assert exit_.value.code == 2 and says in capsys.readouterr().err
