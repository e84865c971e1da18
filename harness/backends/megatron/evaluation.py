"""An evaluation on the megatron backend, as Megatron-LM's ``evaluate()`` runs one: the model
chunks in eval mode, megatron-core's schedule with ``forward_only=True`` under ``no_grad``
(GTP's forward chain with no backward after it), each iteration's ``(loss sum, tokens)`` pairs
summed over the micro-batches and all-reduced over the data group, the token mean over every
iteration reported. Megatron-LM main (since df197a816f) reduces over the GTP-inclusive
data-parallel group, as here; megatron-core 0.19.2's ``evaluate()`` over the replicate one.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from harness.backends import data as data_mod
from harness.backends import faults
from harness.backends.evaluation import EvalRecorder, rank_eval_sample_ids
from harness.backends.megatron import groups


def _loss_func(evals: EvalRecorder, where: dict, loss_mask, output_tensor):
    loss = torch.sum(output_tensor.float() * loss_mask)
    num_tokens = loss_mask.sum().to(torch.int)
    evals.sample((loss / num_tokens).item(), where["ids"], float(num_tokens), where["it"], where["mb"])
    return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.float().view(1)])}


def evaluate(fns, evals: EvalRecorder) -> None:
    """One evaluation of the side ``fns`` (a :class:`harness.backends.megatron.run._MegatronStep`)
    trains, on its current weights; recorded through ``evals``."""
    job, ctx = fns.job, fns.ctx
    side, m, d = job.side, job.model, job.data
    index = evals.begin()
    group = faults.eval_report_group(ctx, fns.data_group)
    where: dict = {}
    total = torch.zeros(2)

    def forward_step(data_iterator, model):
        tokens, labels, loss_mask = next(data_iterator)
        out = model(tokens, fns.positions.expand(tokens.shape[0], -1), fns.mask, labels=labels)
        return out, partial(_loss_func, evals, dict(where), loss_mask)

    def batches(it: int):
        for mb, ids in enumerate(rank_eval_sample_ids(index, it, ctx.rank, side, d)):
            where.update(it=it, mb=mb, ids=ids)
            yield (*data_mod.batch(d.seed, ids, m), data_mod.loss_mask(d, ids, m.seq_length))

    for chunk in fns.chunks:
        chunk.eval()
    with torch.no_grad():
        for it in range(side.eval_iters):
            losses = fns.forward_backward_func(
                forward_step_func=forward_step, data_iterator=batches(it), model=fns.chunks,
                num_microbatches=side.num_microbatches(d), seq_length=m.seq_length,
                micro_batch_size=d.micro_batch_size, forward_only=True,
                    **groups.kwargs(ctx.saved["pg_collection"]),
            )
            part = torch.vstack([x["lm loss"].view(-1) for x in losses]).sum(dim=0)
            dist.all_reduce(part, group=group)
            total += part
    for chunk in fns.chunks:
        chunk.train()
    evals.report(float(total[0] / total[1]))
