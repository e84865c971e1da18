"""GTP's wgrad reduce-scatter in bf16: with bf16 params and fp32 main_grad, GTP rounds the
cross-rank sum of each GTP weight's gradient to bf16 once more than a GTP-off run.

World 2, TP1 x GTP2 vs GTP off (two data ranks either way, one micro-batch of one sequence
each, the same tokens per data rank), megatron-core's tiny GPT of the harness's seed scenario
(local spec, 2 layers, hidden 128, FFN 256, 4 heads, seq 64, vocab 128, untied embeddings), bf16
params under ``Float16Module``, DDP with ``grad_reduce_in_fp32``; one forward/backward +
``finalize_model_grads`` per side (the step-1 main_grad the optimizer would read). For every GTP
weight it prints: the dtype GTP's ``wgrad_reduce_scatter`` was handed; whether the logical
(gathered, unpadded) fp32 main_grad is bitwise the GTP-off run's; how many elements differ and
by how much (in bf16 ULPs of the GTP-off value); whether it equals the GTP-off main_grad rounded
to bf16 (with two data ranks of one micro-batch each, GTP off holds fp32(a) + fp32(b) of the two
ranks' bf16 wgrads and the bug gives bf16(a + b): the "exact extra rounding" pattern); and
whether the reduce-scatter's inputs, summed in fp32, are the GTP-off main_grad bitwise (then the
two runs computed the same per-rank wgrads, and only the reduction's dtype differs: not an
order difference). The linear weights and the word embedding are summarized on separate lines.

Exit status: 0 when every GTP weight's main_grad is bitwise the GTP-off one, 1 when one is not
(so ``git bisect run`` can use it), 2 on a bad command line.

    export PYTHONPATH=$PWD; .venv/bin/python repro/gtp_wgrad_rs_bf16.py [--json OUT] [--megatron TREE]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from repro import _common as c  # noqa: E402

EMBEDDING = "embedding.word_embeddings.weight"
SEED_MODEL = c.Model(num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
                     vocab_size=128, seq_length=64, micro_batch_size=1)
SIDES = {"gtp-off": 1, "gtp2": 2}  # label: GTP size; the first is the baseline


def _record_rs_inputs(names: dict, record: dict):
    """Wrap GTP's ``wgrad_reduce_scatter``: note the dtype and (cloned, fp32) value of every wgrad
    it is handed, before its 1/G pre-scale; returns the undo."""
    from megatron.core.tensor_parallel import generalized_tensor_parallelism as gtp

    cls = gtp.GTPShardedParam
    original = cls.wgrad_reduce_scatter

    def wrapper(param, wgrad, *args, **kwargs):
        # one tensor per non-routed weight (a list only for routed experts: none here)
        record[names.get(id(param), "?")] = {"dtype": str(wgrad.dtype).removeprefix("torch."),
                                             "value": wgrad.detach().float().clone()}
        return original(param, wgrad, *args, **kwargs)

    cls.wgrad_reduce_scatter = wrapper
    return lambda: setattr(cls, "wgrad_reduce_scatter", original)


def _side(gtp: int) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    run = c.Run(f"gtp{gtp}", gtp=gtp, bf16=True, model=SEED_MODEL)
    config, ddp = c.build(run)
    names = c.names_of(ddp)
    rs_inputs: dict = {}
    undo = _record_rs_inputs(names, rs_inputs) if gtp > 1 else (lambda: None)
    try:
        loss = c.step(config, ddp, run)
    finally:
        undo()
    grads = c.logical_grads(ddp)
    gtp_weights = [n for n, p in c._named(ddp) if getattr(p, "is_gtp_weight_remat", False)]
    # The reduce-scatter's inputs summed over the GTP peers in fp32, with GTP's 1/G mean.
    rs_sum = {}
    for n, p in c._named(ddp):
        if n in rs_inputs:
            total = rs_inputs[n]["value"] / gtp
            dist.all_reduce(total, group=p.group)
            rs_sum[n] = total
    ps.destroy_model_parallel()
    c.compat.reset_gtp_state()
    return {"loss": loss, "grads": grads, "gtp_weights": gtp_weights, "rs_sum": rs_sum,
            "rs_dtype": {n: r["dtype"] for n, r in rs_inputs.items()}}


def _bf16_ulps(diff: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest |diff| in units of the last place of bf16 (8 significant bits) at ref's magnitude."""
    _, exponent = torch.frexp(ref)  # ref = m * 2**e, 0.5 <= |m| < 1
    ulp = torch.ldexp(torch.ones_like(ref), exponent - 8)
    nz = diff != 0
    return float((diff[nz].abs() / ulp[nz]).max()) if nz.any() else 0.0


def _compare(gtp: torch.Tensor, off: torch.Tensor, rs_sum: torch.Tensor | None) -> dict:
    diff = gtp - off
    return {
        "bitwise": torch.equal(gtp, off), "differ": int((diff != 0).sum()), "numel": off.numel(),
        "max_abs_diff": float(diff.abs().max()), "max_bf16_ulps": _bf16_ulps(diff, off),
        "equals_off_rounded_to_bf16": torch.equal(gtp, off.bfloat16().float()),
        "rs_inputs_summed_equal_off": None if rs_sum is None else torch.equal(rs_sum, off),
    }


def _verdict(rows: list[dict]) -> str:
    if all(r["bitwise"] for r in rows):
        return "bitwise equal to gtp-off"
    if all(r["equals_off_rounded_to_bf16"] for r in rows):
        same_inputs = all(r["rs_inputs_summed_equal_off"] for r in rows)
        return ("= gtp-off main_grad rounded to bf16, exactly (one extra rounding"
                + ("; the reduce-scatter's inputs, summed in fp32, are gtp-off's bitwise: not an order "
                   "difference)"
                   if same_inputs else ")"))
    return "differs, and not by one bf16 rounding"


def _rank(rank: int, world: int, sides: list) -> dict:
    results = {s: _side(SIDES[s]) for s in sides}
    base, cand = results[sides[0]], results[sides[-1]]
    weights = {}
    for n in cand["gtp_weights"] or base["gtp_weights"]:
        weights[n] = {"rs_dtype": cand["rs_dtype"].get(n),
                      **_compare(cand["grads"][n], base["grads"][n], cand["rs_sum"].get(n))}
    others = [n for n in base["grads"] if n not in weights]
    groups = {"linear": [n for n in weights if n != EMBEDDING],
              "embedding": [n for n in weights if n == EMBEDDING]}
    return {
        "loss": {s: r["loss"] for s, r in results.items()}, "weights": weights,
        "groups": {g: {"weights": ns, "verdict": _verdict([weights[n] for n in ns]),
                       "bitwise": all(weights[n]["bitwise"] for n in ns),
                       "exact_extra_rounding": all(weights[n]["equals_off_rounded_to_bf16"]
                                                   and not weights[n]["bitwise"]
                                                   for n in ns)}
                   for g, ns in groups.items() if ns},
        "replicated_bitwise": all(torch.equal(cand["grads"][n], base["grads"][n]) for n in others),
    }


def _yes(flag) -> str:
    return "-" if flag is None else "yes" if flag else "no"


def main(argv=None) -> int:
    args = c.parse_args(__doc__, SIDES, argv)
    sides = args.chosen
    if len(sides) != 2:
        print("--sides: give two, baseline first (e.g. gtp-off,gtp2)", file=sys.stderr)
        return 2
    per_rank = c.spawn(_rank, 2, sides)
    r0 = per_rank[0]
    print(f"== {c.megatron_banner()}: TP1 x GTP2 vs GTP off, world 2, bf16 params, fp32 main_grad, "
          "step-1 main_grad ==")
    print("loss: " + "  ".join(f"{s} {v:.6f}" for s, v in r0["loss"].items()))
    print(f"{'GTP weight':>50}  {'RS dtype':>8}  bitwise  {'differ':>13}  {'max (bf16 ULP)':>14}  "
          f"= bf16(off)  RS inputs summed in fp32 = off")
    for n, w in r0["weights"].items():
        print(f"{n:>50}  {w['rs_dtype'] or '-':>8}  {_yes(w['bitwise']):>7}  {w['differ']:>6} of "
              f"{w['numel']:<6}"
              f"  {w['max_bf16_ulps']:>14.3f}  {_yes(w['equals_off_rounded_to_bf16']):>10}  "
              f"{_yes(w['rs_inputs_summed_equal_off'])}")
    for g, v in r0["groups"].items():
        # every rank holds the logical (gathered) main_grads: the verdict must agree on all
        agree = all(r["groups"][g]["verdict"] == v["verdict"] for r in per_rank)
        print(f"{g} ({len(v['weights'])} weight{'s' * (len(v['weights']) > 1)}): {v['verdict']}"
              + ("" if agree else "  (ranks disagree: see --json)"))
    print("replicated params: " + ("bitwise equal to gtp-off"
                                   if all(r["replicated_bitwise"] for r in per_rank)
                                   else "differ"))
    if args.json:
        args.json.write_text(json.dumps(per_rank, indent=1))
    return 0 if all(v["bitwise"] for r in per_rank for v in r["groups"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
