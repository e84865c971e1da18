"""Megatron-LM's evaluate() under GTP: the eval loss it reports, GTP 2 vs GTP off (TP1, world 2,
gloo, CPU, one evaluation of one global batch).

Each side builds megatron-core's tiny GPT in DDP (_common.build) and calls Megatron-LM's own
``megatron.training.training.evaluate()`` on one global batch of 4 samples, 2 micro-batches of
1 per data rank (GTP peers are data ranks: at TP1 x GTP2 the two ranks read different samples,
as Megatron-LM's sampler hands them out). Per rank it prints the loss evaluate() returns, the
token mean over the rank's own samples and over the whole batch (from every rank's micro-batch
(loss sum, tokens), gathered, in fp64), and which of the two the reported loss is. On the 0.19.2
wheel evaluate() all-reduces over the replicate data-parallel group (``eval_pgc.dp_cp``, GTP
peers left out): at GTP 2 each rank reports its own samples' mean. Exit 1 while a rank's
reported loss is not the whole batch's mean.

    python repro/eval_loss_gtp_group.py [--sides gtp-off,gtp2] [--megatron TREE] [--json OUT]
"""

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402

SIDES = (c.Run("gtp-off", gtp=1), c.Run("gtp2", gtp=2))
MICRO_BATCHES = 2  # per data rank and evaluation iteration


def _megatron_lm_globals(data_ranks: int, gtp: int, m: c.Model) -> None:
    """The arguments and timers Megatron-LM's evaluate() reads (the values its parser would set
    for this run: one evaluation iteration of the global batch, no SFT, no CUDA graphs)."""
    from megatron.training import global_vars

    global_vars.destroy_global_vars()
    batch = m.micro_batch_size * data_ranks * MICRO_BATCHES
    args = argparse.Namespace(
        eval_global_batch_size=batch, eval_micro_batch_size=m.micro_batch_size, eval_iters=1,
        data_parallel_size=data_ranks // gtp, gtp_weight_remat_size=gtp, seq_length=m.seq_length,
        decoder_seq_length=None, cuda_graph_impl="none", cuda_graph_warmup_steps=0,
        moe_expert_rank_capacity_factor=None, overlap_param_gather=False,
            reuse_grad_buf_for_mxfp8_param_ag=False,
        empty_unused_memory_level=0, sft=False, consumed_valid_samples=0, exit_duration_in_mins=None,
        timing_log_level=0, timing_log_option="minmax",
    )
    global_vars.set_args(args)
    global_vars._set_timers(args)


def _batches(data_rank: int, data_ranks: int, m: c.Model):
    """This data rank's micro-batches of the global batch (sample s of micro-batch k is global
    sample ``k * data_ranks + data_rank``, Megatron-LM's pretraining sampler's order)."""
    import torch

    for k in range(MICRO_BATCHES):
        gen = torch.Generator().manual_seed(c.SEED + 1000 + k * data_ranks + data_rank)
        tokens = torch.randint(0, m.vocab_size, (m.micro_batch_size, m.seq_length + 1), generator=gen)
        yield tokens[:, :-1], tokens[:, 1:]


def _side(run: c.Run) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.training import training

    config, ddp = c.build(run)
    m = run.model
    data_rank, data_ranks = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    _megatron_lm_globals(data_ranks, run.gtp, m)
    mask = torch.triu(torch.ones(1, 1, m.seq_length, m.seq_length, dtype=torch.bool), 1)
    positions = torch.arange(m.seq_length)[None].expand(m.micro_batch_size, -1)
    totals: list = []
    loss_func = c.token_sum_loss(totals)

    def forward_step(data_iterator, model):
        inputs, labels = next(data_iterator)
        return model(inputs, positions, mask, labels=labels), loss_func

    loss, _, _ = training.evaluate(forward_step, _batches(data_rank, data_ranks, m), [ddp], None, config)
    mine = torch.stack(totals).double().sum(0)
    every = [torch.zeros(2, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    whole = torch.stack(every).sum(0)  # TP 1: each rank is its own data rank
    ps.destroy_model_parallel()
    c.compat.reset_gtp_state()
    return {"label": run.label, "reported": float(loss["lm loss"]), "own": float(mine[0] / mine[1]),
            "batch": float(whole[0] / whole[1]), "micro_batch_terms": len(totals) * dist.get_world_size()}


def _on_rank(rank, world, sides):
    return [_side(run) for run in sides]


def main(argv=None) -> int:
    by_label = {s.label: s for s in SIDES}
    args = c.parse_args(__doc__, by_label, argv)
    results = c.spawn(_on_rank, 2, tuple(by_label[x] for x in args.chosen))
    print(f"== Megatron-LM evaluate(), TP1, world 2; {c.megatron_banner()} ==")
    eps, wrong = 2.0**-23, 0
    for i, label in enumerate(args.chosen):
        for rank, sides in enumerate(results):
            s = sides[i]
            # fp32: each micro-batch's sum rounded once, summed over n terms, one division
            tol = (s["micro_batch_terms"] + 2) * eps * abs(s["batch"])
            is_batch = math.isclose(s["reported"], s["batch"], rel_tol=0, abs_tol=tol)
            is_own = math.isclose(s["reported"], s["own"], rel_tol=0, abs_tol=tol)
            which = ("the whole batch's mean" if is_batch else "its own samples' mean only" if is_own
                     else "neither")
            wrong += not is_batch
            print(f"{label:>8} rank {rank}: eval loss {s['reported']:.6f}  own samples {s['own']:.6f}  "
                  f"whole batch {s['batch']:.6f}  -> {which}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
