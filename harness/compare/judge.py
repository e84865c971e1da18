"""Compare: judge every logical tensor of the candidate against the reference (and golden).

Two phases, as ``torch.testing`` does: pair up what to compare (same step, kind and name;
activations by global sample id), then measure every pair and judge it under the policy.
Pairs are streamed (:mod:`harness.compare.tasks`): one logical tensor of each trace is assembled,
measured and dropped at a time, in one process, ``jobs`` compare processes or torchrun's
ranks (:mod:`harness.compare.split`), with the same rows. Results are data: one row per
(step, kind, tensor) in a pandas DataFrame; text and HTML are views of it. The first
divergence and its signature come from :mod:`harness.compare.localize`, which re-reads the few
tensors its signatures need.

Metrics per pair (:mod:`harness.compare.metrics`, one streaming pass that also measures what the
judgement needs): bitwise equality, max abs and max rel difference (with the index of the
worst element), max and p99 ULP distance (in the candidate's dtype), the max error in ULPs
of the tensor's largest magnitude (``scaled_ulp``), relative L2, cosine, and NaN/Inf
positions compared as such.

Policies:
- ``exact``: bitwise equal.
- ``dtype``: ``|c - r| <= atol + rtol |r|`` with per-dtype tolerances from Transformer
  Engine's ``tests/pytorch/utils.py::dtype_tols`` (fp32 1.3e-6/1e-5, bf16 1.6e-2/1e-5, ...);
  under a recipe, TE's distributed-vs-single-process tolerances for it (:mod:`harness.compare.tolerance`).
- ``noise-floor``: the candidate's RMS error against the golden is at most ``k`` times the
  reference's, plus ``floor * eps(dtype) * max|golden|``: GTP on must be no further from the
  fp64 truth than GTP off is. k = 4 absorbs the variation of rounding error between two
  reduction orders; the floor keeps tensors the reference gets (nearly) exact from failing on
  the candidate's last-bit noise. ``k_first_step`` may tighten k at step 1, where both sides
  read the same weights and inputs whatever the precision. Without a golden it falls back to
  ``dtype``. Losses are judged against the step's worst per-sample reference error.
- ``consistency``: the grad norm, when not bitwise equal, must be explained by the compared
  gradients (reverse triangle inequality); see :func:`_grad_norm_consistency`.
Initial weights (step 0) are always judged ``exact``: every side starts from the same ones;
so are the steps of ``exact_steps`` (a checkpoint's load step: the loaded state is a copy).
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from typing import NamedTuple

import pandas as pd
import torch

from harness.compare import adam_step, bounds, evaluation, expectations, localize, split, tasks
from harness.capture.fingerprint import BLOCK_DIGESTS, DIGESTS
from harness.compare.assemble import LazyLogical, Logical
from harness.compare.metrics import PairStats, measure, metrics, ulp_distance  # noqa: F401 (re-exported)
from harness.scenario.schema import ComparePolicy
from harness.compare.steps import per_sample_losses, step_table
from harness.compare.tolerance import DTYPE_TOLS, recipe_of, tolerances, with_bound_on
from harness.capture.trace import Trace
from harness.compare.summary import ScenarioSummary

SCALAR_NAMES = ("reduced_loss", "loss_logged", "grad_norm", "lr", "skipped")


class Judgement(NamedTuple):
    passed: bool
    policy: str  # the policy that decided: the scenario's, or exact/nonfinite/shape
    bound: float
    # RMS errors against the golden, when the noise floor measured them
    ref_err_golden: float | None = None
    cand_err_golden: float | None = None


def judge(policy: ComparePolicy, step: int, ref, cand, golden, m: dict,
          recipe: str = "none", stats: PairStats | None = None) -> Judgement:
    """The judgement of one pair with metrics ``m``; ``recipe`` picks the ``dtype`` tolerance.

    ``stats``: what :func:`harness.compare.metrics.measure` measured with the golden and the
    tolerances in the same pass; without it, what the policy needs is measured here.
    """
    if m["nonfinite_mismatch"]:
        return Judgement(False, "nonfinite", math.nan)  # no number bounds a NaN
    if step == 0 or policy.policy == "exact" or step in policy.exact_steps:
        return Judgement(m["bitwise_equal"], "exact", 0.0)
    if m["bitwise_equal"]:
        return Judgement(True, policy.policy, 0.0)
    dtype = cand.dtype if cand.dtype in DTYPE_TOLS else torch.float32
    if policy.policy == "noise-floor" and golden is not None:
        # Root-mean-square errors: the max of a few hundred elements is too noisy a statistic
        # to compare two runs' rounding by (small tensors such as LayerNorm params flip it).
        if stats is None or not stats.has_golden:
            stats = measure(ref, cand, golden)[1]
        ref_err, cand_err = stats.rms("ref"), stats.rms("cand")
        eps = torch.finfo(dtype).eps
        bound = policy.k_at(step) * ref_err + policy.floor * eps * stats.abs_max_golden
        return Judgement(cand_err <= bound, "noise-floor", bound, ref_err, cand_err)
    rtol, atol = tolerances(recipe, dtype)
    if stats is None or stats.tols != (rtol, atol):
        stats = measure(ref, cand, tols=(rtol, atol))[1]
    return Judgement(bool(stats.dtype_excess <= 0), "dtype", atol + rtol * stats.abs_max_ref)


def _needs(policy: ComparePolicy, step: int, golden, recipe: str, dtype: torch.dtype):
    """(golden, tolerances) that one pass should measure for the judgement and the row."""
    if step == 0 or policy.policy == "exact" or step in policy.exact_steps or (
            policy.policy == "noise-floor" and golden is not None):
        return golden, None
    return golden, tolerances(recipe, dtype if dtype in DTYPE_TOLS else torch.float32)


def pair_row(task: tasks.Task, logical: dict, policy: ComparePolicy, recipe: str = "none",
             terms: int | None = None, adam: dict | None = None):
    """Assemble, measure and judge one pair task: (its row or None, the sum of squared
    differences of a main_grad or None). The tensors are dropped on return. ``terms``: the
    count of terms of a main_grad's data-parallel sum, where a side recorded their magnitudes
    (:func:`harness.compare.expectations.terms_count`); ``adam``: :func:`.adam_step.hyper`'s."""
    ref, cand, golden = logical["reference"], logical["candidate"], logical.get("golden")
    step, kind, name = key = task.key
    if key in ref.samples:
        rs, cs = ref.samples[key], cand.samples[key]
        gs = golden.samples[key] if golden is not None and key in golden.samples else {}
        ids = sorted(set(rs) & set(cs))
        if not ids:
            return None, None
        r, c = torch.stack([rs[i] for i in ids]), torch.stack([cs[i] for i in ids])
        g = torch.stack([gs[i] for i in ids]) if all(i in gs for i in ids) else None
        del rs, cs, gs
        bounded = {}
    else:
        ids, r, c = None, ref.tensors[key], cand.tensors[key]
        # before the golden's is built: a pair holds at most three logical tensors at once
        bounded = (expectations.terms_check(logical, key, r, c, terms) if kind == "main_grad" else
                   adam_step.step_check(logical, key, r, c, adam))
        g = golden.tensors[task.golden_key] if task.golden_key is not None else None
    if r.shape != c.shape:
        return {"step": step, "kind": kind, "tensor": name, "passed": False, "policy": "shape",
                "detail": f"shape {tuple(r.shape)} vs {tuple(c.shape)}"}, None
    if g is not None and step == 0:
        g = g.to(c.dtype)  # initial weights: the golden's, cast as every side casts them
    m, stats = measure(r, c, *_needs(policy, step, g, recipe, c.dtype))
    j = judge(policy, step, r, c, g, m, recipe, stats)
    # The grad-norm consistency reuses a main_grad's squared differences.
    sq_diff = stats.sq_diff if kind == "main_grad" and not m["nonfinite_mismatch"] else None
    if j.ref_err_golden is not None:
        m.update(ref_err_golden=j.ref_err_golden, cand_err_golden=j.cand_err_golden)
    elif g is not None:
        m.update(ref_err_golden=stats.rms("ref"), cand_err_golden=stats.rms("cand"))
    return {"step": step, "kind": kind, "tensor": name, "passed": j.passed, "policy": j.policy,
            "bound": j.bound, "dtype": str(c.dtype).replace("torch.", ""),
            "shape": list(r.shape), "sample_ids": ids, **m, **bounded}, sq_diff


def part_of(traces: dict[str, Trace], policy: ComparePolicy, part: int, parts: int) -> tasks.Part:
    """Measure this process's share (``part`` of ``parts``) of a compare's tasks."""
    logical = {role: LazyLogical(t) for role, t in traces.items()}
    share = tasks.partition(tasks.collect(logical), logical, parts)[part]
    return tasks.run(share, logical, _pair(traces, policy))


def _pair(traces: dict[str, Trace], policy: ComparePolicy):
    """The pair measurement of a compare of ``traces`` (the same in every process)."""
    return functools.partial(pair_row, policy=policy, recipe=recipe_of(traces),
                             terms=expectations.terms_count(traces), adam=adam_step.hyper(traces))


class Comparison(NamedTuple):
    """What a compare returns: the summary (verdict, first divergence, counts) and its rows."""

    summary: ScenarioSummary
    results: pd.DataFrame
    """One row per compared (step, kind, tensor), in causal order."""


def compare(traces: dict[str, Trace], policy: ComparePolicy | None = None, jobs: int = 1,
            ranks: bool = False) -> Comparison | None:
    """Compare the candidate with the reference (and golden); see the module docstring.

    Streams: each logical tensor is assembled, measured and dropped (:mod:`harness.compare.tasks`).
    ``jobs`` > 1 splits the tensors over that many compare processes; ``ranks``, under
    torchrun with a process group, over the ranks, rank 0 returning the summary and the
    others None. The comparison is the same however the work is split.
    """
    policy = policy or ComparePolicy()
    logical = {role: LazyLogical(t) for role, t in traces.items()}
    recipe = recipe_of(traces)
    if ranks and split.world() > 1:
        parts = split.over_ranks(lambda: part_of(traces, policy, split.rank(), split.world()))
        if parts is None:
            return None
    elif jobs > 1:
        parts = split.over_processes(traces, policy, jobs)
    else:
        parts = [tasks.run(list(enumerate(tasks.collect(logical))), logical, _pair(traces, policy))]
    rows, sq_diff = tasks.merge(parts, logical["candidate"])
    ref, cand = logical["reference"], logical["candidate"]
    rows += compare_fingerprints(ref, cand, traces)
    scalars = _pool_loss_noise(_compare_scalars(traces, policy, recipe), policy)
    row = functools.partial(_scalar_row, policy=policy, recipe=recipe)
    scalars += _pool_loss_noise(evaluation.rows(traces, row), policy, evaluation.is_sample,
                                evaluation.is_reported)
    worlds = (traces["reference"].world_size, traces["candidate"].world_size)
    rows += _grad_norm_consistency(scalars, ref, cand, policy, worlds, sq_diff)
    rows += input_rows(ref, cand)
    df = with_bound_on(expectations.judge_rows(pd.DataFrame(rows), traces, policy))
    return Comparison(localize.summarize(df, logical, traces, policy, recipe=recipe), localize.order(df))


def input_rows(ref: Logical, cand: Logical) -> list[dict]:
    """Per step: does the candidate read exactly the reference's samples, once each?"""
    rows = []
    for step in sorted(set(ref.inputs) & set(cand.inputs)):
        r = Counter(i for ids in ref.inputs[step].values() for i in ids)
        c = Counter(i for ids in cand.inputs[step].values() for i in ids)
        dup = sorted(i for i, n in c.items() if n > 1)
        missing = sorted(set(r) - set(c))
        ranks = sorted(rk for rk, ids in cand.inputs[step].items() if set(ids) & set(dup))
        passed = r == c
        rows.append({"step": step, "kind": "input", "tensor": "sample_ids", "passed": passed,
                     "policy": "exact", "bitwise_equal": passed, "duplicated": dup, "missing": missing,
                     "ranks": ranks, "numel": sum(c.values())})
    return rows


def compare_fingerprints(ref: Logical, cand: Logical, traces: dict[str, Trace]) -> list[dict]:
    """Fingerprint-mode traces: bitwise equality per rank and the blocks that differ.

    With equal meshes every rank's shard is compared by its hash, and a mismatch is located
    to the dim-0 blocks whose checksums differ. Across different meshes only norms compare:
    the logical L2 norm is rebuilt from the shards' norms (one replica per Replicate axis).
    """
    rows = []
    same_mesh = traces["reference"].manifest.get("mesh") == traces["candidate"].manifest.get("mesh")
    for key in sorted(set(ref.fingerprints) & set(cand.fingerprints)):
        rf, cf = ref.fingerprints[key], cand.fingerprints[key]
        row = {"step": key[0], "kind": key[1], "tensor": key[2], "policy": "fingerprint"}
        if same_mesh:
            differing = {r: [i for i, (a, b) in enumerate(zip(rf[r]["blocks"], cf[r]["blocks"]))
                             if _block_digest(a) != _block_digest(b)]
                         for r in sorted(set(rf) & set(cf)) if _whole_digest(rf[r]) != _whole_digest(cf[r])}
            row.update(passed=not differing, bitwise_equal=not differing, ranks=sorted(differing),
                       differing_blocks={str(r): b for r, b in differing.items()})
        else:
            rn, cn = _fingerprint_norm(rf, traces["reference"]), _fingerprint_norm(cf, traces["candidate"])
            rel = abs(cn - rn) / rn if rn else float(cn != 0)
            row.update(passed=rel <= 1e-5, bitwise_equal=False, rel_l2_norm_diff=rel)
        rows.append(row)
    return rows


def _whole_digest(fp: dict) -> tuple[str, str]:
    """A fingerprint's whole-tensor digest with its algorithm (a digest of another algorithm
    never equals it): the fingerprint records it under the algorithm's name."""
    alg = next((a for a in DIGESTS if a in fp), "sha256")
    return alg, fp.get(alg)


def _block_digest(block: dict) -> tuple[str, str | None]:
    """A block's checksum with its algorithm: xxh3_64 or CRC-32, a sha256 prefix in older traces."""
    alg = next((a for a in BLOCK_DIGESTS if a in block), "sha256")
    return alg, block.get(alg)


def _fingerprint_norm(fps: dict[int, dict], trace: Trace) -> float:
    coords = trace.coords()
    # Replicated shards repeat: count the ranks of dp coordinate 0 once per (tp, gtp) pair.
    seen, total = set(), 0.0
    for rank, fp in sorted(fps.items()):
        c = coords.get(rank, {"tp": 0, "gtp": 0, "dp": 0})
        slot = (c["tp"], c["gtp"])
        if c.get("dp", 0) == 0 and slot not in seen and fp.get("l2") is not None:
            seen.add(slot)
            total += fp["l2"] ** 2
    return math.sqrt(total)


def _compare_scalars(traces: dict[str, Trace], policy: ComparePolicy, recipe: str = "none") -> list[dict]:
    table = step_table(traces)
    rows = []
    if table.empty:
        return rows
    by = {role: t.set_index("step") for role, t in table.groupby("side")}
    ref, cand, gold = by.get("reference"), by.get("candidate"), by.get("golden")
    if ref is None or cand is None:
        return rows
    for step in sorted(set(ref.index) & set(cand.index)):
        for name in SCALAR_NAMES:
            if name not in ref.columns or name not in cand.columns:
                continue
            r, c = float(ref.at[step, name]), float(cand.at[step, name])
            if name == "loss_logged" and (math.isnan(r) or math.isnan(c)):
                continue  # a side whose loop logs no line (the harness's, the golden's)
            # A log line that shows the step's loss shows the golden's reduced loss.
            gname = "reduced_loss" if name == "loss_logged" else name
            g = (float(gold.at[step, gname]) if gold is not None and gname in gold.columns
                 and step in gold.index else None)
            rows.append(_scalar_row(step, name, r, c, g, policy, recipe))
    # Per-sample losses, aligned by global sample id whatever rank read the sample.
    losses = per_sample_losses(traces)
    if not losses.empty:
        piv = losses.drop_duplicates(["side", "step", "sample_id"]).pivot_table(
            index=["step", "sample_id"], columns="side", values="loss")
        # A sample one side did not read is left out; a NaN loss one side did record is compared.
        read = set(zip(losses["side"], losses["step"], losses["sample_id"]))
        if {"reference", "candidate"} <= set(piv.columns):
            for (step, sid), row in piv.iterrows():
                if ("reference", step, sid) not in read or ("candidate", step, sid) not in read:
                    continue
                g = row.get("golden") if "golden" in piv.columns else None
                r = _scalar_row(step, f"loss[sample {sid}]", row["reference"], row["candidate"],
                                None if g is None or math.isnan(g) else g, policy, recipe)
                r.update(kind="loss", sample_ids=[int(sid)])
                rows.append(r)
    return rows


def _pool_loss_noise(rows: list[dict], policy: ComparePolicy, is_sample=lambda r: r["kind"] == "loss",
                     is_reduced=lambda r: r["kind"] == "scalar" and r["tensor"] == "reduced_loss"):
    """Judge losses against the reference's worst per-sample error of that step.

    One sample's reference loss can land by chance much closer to the golden than its
    rounding noise warrants; the step's worst sample is the reference's noise floor. The
    reduced loss is their mean, so its error is bounded by the same worst sample. (An
    evaluation's losses are pooled among themselves: ``is_sample``, ``is_reduced``.)
    """
    if policy.policy != "noise-floor":
        return rows
    worst: dict[int, float] = {}
    for r in rows:
        if is_sample(r) and r.get("ref_err_golden") is not None:
            worst[r["step"]] = max(worst.get(r["step"], 0.0), r["ref_err_golden"])
    eps = torch.finfo(torch.float32).eps
    for r in rows:
        pooled = is_sample(r) or is_reduced(r)
        if (pooled and r["policy"] != "replica" and r["step"] in worst
                and r.get("cand_err_golden") is not None and not r["bitwise_equal"]):
            floor = policy.floor * eps * abs(r["golden_value"])
            r["bound"] = policy.k_at(r["step"]) * worst[r["step"]] + floor
            r["passed"] = r["nonfinite_mismatch"] == 0 and r["cand_err_golden"] <= r["bound"]
            r["policy"] = "noise-floor-pooled"
    return rows


def _grad_norm_consistency(rows: list[dict], ref: Logical, cand: Logical, policy: ComparePolicy,
                           world_sizes: tuple[int, int] = (1, 1), sq_diff: dict | None = None) -> list[dict]:
    """Judge the grad norm by whether the gradients explain it: ``| |g_c| - |g_r| | <= |g_c - g_r|``.

    The reverse triangle inequality holds for any two gradient sets, so a norm that breaks it
    (beyond the rounding of the two computed norms) was not computed over the gradients that
    were compared: double counting, a missing group. Unlike a single scalar's distance to the
    golden, it does not depend on how two runs' rounding happens to fall. Needs every
    parameter's main_grad on both sides; otherwise the row keeps its own judgement.

    Rounding: each computed norm is within ``gamma_m`` (fp32) of the exact norm of its stored
    gradients, ``m`` the roundings on one term's path (:func:`harness.compare.bounds.norm_roundings`:
    the largest tensor's element count, the tensor count and the ranks, from the traces), so
    ``| |g_c|^ - |g_r|^ | <= |g_c - g_r| + gamma_m / (1 - gamma_m) (|g_c|^ + |g_r|^)``, with
    ``gamma_m`` from :func:`harness.compare.bounds.gamma_at_scale`: finite at any model size (beyond
    ``2^24`` summed elements the deterministic bound is vacuous; the probabilistic one fails
    with probability below :data:`harness.compare.bounds.FAILURE_PROBABILITY`). The gradient
    difference is summed in fp64, in any order (``gamma`` of its element count, fp64); the
    per-pair sums the metrics pass measured (``sq_diff``) are reused when given.
    """
    if policy.policy == "exact":
        return rows
    names = {name for (step, kind, name) in ref.tensors if step == 0 and kind == "param"}
    for r in rows:
        skip = r["tensor"] != "grad_norm" or r["kind"] != "scalar"
        if skip or r["bitwise_equal"] or r["nonfinite_mismatch"]:
            continue
        keys = [(r["step"], "main_grad", n) for n in sorted(names)]
        if not names or not all(k in ref.tensors and k in cand.tensors for k in keys):
            continue
        sq_diff = sq_diff or {}
        diff = math.sqrt(sum(sq_diff[k] if k in sq_diff
                             else measure(ref.tensors[k], cand.tensors[k])[1].sq_diff for k in keys))
        largest = max(_padded_numel(side, k) for side in (ref, cand) for k in keys)
        rel = bounds.norm_rel_error(largest, len(keys), max(world_sizes))
        diff_rel = bounds.gamma(sum(math.prod(ref.shape(k)) for k in keys) + 2, torch.float64)
        r["grad_diff_norm"] = diff
        r["bound"] = diff * (1 + diff_rel) + rel / (1 - rel) * (abs(r["ref_value"]) + abs(r["cand_value"]))
        r["passed"] = abs(r["cand_value"] - r["ref_value"]) <= r["bound"]
        r["policy"] = "consistency"
    return rows


def _padded_numel(logical: Logical, key: tuple) -> int:
    """Elements of a logical tensor plus its GTP pad rows: no rank's shard holds more."""
    shape = logical.shape(key)  # from the layout: nothing is read
    layout = logical.shard_owner.get(key, {}).get("layout")
    pad = sum(layout.pads.values()) if layout is not None and shape else 0
    return math.prod(shape) + pad * (math.prod(shape[1:]) if shape else 0)


def _scalar_row(step, name, r, c, g, policy, recipe: str = "none") -> dict:
    # Scalars are fp32 on every side; judged with the fp32 tolerance or the noise floor.
    rt, ct = torch.tensor([r], dtype=torch.float32), torch.tensor([c], dtype=torch.float32)
    gt = torch.tensor([g], dtype=torch.float64) if g is not None else None
    m = metrics(rt, ct)
    j = judge(policy, step, rt, ct, gt, m, recipe)
    if j.ref_err_golden is not None:
        m.update(ref_err_golden=j.ref_err_golden, cand_err_golden=j.cand_err_golden)
    elif g is not None:
        m.update(ref_err_golden=abs(r - g), cand_err_golden=abs(c - g))
    return {"step": step, "kind": "scalar", "tensor": name, "passed": j.passed, "policy": j.policy,
            "bound": j.bound, "dtype": "float32", "shape": [], "ref_value": r, "cand_value": c,
            "golden_value": g, **m}
