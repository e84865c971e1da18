"""Expectations: what the two sides' computations of a tensor have in common, so how far apart
they may be. Every compared row gets one, tightest first, with the reason it holds:

- ``bitwise``: the same operations on the same values in the same order. GTP changes where
  a weight lives, not what is computed from it: its all-gather rebuilds the weight exactly
  (a copy, padding stripped), so each GEMM reads the GTP-off run's weight at the GTP-off run's
  shape; a data rank reads the same samples (GTP peers are data ranks, rank for rank); a sum
  of two terms is commutative and the 1/G, 1/DP scalings are powers of two (exact).
- ``bounded``: the same terms summed in another order or grouping (GTP reduce-scatters each
  micro-batch's wgrad over its peers, DDP reduces the accumulated sum once): within
  :func:`harness.compare.bounds.sum_reorder_bound` of the recorded ``sum |x_i|``
  (:mod:`harness.backends.megatron.terms`), a few ULPs of the accumulation dtype; the grad
  norm by its consistency bound (:func:`harness.compare.judge._grad_norm_consistency`).
- ``noise-floor``: the computations differ in ways no bound here covers (another TP splits a
  GEMM's reduction inside the kernel, a recipe quantizes per rank, another backend, or an
  input that already differs): the scenario's policy decides, and the reason says why.

The rules read the sides' configurations (the traces' manifests) and the rows of upstream
tensors (a step's forward is bitwise only if the weights it read were), never the values
being judged. Without a configuration (older traces) every row keeps its policy.
"""

from __future__ import annotations

import math

import pandas as pd
import torch

from harness.common import mtp
from harness.common.muon import is_muon_matrix
from harness.compare import bounds
from harness.scenario.options import placement_only
from harness.scenario.side import Side

BITWISE, BOUNDED, NOISE = "bitwise", "bounded", "noise-floor"

# Options that change where a weight lives or when it moves, not an operation on a value.
PLACEMENT_ONLY = placement_only(Side)
# Why a differing option leaves the kernels different (the rest: "they differ in <option>").
_WHY = {
    "tp": "another TP size splits each GEMM's reduction dimension inside the kernel",
    "precision": "the sides compute in different precisions",
    "recipe": "a quantization recipe scales and rounds per rank and per block",
    "backend": "different backends run different kernels",
    "world_size": "different world sizes read different samples per rank",
    "pipeline_parallel": "pipeline stages reduce the embedding's grads over another group",
    "sequence_parallel": "sequence parallelism reduce-scatters activations over TP",
}
_FORWARD = ("materialized", "param_before", "activation", "logits", "loss", "mtp_loss")
_OPTIMIZER = ("param", "master", "exp_avg", "exp_avg_sq", "step")


def configs(traces: dict) -> tuple[dict, dict] | None:
    ref, cand = (traces[r].manifest.get("config") if r in traces else None
                 for r in ("reference", "candidate"))
    return (ref, cand) if ref and cand else None


def different_kernels(ref: dict, cand: dict) -> str | None:
    """Why the sides cannot compute the same values, or None where they run the same kernels."""
    if ref.get("recipe", "none") != "none" or cand.get("recipe", "none") != "none":
        return _WHY["recipe"]
    for key in sorted(set(ref) | set(cand)):
        if key not in PLACEMENT_ONLY and ref.get(key) != cand.get(key):
            return _WHY.get(key, f"the sides differ in {key}")
    return None


def _data_ranks(cfg: dict) -> int:
    """Ranks that read distinct samples (``Side.data_ranks``, from a manifest's configuration)."""
    return cfg["world_size"] // (cfg["tp"] * cfg.get("pipeline_parallel", 1))


def terms_count(traces: dict) -> int | None:
    """Terms of each main_grad's data-parallel sum: micro-batches x data ranks (equal sides)."""
    cfg = configs(traces)
    if cfg is None or different_kernels(*cfg):
        return None
    return int(cfg[0]["micro_batches"]) * _data_ranks(cfg[0])


def terms_check(logical: dict, key: tuple, r: torch.Tensor, c: torch.Tensor, terms: int | None) -> dict:
    """A main_grad against the bound of its sum's reordering, from the recorded magnitudes of
    its terms (kind ``grad_terms``, either side's): the worst excess over the bound (<= 0:
    within it) and how many elements exceed it."""
    tkey = (key[0], "grad_terms", key[2])
    side = next((s for s in (logical["reference"], logical["candidate"]) if tkey in s.tensors), None)
    if terms is None or side is None or r.shape != c.shape:
        return {}
    abs_terms = side.tensors[tkey]
    if abs_terms.shape != r.shape:
        return {}
    bound = bounds.sum_reorder_bound(terms, abs_terms.double(), c.dtype)
    excess = (c.double() - r.double()).abs() - bound
    excess = torch.where(torch.isnan(excess), torch.full_like(excess, math.inf), excess)
    return {"terms": terms, "terms_bound_max": float(bound.max()), "terms_excess": float(excess.max()),
            "terms_violations": int((excess > 0).sum())}


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class _Upstream:
    """What a step's rules need from other rows: which inputs were bitwise equal."""

    def __init__(self, df: pd.DataFrame):
        self.df = df
        equal = df["bitwise_equal"].fillna(False).astype(bool)
        self._bitwise = {(int(s), k): bool(v)
                         for (s, k), v in equal.groupby([df["step"], df["kind"]]).all().items()}
        keys = zip(df["step"], df["kind"], df["tensor"])
        self._rows = {(int(s), k, t): bool(v) for (s, k, t), v in zip(keys, equal)}

    def bitwise(self, step: int, kind: str, name: str) -> bool | None:
        """The row of ``name``'s ``kind`` at ``step`` bitwise equal (None: no such row)."""
        return self._rows.get((step, kind, name))

    def all_bitwise(self, step: int, kind: str) -> bool:
        """Every row of ``kind`` at ``step`` bitwise equal (False where there is none)."""
        return self._bitwise.get((step, kind), False)

    def scalar(self, step: int, name: str) -> dict | None:
        df = self.df
        rows = df[(df["step"] == step) & (df["kind"] == "scalar") & (df["tensor"] == name)]
        return None if rows.empty else rows.iloc[0].to_dict()


def expectation(row: dict, ref: dict, cand: dict, up: _Upstream, why_not: str | None) -> tuple[str, str]:
    """(expectation, reason) of one row; see the module docstring."""
    step, kind, name = int(row["step"]), row["kind"], row["tensor"]
    if row.get("policy") == "exact":
        return BITWISE, ("the initial weights: every side loads the same canonical state" if step == 0 else
                         "a load step or an exact policy: the state is a copy")
    if kind == "input":
        return BITWISE, "the same global sample ids"
    if kind == "scalar" and name == "grad_norm":  # the consistency bound holds for any two gradient sets
        if row.get("policy") == "consistency" or _flag(row.get("bitwise_equal")):
            return BOUNDED, ("a norm of the compared gradients: their difference plus the norms' rounding "
                             "bound")
        return NOISE, "not every main_grad was compared: no consistency bound"
    if kind == "scalar" and name == "loss_logged":  # what a frontend's log line shows of the loss
        reduced = up.scalar(step, "reduced_loss")
        if reduced is not None and _flag(reduced.get("bitwise_equal")):
            return BITWISE, "the log line of bitwise-equal reduced losses, in the same format"
        return NOISE, "the reduced losses it shows differ"
    if why_not:
        return NOISE, why_not
    if kind == "scalar" and name in ("lr", "skipped"):
        return BITWISE, "the same schedule over the same sample count"
    if kind == "eval":
        return _evaluation(row, ref, up)
    if kind in _OPTIMIZER or kind.split(":")[0] in _OPTIMIZER:
        return _optimizer(row, ref, cand, up)
    if not up.all_bitwise(step - 1, "param"):
        return NOISE, (f"the weights this step read (step {step - 1}) differ: no bound carries through "
                       "the steps")
    if kind in _FORWARD or (kind == "scalar" and name == "reduced_loss"):
        return BITWISE, ("the same GEMMs on bitwise-equal weights (GTP's all-gather is a copy) and the same "
                         "samples")
    if kind == "main_grad":
        return _per_use(name, ref, cand) or _main_grad(row, ref)
    return NOISE, f"no rule for {kind}"


def _per_use(name: str, ref: dict, cand: dict) -> tuple[str, str] | None:
    """A weight used more than once per forward (MTP's shared weights, a tied embedding) that GTP
    shards on a side: GTP reduce-scatters each use's wgrad on its own, where GTP off sums the uses
    in autograd first; the terms of that other grouping are not recorded."""
    shared = mtp.shared_of_config(ref)
    degree = "expert_gtp" if ".mlp.experts." in name else "gtp"
    if not mtp.gtp_shared(name, shared) or max(int(ref.get(degree, 1)), int(cand.get(degree, 1))) == 1:
        return None
    depths = int(ref.get("mtp_num_layers", 0))  # none: a tied output layer's two uses
    uses = (f"1 + {depths}" if depths else "2") if not name.startswith("mtp.") else str(depths)
    return NOISE, (f"used {uses} times per forward: GTP reduce-scatters each use's wgrad on its own, GTP off "
                   "sums the uses in autograd first; no side records the uses' magnitudes")


def _adam_step(row: dict, exp: tuple[str, str]) -> tuple[str, str]:
    """A weight after an Adam step that no tighter rule covers: bounded by what each side's own
    moments make of the step (:mod:`harness.compare.adam_step`), where both sides recorded them."""
    if exp[0] != NOISE or row["kind"] not in ("master", "param", "param_before") or not _number(
            row.get("adam_excess")):
        return exp
    return BOUNDED, ("Adam's step of each side's own recorded moments: |w_c - w_r| + lr |u_c - u_r| + "
                     "gamma_9 (|w| + lr |u|) per side, the update normalizing the gradient (" + exp[1] + ")")


def _main_grad(row: dict, ref: dict) -> tuple[str, str]:
    ranks = _data_ranks(ref)
    n = int(ref["micro_batches"]) * ranks
    acc = "fp32" if ref.get("grad_reduce_in_fp32", True) or ref["precision"] == "fp32" else ref["precision"]
    if n <= 2 and _power_of_two(ranks):
        return BITWISE, (f"the same wgrad GEMMs; a {acc} sum of {n} term{'s' * (n > 1)} (commutative), "
                         "scaled by powers of two")
    if not _number(row.get("terms_excess")):
        return NOISE, (f"a sum of {n} terms in another order, whose magnitudes no side recorded (GTP on both "
                       "sides, PP, MoE, sequence parallelism, an overlapped reduce, a per-token loss, mlm)")
    return BOUNDED, (f"the same {n} wgrad terms ({ref['micro_batches']} micro-batches x {ranks} data ranks) "
                     f"summed in {acc} in another order: 2 gamma_{2 * n} sum|x_i|")


def _evaluation(row: dict, ref: dict, up: _Upstream) -> tuple[str, str]:
    """An evaluation after step N reads the weights after N's update."""
    step = int(row["step"])
    if not up.all_bitwise(step, "param"):
        return NOISE, f"the weights the evaluation read (after step {step}) differ: no bound carries through"
    if row["tensor"].startswith("eval_loss[sample"):
        return BITWISE, "the same forward-only pass (eval mode) on bitwise-equal weights and the same samples"
    ranks = _data_ranks(ref)
    if ranks <= 2:
        return BITWISE, (f"the token mean of the same micro-batch losses: each data rank's sum in the same "
                         f"order, "
                         f"then a sum over {ranks} data rank{'s' * (ranks > 1)} (commutative) and one "
                         f"division")
    return NOISE, f"a sum over {ranks} data ranks' partial losses in the order the all-reduce takes"


_STATE = ("param", "master", "exp_avg", "exp_avg_sq")  # what a step of one tensor reads of its own state


def _inputs_differ(row: dict, ref: dict, up: _Upstream) -> str | None:
    """Why this tensor's optimizer step cannot be bitwise, reading only its own inputs (None: they
    are bitwise equal): an element-wise optimizer (Adam, SGD; Muon's momentum, and its update of one
    matrix) steps each tensor from its own main_grad and its own state after the previous step, so
    another tensor's rounding does not reach it (the clip factor aside, judged below)."""
    step, name = int(row["step"]), row["tensor"]
    if up.bitwise(step, "main_grad", name) is not True:
        return ("its main_grad at this step is not bitwise equal (or not compared); no bound carries "
                "through the step")
    if step == 1:
        return None  # the initial state: the canonical weights (checked bitwise), zero moments
    before = {k: up.bitwise(step - 1, k, name) for k in _STATE}
    if any(v is False for v in before.values()) or before["param"] is None:
        return f"its weight or optimizer state after step {step - 1} differs (or was not compared)"
    if ref.get("precision") != "fp32" and before["master"] is None:
        return f"its fp32 master after step {step - 1} was not compared: the bf16 weight does not show it"
    return None


def _optimizer(row: dict, ref: dict, cand: dict, up: _Upstream) -> tuple[str, str]:
    step = int(row["step"])
    if (why := _inputs_differ(row, ref, up)) is not None:
        return NOISE, why
    clip = max(float(ref.get("clip_grad", 0.0)), float(cand.get("clip_grad", 0.0)))
    if clip > 0:
        norm = up.scalar(step, "grad_norm")
        # megatron-core scales the grads by clip / (norm + 1e-6) only where that is below 1
        inactive = norm is not None and max(norm["ref_value"], norm["cand_value"]) + 1e-6 < clip * (1 - 1e-6)
        if not inactive and not up.all_bitwise(step, "main_grad"):
            # The clip factor reads every gradient: the norm computed from them, recorded rounded to
            # fp32, may round two norms alike that scale the update differently.
            return NOISE, ("the clip factor reads every main_grad of the step (their norm), and not every "
                           "one "
                           "is bitwise: the recorded fp32 norm does not show the factor applied")
        if norm is None or not (norm.get("bitwise_equal") or inactive):
            return NOISE, "the clip factor reads grad norms that differ (a sum over shards in another order)"
        # mlm and bridge record the norm their train_step returns, rounded to fp32: equal
        # roundings do not show the clip factor the optimizer computed from the unrounded norm.
        if not inactive and {ref.get("backend"), cand.get("backend")} & {"mlm", "bridge"}:
            return NOISE, ("the clip factor reads the unrounded grad norm; the frontend records it rounded "
                           "to fp32")
    if (muon := _muon_update(row, ref, cand)) is not None:
        return muon
    return BITWISE, (f"per tensor: the same element-wise {ref.get('optimizer', 'optimizer')} step on its own "
                     "bitwise-equal main_grad, weight and state, and the same clip factor")


def _muon_update(row: dict, ref: dict, cand: dict) -> tuple[str, str] | None:
    """A Muon matrix's new weight, where the sides differ in GTP only (None: not such a row).

    Muon's update is not element-wise: Newton-Schulz reads the whole momentum matrix (its
    Frobenius norm, its Gram matrices X X^T). Its momentum buffer (kind ``exp_avg``) is an
    element-wise EMA and keeps the element-wise rule. Under GTP, by megatron-core's
    ``muon_tp_mode``:
    - ``duplicated`` all-gathers the GTP shards of the momentum (a copy) and, the pad rows
      stripped (Megatron-LM 4dd85559d2), orthogonalizes the GTP-off run's matrix at its shape
      with the same kernels on every rank: bitwise. (The 0.19.2 wheel keeps the pad rows: a
      larger matrix, not bitwise, and a wrong scale: the divergence this exposes.)
    - ``distributed`` sums the Gram matrices of the row shards over the GTP group
      (Megatron-LM bb47df5416) where GTP off computes each in one GEMM: another summation order.
    - ``blockwise`` orthogonalizes each GTP shard alone (bb47df5416) where GTP off takes the
      TP shard whole: another matrix, by design (its update depends on the sharding).
    The last two: the noise floor (the 0.19.2 wheel gathers the GTP shards in every mode,
    but no rule here reads which tree ran)."""
    if row["kind"] not in ("param",
                           "master") or ref.get("optimizer") != "muon" or ref.get("gtp") == cand.get("gtp"):
        return None
    if not is_muon_matrix(row["tensor"], _ndim(row.get("shape"))):
        return None
    mode = ref.get("muon_tp_mode", "duplicated")
    if mode == "duplicated":
        return BITWISE, ("Muon's duplicated mode orthogonalizes the gathered momentum, the GTP-off matrix at "
                         "its "
                         "shape, with the same kernels")
    why = ("sums the Gram matrices over the GTP group in another order" if mode == "distributed" else
           "orthogonalizes each GTP shard alone, another matrix by design")
    return NOISE, f"Muon's {mode} mode under GTP {why}"


def _ndim(shape) -> int:
    """Dimensions of a row's logical shape (a tuple, or its text as results.csv keeps it)."""
    if isinstance(shape, (tuple, list)):
        return len(shape)
    return len([d for d in str(shape).strip("()[] ").split(",") if d.strip()])


def judge_rows(df: pd.DataFrame, traces: dict, policy) -> pd.DataFrame:
    """Every row with its ``expectation`` and ``expectation_reason``; where it is ``bitwise``
    or ``bounded`` the row is judged by it (``policy`` column: ``bitwise`` / ``bounded``;
    ``policy_passed`` and ``policy_bound`` keep the scenario policy's own judgement and bound, the
    ``bound`` column holding the expectation's: 0 for bitwise), elsewhere by the scenario's
    policy as before. ``policy.derived`` false: reasons only."""
    if df.empty or (cfg := configs(traces)) is None:
        return df
    ref, cand = cfg
    why_not = different_kernels(ref, cand)
    df = df.copy()
    up = _Upstream(df)  # upstream rows are read for their bitwise equality, which judging leaves as is
    out = [_adam_step(row, expectation(row, ref, cand, up, why_not)) for row in df.to_dict("records")]
    df["expectation"] = [e for e, _ in out]
    df["expectation_reason"] = [r for _, r in out]
    if not getattr(policy, "derived", True) or policy.policy == "exact":
        return df
    if "bound" not in df.columns:
        df["bound"] = float("nan")
    df["policy_passed"] = df["passed"]  # what the scenario's policy alone said
    df["policy_bound"] = df["bound"]  # and its bound (the row's ``bound`` is the expectation's)
    for i, (exp, _) in zip(df.index, out):
        row = df.loc[i]
        if row["kind"] == "input" or row.get("policy") in _DECIDED:
            continue
        if exp == BITWISE:
            df.at[i, "passed"] = _flag(row.get("bitwise_equal"))
            df.at[i, "policy"] = BITWISE
            df.at[i, "bound"] = 0.0
        elif exp == BOUNDED and row["kind"] != "scalar":  # the grad norm keeps its consistency judgement
            prefix = "terms" if row["kind"] == "main_grad" else "adam"
            df.at[i, "passed"] = (float(row[f"{prefix}_excess"]) <= 0
                                  and not _flag(row.get("nonfinite_mismatch")))
            df.at[i, "policy"] = BOUNDED
            df.at[i, "bound"] = row[f"{prefix}_bound_max"]
    return df


# Judgements an expectation leaves alone: already bitwise, or decided by what no rounding explains.
_DECIDED = ("exact", "nonfinite", "shape", "consistency", "fingerprint", "replica")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and value == value


def _flag(value) -> bool:
    """A row's boolean or count column, false where the row has none (NaN)."""
    return bool(value) and value == value
