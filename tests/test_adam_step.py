"""Adam's step bound (harness.compare.adam_step): torch's AdamW stays within it whatever its
gradients (a sign flipped by rounding included), and a wrong step leaves it."""

import dataclasses

import pandas as pd
import pytest
import torch

from harness.compare import adam_step, expectations as ex
from harness.scenario.schema import Side

LR, WD = 3e-4, 0.01
H = {"adam_beta1": 0.9, "adam_beta2": 0.999, "adam_eps": 1e-8, "weight_decay": WD, "precision": "fp32",
     "lr": {1: LR, 2: LR}}


def _adam(w0: torch.Tensor, grads: list[torch.Tensor], lr: float = LR, wd: float = WD) -> list[dict]:
    """torch's AdamW (megatron-core's decoupled decay) on ``w0``, one step per grad: each step's
    weight and moments."""
    p = torch.nn.Parameter(w0.clone())
    opt = torch.optim.AdamW([p], lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
    out = []
    for g in grads:
        p.grad = g.clone()
        opt.step()
        st = opt.state[p]
        out.append({"param": p.detach().clone(), "exp_avg": st["exp_avg"].clone(),
                    "exp_avg_sq": st["exp_avg_sq"].clone()})
    return out


def _logical(w0, ref_steps, cand_steps):
    def side(steps):
        t = {}
        for s, st in enumerate(steps, start=1):
            t[(s, "param_before", "w")] = w0 if s == 1 else steps[s - 2]["param"]
            t.update({(s, k, "w"): v for k, v in st.items()})
        return type("L", (), {"tensors": t})()
    return {"reference": side(ref_steps), "candidate": side(cand_steps)}


def _check(logical, step=1, kind="param", h=H):
    key = (step, kind, "w")
    r, c = logical["reference"].tensors[key], logical["candidate"].tensors[key]
    return adam_step.step_check(logical, key, r, c, h)


@pytest.mark.parametrize("seed", range(20))
def test_adamw_stays_within_the_bound_even_where_rounding_flips_a_gradient_s_sign(seed):
    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(64, generator=gen)
    g = torch.randn(64, generator=gen) * 1e-3
    g[:4] = torch.tensor([1e-9, -1e-9, 3e-8, 0.0])  # at the rounding noise of zero
    noise = torch.randn(64, generator=gen) * 1e-7  # the other side's gradient: another summation
    flipped = g + noise
    flipped[:4] = -g[:4]
    ref, cand = _adam(w0, [g, g]), _adam(w0, [flipped, flipped])
    logical = _logical(w0, ref, cand)
    assert (cand[0]["param"] - ref[0]["param"]).abs().max() > LR  # ~2 lr apart: no noise floor holds
    for step, kind in ((1, "param"), (2, "param_before"), (2, "param")):
        got = _check(logical, step, kind)
        assert got["adam_excess"] <= 0 and got["adam_violations"] == 0, got
    # Step 2 read another weight than step 1 left (a stale or corrupted copy): outside.
    logical["candidate"].tensors[(2, "param_before", "w")] = cand[0]["param"] + 1e-5
    assert _check(logical, 2, "param_before")["adam_excess"] > 0


def test_a_wrong_learning_rate_or_a_skipped_decay_leaves_the_bound():
    w0 = torch.randn(64, generator=torch.Generator().manual_seed(0))
    g = torch.randn(64, generator=torch.Generator().manual_seed(1)) * 1e-3
    ref = _adam(w0, [g])
    for wrong in (_adam(w0, [g], lr=1.01 * LR), _adam(w0, [g], wd=0.0)):
        got = _check(_logical(w0, ref, wrong))
        assert got["adam_excess"] > 0 and got["adam_violations"] > 0, got
    # A moment recorded but not applied (a stale step): the weight is the step's start.
    stale = [{**ref[0], "param": w0.clone()}]
    assert _check(_logical(w0, ref, stale))["adam_excess"] > 0


def test_a_bf16_param_is_its_master_rounded():
    w0 = torch.randn(64, generator=torch.Generator().manual_seed(2)).bfloat16().float()
    g = torch.randn(64, generator=torch.Generator().manual_seed(3)) * 1e-3
    flipped = g.clone()
    flipped[:8] = -flipped[:8]
    ref, cand = _adam(w0, [g]), _adam(w0, [flipped])
    logical = _logical(w0, ref, cand)
    for name, side in (("reference", ref), ("candidate", cand)):
        t = logical[name].tensors
        t[(1, "master", "w")] = side[0]["param"]
        t[(1, "param", "w")] = side[0]["param"].bfloat16()
        t[(1, "param_before", "w")] = w0.bfloat16()
    h = {**H, "precision": "bf16"}
    assert _check(logical, kind="master", h=h)["adam_excess"] <= 0
    assert _check(logical, kind="param", h=h)["adam_excess"] <= 0
    # Two bf16 ulps off its master where one rounding allows half of one: outside.
    t = logical["candidate"].tensors
    t[(1, "param", "w")] = (t[(1, "master", "w")] * (1 + 2 ** -6)).bfloat16()
    assert _check(logical, kind="param", h=h)["adam_excess"] > 0


def test_the_rule_bounds_an_adam_weight_under_another_tp_and_keeps_a_tighter_rule():
    cfg = {**dataclasses.asdict(Side(backend="torch", world_size=2, precision="bf16")), "micro_batches": 1}
    rows = [{"step": 1, "kind": "master", "tensor": t, "passed": True, "policy": "noise-floor",
             "bitwise_equal": False, "nonfinite_mismatch": 0, **kw}
            for t, kw in (("a", {"adam_excess": -1e-9, "adam_bound_max": 6e-4}),
                          ("b", {"adam_excess": 1e-6, "adam_bound_max": 6e-4}), ("c", {}))]
    rows.append({"step": 1, "kind": "scalar", "tensor": "grad_norm", "passed": True, "policy": "noise-floor",
                 "bitwise_equal": True, "nonfinite_mismatch": 0})
    traces = {r: type("T", (), {"manifest": {"config": {**cfg, "tp": tp}}})()
              for r, tp in (("reference", 1), ("candidate", 2))}
    df = ex.judge_rows(pd.DataFrame(rows), traces, policy=type("P", (), {"policy": "noise-floor"})())
    out = {r["tensor"]: r for r in df.to_dict("records")}
    assert out["a"]["expectation"] == "bounded" and out["a"]["passed"] and out["a"]["bound"] == 6e-4
    assert "TP" in out["a"]["expectation_reason"]
    assert out["b"]["expectation"] == "bounded" and not out["b"]["passed"]
    assert out["c"]["expectation"] == "noise-floor"  # no moments recorded: the policy judges it
    norm = out["grad_norm"]  # bounded too (bitwise equal norms), by the consistency rule: left as judged
    assert norm["expectation"] == "bounded" and norm["passed"]


def test_hyperparameters_apply_only_to_adam_without_skips_or_resumes():
    cfg = {**dataclasses.asdict(Side(backend="torch", world_size=2, precision="bf16"))}

    def traces(**kw):
        scal = [{"name": "lr", "step": 1, "value": LR, "rank": 0}]
        return {r: type("T", (), {"manifest": {"config": {**cfg, **kw}}, "scalars": scal})()
                for r in ("reference", "candidate")}
    h = adam_step.hyper(traces())
    assert h["lr"] == {1: LR} and h["adam_eps"] == cfg["adam_eps"]
    assert adam_step.hyper(traces(optimizer="sgd")) is None
    assert adam_step.hyper(traces(precision="fp16")) is None
    assert adam_step.hyper(traces(load_step=2)) is None
