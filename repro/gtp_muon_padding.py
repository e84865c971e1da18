"""Muon on padded GTP shards: megatron-core's own Muon update, GTP 2 vs GTP off, per tp_mode
(TP1, world 2, gloo, CPU, fp32, one step).

megatron-core's tiny GPT with FFN 80: ``linear_fc1``'s 80 rows are padded to 96 (16 x G = 32)
under GTP 2; every other Muon matrix (qkv 192 rows, proj and fc2 64 rows, the position
embedding) needs no padding. One forward/backward/finalize, then one step of megatron-core's
Muon (``get_megatron_optimizer``, ``optimizer = "muon"``, weight decay 0, no clipping, lr 1):
the logical update of each Muon matrix (before - after, pad rows stripped), GTP 2 against GTP
off. The 0.19.2 wheel's ``TensorParallelMuon.scaled_orthogonalize_fn_with_gtp_remat`` gathers
the padded shards and orthogonalizes the 96-row matrix: Muon's spectral scale is
sqrt(max(96, 64)) instead of sqrt(max(80, 64)), so fc1's update is sqrt(96/80) = 1.0954 times
GTP off's. Megatron-LM 4dd85559d2 strips the pad rows in the duplicated and blockwise modes.

    python repro/gtp_muon_padding.py [--modes duplicated,distributed,blockwise] [--megatron TREE] [--json OUT]
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402

MODES = ("duplicated", "distributed", "blockwise")
MODEL = replace(c.Model(), ffn_hidden_size=80)
SIDES = (c.Run("gtp-off", gtp=1, model=MODEL), c.Run("gtp2", gtp=2, model=MODEL))


def _muon_update(run: c.Run, mode: str) -> dict:
    """(padded rows per GTP shard, each Muon matrix's logical update) after one Muon step."""
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config, ddp = c.build(run)
    c.step(config, ddp, run)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="muon", lr=1.0, weight_decay=0.0, clip_grad=0.0,
                                                 muon_tp_mode=mode), [ddp])
    muon = {id(p) for part in opt.chained_optimizers if hasattr(part.optimizer, "scaled_orthogonalize_fn")
            for g in part.optimizer.param_groups for p in g["params"]}
    named = [(c.unwrapped_name(n), p) for n, p in ddp.named_parameters() if id(p) in muon]
    before = {n: c.logical(p, p.data) for n, p in named}
    opt.step()
    out = {n: (before[n] - c.logical(p, p.data)).tolist() for n, p in named}
    pads = {n: int(getattr(p, "pad_length", 0)) for n, p in named}
    ps.destroy_model_parallel()
    c.compat.reset_gtp_state()
    return {"pads": pads, "updates": out}


def _on_rank(rank, world, modes):
    return {mode: {run.label: _muon_update(run, mode) for run in SIDES} for mode in modes}


def _compare(off: dict, gtp: dict) -> dict:
    rows = {}
    for name, u_off in off["updates"].items():
        a, b = torch.tensor(u_off, dtype=torch.float64), torch.tensor(gtp["updates"][name],
                                                                      dtype=torch.float64)
        rows[name] = {"pad_rows": gtp["pads"][name], "norm_ratio": float(b.norm() / a.norm()),
                      "max_rel_diff": float((b - a).abs().max() / a.abs().max()),
                      "bitwise": bool(torch.equal(a, b))}
    return rows


def main(argv=None) -> int:
    args = c.parse_args(__doc__, MODES, argv, flag="--modes", what="Muon tp_modes to run")
    results = c.spawn(_on_rank, 2, tuple(args.chosen))[0]
    print(f"== {c.megatron_banner()}: Muon update, TP1 x GTP2 vs GTP off, FFN 80 (fc1 padded 80 -> 96 rows) "
          f"==")
    report = {}
    for mode, sides in results.items():
        report[mode] = _compare(sides["gtp-off"], sides["gtp2"])
        print(f"muon_tp_mode = {mode}:")
        for name, r in report[mode].items():
            verdict = ("bitwise equal" if r["bitwise"] else
                       f"norm ratio {r['norm_ratio']:.4f}, max rel diff {r['max_rel_diff']:.2e}")
            print(f"  {name:<52} pad rows {r['pad_rows']:>2}: {verdict}")
    print(f"spectral scale ratio of a 96- vs an 80-row matrix of 64 columns: {(96 / 80) ** 0.5:.4f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
