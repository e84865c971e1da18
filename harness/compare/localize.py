"""Localize: order the comparisons causally, name the first divergence and its likely cause.

Causal order within a step: data (sample ids), weights the forward reads, the forward in
layer order, logits, per-sample losses, backward (gradients in reverse layer order), the
reported loss and grad norm, then the optimizer update (state, then new weights). Across
steps, earlier first. The first failing event is the root cause: every event before it,
which is all it can have read, passed.

A signature names the pattern of the failure (see ``SIGNATURES``); the region names where
in the logical tensor it sits and which rank holds that part.
"""

from __future__ import annotations

import math
import re

import pandas as pd
import torch
from torch.distributed.tensor import Shard

from harness.common import mtp
from harness.compare import evaluation, signatures
from harness.compare.summary import FirstDivergence, Region, ScenarioSummary, Verdict
from harness.compare.tolerance import tolerances, within_tolerance
from harness.compare.updates import befores, update_term

# The signatures' meanings live beside their detectors; the report reads them from here too.
SIGNATURES = signatures.SIGNATURES

_PHASE_OF_KIND = {
    "input": (0, "data"),
    "param_before": (1, "weights"),
    "materialized": (1, "weights"),
    "activation": (2, "forward"),
    "logits": (3, "forward"),
    "loss": (4, "loss"),
    "mtp_loss": (4, "loss"),
    "main_grad": (5, "backward"),
    "scalar": (6, "reduce"),
    "exp_avg": (7, "optimizer"),
    "exp_avg_sq": (7, "optimizer"),
    "master": (8, "optimizer"),
    "param": (9, "optimizer"),
    "eval": (10, "eval"),  # an evaluation on the step's updated weights
}
_SCALAR_PHASE = {"reduced_loss": (4, "loss"), "grad_norm": (6, "reduce"), "lr": (7, "optimizer"),
                 "skipped": (7, "optimizer"), "loss_logged": (10, "log")}
_FORWARD_SUBS = ["input_layernorm", "self_attention", "pre_mlp_layernorm", "mlp", ""]
# An MTP depth's modules in forward order (its parameters by the module holding them); between
# the decoder's final LayerNorm and the main head's output layer, depth after depth.
_MTP_SUBS = ["embedding", "enorm", "hnorm", "eh_proj", *(f"mtp_model_layer.{s}" for s in _FORWARD_SUBS[:-1]),
             "mtp_model_layer", "final_layernorm", "", "output_layer", "loss"]


def _layer_position(name: str) -> float:
    """Forward position of a module or parameter name."""
    if name.startswith("embedding"):
        return 0.0
    if name.startswith("output_layer"):
        return 1e6 + 1
    if name.startswith("decoder.final_layernorm"):
        return 1e6
    if m := re.match(r"mtp\.layers\.(\d+)\.?(.*)", name):
        rest = m.group(2)
        sub = next((i for i, s in enumerate(_MTP_SUBS) if s and (rest == s or rest.startswith(s + "."))),
                   _MTP_SUBS.index(""))
        return 1e6 + (1 + int(m.group(1)) * 20 + sub) / 1000
    m = re.match(r"decoder\.layers\.(\d+)\.?([a-z_]*)", name)
    if not m:
        return 5e5
    layer, sub = int(m.group(1)), m.group(2)
    rest = name[m.end():]
    sub_pos = _FORWARD_SUBS.index(sub) if sub in _FORWARD_SUBS and not (sub == "" and rest) else 2
    return 1 + layer * 10 + sub_pos


def causal_key(row) -> tuple:
    kind, name = row["kind"], row["tensor"]
    phase_idx, _ = _SCALAR_PHASE.get(name, _PHASE_OF_KIND.get(kind, (5, "other"))) if kind == "scalar" \
        else _PHASE_OF_KIND.get(kind, (5, "other"))
    pos = evaluation.position(name) if kind == "eval" else _layer_position(name)
    if kind == "main_grad":
        pos = -pos  # backward runs in reverse layer order
    return (int(row["step"]), phase_idx, pos, name, kind)  # kind: Adam's two moments in one order


def phase_of(kind: str, name: str) -> str:
    if kind == "scalar" and name in _SCALAR_PHASE:
        return _SCALAR_PHASE[name][1]
    return _PHASE_OF_KIND.get(kind, (5, "other"))[1]


def order(df: pd.DataFrame) -> pd.DataFrame:
    if df.empty:
        return df
    df = df.copy()
    df["phase"] = [phase_of(k, n) for k, n in zip(df["kind"], df["tensor"])]
    # the three columns the key reads: a whole results row converts ten times slower
    keys = [causal_key(r) for r in df[["step", "kind", "tensor"]].to_dict("records")]
    df["_order"] = keys
    df = df.sort_values("_order", key=lambda s: s.map(lambda k: k)).drop(columns="_order")
    return df.reset_index(drop=True)


def region_of(row: dict, owner: dict | None) -> dict:
    """Rows/columns of the worst element and the rank(s) holding it."""
    idx = row.get("worst_index") or []
    region: dict = {"worst_index": idx}
    if not idx or owner is None:
        return region
    layout, ranks = owner["layout"], owner["ranks"]
    coord = {}
    for axis in ("tp", "gtp"):
        p = layout.placement(axis)
        n = layout.mesh.get(axis, 1)
        if isinstance(p, Shard) and n > 1:
            d = p.dim % len(layout.logical_shape)
            size = layout.logical_shape[d]
            if axis == "gtp":
                tp_p = layout.placement("tp")
                if isinstance(tp_p, Shard) and tp_p.dim % len(layout.logical_shape) == d:
                    size //= layout.mesh.get("tp", 1)
                local = (size + layout.pads.get("gtp", 0)) // n
                coord[axis] = (idx[d] % size) // local
                region["gtp_block_rows"] = [coord[axis] * local, min((coord[axis] + 1) * local, size)]
            else:
                local = size // n
                coord[axis] = idx[d] // local
                region["tp_block"] = [coord[axis] * local, (coord[axis] + 1) * local, f"dim {d}"]
    region["shard"] = coord
    region["ranks"] = sorted(r for (t, g, d), r in ranks.items()
                             if t == coord.get("tp", t) and g == coord.get("gtp", g))
    return region


def summarize(df: pd.DataFrame, logical: dict, traces: dict, policy, recipe: str = "none") -> ScenarioSummary:
    """Verdict, first divergence with signature and region, counts per kind.

    ``recipe`` is the one the comparison ran under (its tolerance tells a precision loss).
    """
    df = order(df)
    cand = logical["candidate"]
    mesh = traces["candidate"].manifest.get("mesh", {})
    checked = {k: int(n) for k, n in df.groupby("kind").size().items()} if not df.empty else {}
    failing = df[~df["passed"].astype(bool)] if not df.empty else df
    invariants = {"replica": cand.replica_violations, "padding": cand.padding_violations}
    expected = {k: int(n) for k, n in df.groupby("expectation").size().items()} \
        if "expectation" in df.columns else {}
    doc = ScenarioSummary.of(
        verdict=Verdict.PASS, first_divergence=None, checked=checked, expectations=expected,
        policy={"name": policy.policy, "k": policy.k, "k_first_step": policy.k_first_step,
                "floor": policy.floor},
        invariants=invariants, failing=int(len(failing)))
    # Candidate invariant violations are divergences of their own, placed in causal order.
    events = [] if failing.empty else failing.to_dict("records")
    for v in cand.padding_violations:
        events.append({**v, "passed": False, "policy": "padding", "_sig": "pad-rows", "ranks": [v["rank"]]})
    for v in cand.replica_violations:
        events.append({**v, "passed": False, "policy": "replica", "_sig": "replica-drift"})
    if not events:
        return doc
    events.sort(key=causal_key)
    first = events[0]
    step, kind, name = int(first["step"]), first["kind"], first["tensor"]
    sig, extra = first.get("_sig"), {}
    key = (step, kind, name)
    if nonfinite := signatures.nonfinite_of(first):  # before any pattern: no fit of a difference holds NaN
        sig, extra = "non-finite", {"non_finite": nonfinite}
    # A tensor that also breaks a trace invariant is explained by that invariant.
    for violations, label in ((cand.replica_violations, "replica-drift"),
                              (cand.padding_violations, "pad-rows")):
        hit = [v for v in violations if (v["step"], v["kind"], v["tensor"]) == key]
        if sig is None and hit:
            sig = label
            first = {**first, "ranks": hit[0].get("ranks") or [hit[0].get("rank")],
                     "rows": hit[0].get("rows")}
    if sig is None and kind == "eval":
        sig, extra = evaluation.signature(first, df, traces["candidate"])
    if sig is None:
        sig, extra = _signature(first, df, logical, mesh, key, recipe, _StepContext.of(traces, step, recipe))
    owner = cand.shard_owner.get(key)
    region = region_of(first, owner)
    if kind == "input":
        region = {"duplicated": first.get("duplicated"), "missing": first.get("missing")}
    if sig == "pad-rows" or (sig == "non-finite" and first.get("policy") == "padding"):
        region = {"rows": first.get("rows"), "rank": first.get("rank")}
    metrics = {k: first.get(k) for k in ("max_abs", "max_rel", "max_ulp", "p99_ulp", "rel_l2", "cosine",
                                         "ref_err_golden", "cand_err_golden", "bound", "ref_value",
                                         "cand_value") if first.get(k) is not None}
    metrics = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in metrics.items()}
    if metrics.get("bound") is not None and isinstance(first.get("bound_on"), str) and first["bound_on"]:
        extra = {**extra, "bound_on": first["bound_on"]}  # the statistic the bound limits
    ranks = first.get("ranks")
    if not isinstance(ranks, list):
        ranks = region.get("ranks")
    if kind in ("activation", "logits", "loss", "mtp_loss") and not ranks:
        ranks, sample = _sample_readers(first, cand, traces["candidate"], step)
        if sample is not None:
            region = {**region, "sample_id": sample}
    if sig.startswith("ratio") or sig in ("missing-gradient", "stale-update"):
        # A whole-tensor pattern: every rank holding the tensor shows it, not only the worst one.
        ranks = sorted(int(r) for r in traces["candidate"].coords())
    explanation = _explanation(sig, extra)
    if consumed := consumed_foreign(traces["candidate"], step):
        extra = {**extra, "consumed": consumed["events"]}
        # Another parameter's weight in a GEMM explains whatever diverged after it; a weight
        # that is no parameter's (stale, partial, permuted) explains only what nothing else does.
        if consumed["named"] or sig == "mismatch":
            sig, explanation, ranks = "gemm-consumed-foreign-weight", consumed["text"], consumed["ranks"]
    return doc.with_(verdict=Verdict.FAIL, first_divergence=FirstDivergence(
        step=step, phase=phase_of(kind, name), kind=kind, tensor=name, ranks=ranks,
            region=Region.of(**region),
        signature=sig, explanation=explanation, measured=metrics, extra=extra,
    ))


def _explanation(sig: str, extra: dict) -> str:
    """The signature's explanation, with what was measured where it names it."""
    if sig == "non-finite":
        nf = extra["non_finite"]
        if "in" in nf:
            return f"the candidate's {nf['in']} hold {nf['value']}: " + SIGNATURES[sig].split(": ", 1)[1]
        names = {"nan": "NaN", "inf": "Inf"}
        sides = (("cand", "candidate"), ("ref", "reference"))
        held = ", ".join(f"{nf[f'{w}_{s}']} {names[w]} in the {who}" for s, who in sides for w in names
                         if nf[f"{w}_{s}"])
        if not held:
            return SIGNATURES[sig]
        why = SIGNATURES[sig].split(": ", 1)[1]
        return f"non-finite values where the other side is finite ({held}): {why}"
    if sig == "extra-rounding":
        er = extra["extra_rounding"]
        how = ("the other side rounded to it" if er["pattern"] == "exact" else
               f"off by {er['median_ulps']:.2g} {er['dtype']} ULP (median): partial sums rounded to it")
        return (f"the {er['rounded']} was rounded once more to {er['dtype']} ({er['elements']} elements "
                f"differ, {how}): a reduction or accumulation in {er['dtype']} where the other keeps fp32")
    if sig == "partial-average":
        pa = extra["partial_average"]
        who = "; ".join(f"rank {r}: data ranks {d}" for r, d in pa["averaged"].items())
        return (f"the reported loss is the mean over some of the {pa['data_ranks']} data ranks' samples only "
                f"({who}): reduced over a group that leaves out ranks reading other samples (GTP peers "
                "are data ranks)")
    return SIGNATURES.get(sig, "")


def consumed_foreign(trace, step: int) -> dict | None:
    """The candidate's first GEMMs (at or before ``step``) that consumed another parameter's
    weight, as the megatron backend audits every GTP hand-out; None if none did."""
    events = [{**e, "rank": int(r)} for r, info in trace.infos.items()
              for e in info.get("consumed_foreign", []) if e.get("step") is not None and e["step"] <= step]
    if not events:
        return None
    first_step = min(e["step"] for e in events)
    first = [e for e in events if e["step"] == first_step]
    pairs = sorted({(e["phase"], e["param"], e["consumed"]) for e in first})
    text = "; ".join(
        f"the {phase} GEMM of {param} consumed "
        + ("a stale or partially gathered buffer" if other == "unknown" else f"{other}'s weight")
        for phase, param, other in pairs
    ) + f" (step {first_step}): a GTP gather buffer was reused before the GEMM read it"
    return {"text": text, "ranks": sorted({e["rank"] for e in first}), "events": first[:16],
            "named": any(other != "unknown" for _, _, other in pairs)}


def _sample_readers(first: dict, cand, trace, step: int) -> tuple[list[int] | None, int | None]:
    """The sample holding the worst element and every rank that read it (its TP peers too)."""
    ids = first.get("sample_ids")
    idx = first.get("worst_index") or []
    if not isinstance(ids, list) or not ids:
        return None, None
    sample = int(ids[idx[0]]) if idx and idx[0] < len(ids) else int(ids[0])
    readers = {r for r, read in cand.inputs.get(step, {}).items() if sample in read}
    coords = trace.coords()
    peers = {r for r, c in coords.items() for q in readers
             if (c["gtp"], c["dp"]) == (coords[q]["gtp"], coords[q]["dp"])}
    return sorted(peers or readers) or None, sample


_NARROW = {"fp64": 64, "fp32": 32, "bf16": 16, "fp16": 16}
_OPTIMIZER_KINDS = ("param", "master", "exp_avg", "exp_avg_sq")


class _StepContext:
    """What the signatures need from the traces beyond tensors: the candidate's LR and weight
    decay at the step, and whether the candidate has a precision mechanism at all."""

    def __init__(self, lr=None, wd=None, precision_mechanism=True, shared=()):
        self.lr, self.wd, self.precision_mechanism = lr, wd, precision_mechanism
        self.shared = shared  # patterns of the weights used more than once per step (MTP)

    @classmethod
    def of(cls, traces: dict, step: int, recipe: str) -> "_StepContext":
        cand, ref = traces["candidate"].manifest, traces["reference"].manifest
        lr = next((float(s["value"]) for s in traces["candidate"].scalars
                   if s.get("name") == "lr" and s.get("step") == step and s.get("rank") == 0), None)
        wd = (cand.get("train") or {}).get("weight_decay")
        bits_c, bits_r = (_NARROW.get(m.get("precision"), 32) for m in (cand, ref))
        # A recipe, a sub-fp32 precision (its reductions round in bf16) or a candidate less
        # precise than its reference can lose precision; fp32 against fp32 without a recipe
        # cannot, so a difference there is a logic error however small.
        mechanism = recipe != "none" or bits_c < 32 or bits_c < bits_r
        return cls(lr, wd, mechanism, mtp.shared_of_config(cand.get("config")))


def _update_signature(kind: str, name: str, step: int, ref, cand, ctx: "_StepContext") -> dict | None:
    rb, cb = befores(ref.tensors, step, kind, name), befores(cand.tensors, step, kind, name)
    ra, ca = ref.tensors.get((step, kind, name)), cand.tensors.get((step, kind, name))
    if any(t is None for t in (rb, cb, ra, ca)) or rb.shape != cb.shape:
        return None
    weight = cand.tensors.get((step, "param_before", name))
    return update_term(rb, ra, cb, ca, ctx.lr, ctx.wd, param=weight if kind != "param" else None)


def _signature(first: dict, df: pd.DataFrame, logical: dict, mesh: dict, key,
               recipe: str = "none", ctx: _StepContext | None = None) -> tuple[str, dict]:
    ctx = ctx or _StepContext()
    step, kind, name = key
    ref, cand = logical["reference"], logical["candidate"]
    if kind == "input":
        return "misrouted-samples", {}
    if kind == mtp.LOSS_KIND:  # its depth's logits agree: the labels or mask it read do not
        logits = df[(df["step"] == step) & (df["tensor"] == name.rsplit(".", 1)[0] + ".output_layer")]
        return ("labels-misaligned" if not logits.empty and logits["passed"].all() else "mismatch"), {}
    if kind == "scalar" or kind == "loss":
        tensors_ok = df[(df["step"] == step) & ~df["kind"].isin(["scalar", "loss"])]["passed"].all()
        if name == "reduced_loss":
            tp = mesh.get("tp", 1)
            delta = abs(float(first.get("cand_value", 0)) - float(first.get("ref_value", 0)))
            if tp > 1 and abs(delta - math.log(tp)) < 1e-2:
                return "log-TP-offset", {}
            if tensors_ok:
                return "loss-report-only", {}
        if name == "loss_logged" and (window := signatures.logged_window(step, df)) is not None:
            return "logged-over-steps", window
        if name == "grad_norm":
            grads = df[(df["step"] == step) & (df["kind"] == "main_grad")]
            if not grads.empty and grads["passed"].all():
                return "grad-norm-only", {"norm_ratio": float(first.get("cand_value", 0)) /
                                          max(float(first.get("ref_value", 1)), 1e-300)}
        return "mismatch", {}
    if kind == "param" and (step, "param_before", name) in cand.tensors:
        before, after = cand.tensors[(step, "param_before", name)], cand.tensors[key]
        ref_moved = not torch.equal(ref.tensors.get((step, "param_before", name), before), ref.tensors[key])
        if torch.equal(before, after) and ref_moved:
            return "stale-update", {}
    if kind in _OPTIMIZER_KINDS and (term := _update_signature(kind, name, step, ref, cand, ctx)):
        return "update-term", {"update": term}
    r = ref.tensors.get(key)
    c = cand.tensors.get(key)
    if r is None and key in ref.samples:
        ids = first.get("sample_ids")
        ids = list(ids) if isinstance(ids, (list, tuple)) else []  # NaN where the row names none
        r = torch.stack([ref.samples[key][i] for i in ids]) if ids else None
        c = torch.stack([cand.samples[key][i] for i in ids]) if ids else None
    if r is None or c is None:
        return "mismatch", {}
    if kind in _OPTIMIZER_KINDS and (other := signatures.other_tensor(c, key, ref.tensors)):
        return "permuted-tensors", {"holds": other}
    if r.dtype != c.dtype and r.is_floating_point() and c.is_floating_point():
        dtypes = {"reference": str(r.dtype).removeprefix("torch."),
                  "candidate": str(c.dtype).removeprefix("torch.")}
        wide = torch.promote_types(r.dtype, c.dtype)
        r, c = r.to(wide), c.to(wide)  # the patterns below, in the wider of the two
        if torch.equal(r, c):
            return "dtype-changed", {"dtypes": dtypes}
    ratio = signatures.ratio(r, c, mesh)
    if ratio:
        return ratio, {}
    if shifted := signatures.inserted_zero_rows(r, c):
        return "pad-rows-as-data", {"inserted_rows": shifted}
    tol = max(float(first.get("bound") or 0.0), 1e-6 * float(r.double().abs().max()))
    owner = cand.shard_owner.get((0, "param", name)) or cand.shard_owner.get(key)
    perm = signatures.permuted_blocks(r, c, mesh, tol, owner["layout"] if owner else None)
    if perm:
        return "permuted-blocks", {"permutation": perm}
    if rounded := signatures.extra_rounding(r, c):
        return "extra-rounding", {"extra_rounding": rounded}
    if first.get("policy") == "noise-floor" and ctx.precision_mechanism:
        rtol, atol = tolerances(recipe, c.dtype)
        if within_tolerance(r, c, rtol, atol):
            return "precision-loss", {"tolerance": {"rtol": rtol, "atol": atol, "recipe": recipe}}
    if kind == "main_grad" and mtp.is_shared(name, ctx.shared):
        grads = df[(df["step"] == step) & (df["kind"] == "main_grad")]
        once = grads[[not mtp.is_shared(t, ctx.shared) for t in grads["tensor"]]]
        if not once.empty and once["passed"].all():
            return "shared-weight-only", {}
    if first.get("policy") == "bounded" and kind != "main_grad":
        return "beyond-step-bound", {}  # an Adam weight's bound (harness.compare.adam_step)
    return _EXPECTATION_BROKEN.get(first.get("policy"), "mismatch"), {}


# A broken expectation without a recognised pattern still says which one broke.
_EXPECTATION_BROKEN = {"bitwise": "not-bitwise", "bounded": "beyond-sum-bound"}

