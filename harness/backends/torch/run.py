"""The ``torch`` backend: the golden model in one process, or TP x GTP x DP with FP8 recipes.

One process, fp64 or fp32 and no recipe, it is the golden model: the token mean of the cross
entropy over the whole global batch in one forward, full tensors, the optimizer and schedule
of :mod:`.optim`. Any other side (several ranks, a quantization recipe, or bf16 params with
fp32 masters) runs the distributed path (:mod:`.distributed`): megatron-core's layouts,
reductions, data distribution, loss normalization and mixed precision, on torch.distributed.
"""

from __future__ import annotations

import torch

from harness import data as data_mod
from harness.backends import Job
from harness.capture import Capture
from harness.dtypes import DTYPES
from harness.gpt import captured_modules, canonical_state, layout_of, param_specs

from .distributed import run_distributed
from .model import GPT, token_losses
from .optim import build_optimizer, clip, lr_at

__all__ = ["lr_at", "run"]


def run(job: Job, cap: Capture) -> None:
    side = job.side
    if side.world_size == 1 and side.recipe == "none" and side.precision in ("fp64", "fp32"):
        _run_golden(job, cap)
    else:
        run_distributed(job, cap)


def _run_golden(job: Job, cap: Capture) -> None:
    side, m, d = job.side, job.model, job.data
    dtype = DTYPES[side.precision]
    model = GPT(m).to(dtype)
    state = canonical_state(m, side.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(state[name].to(dtype))
    specs = {s.name: s for s in param_specs(m)}
    layouts = {n: layout_of(s, side) for n, s in specs.items()}
    named = list(model.named_parameters())
    layout_of_name = lambda name, p: layouts[name]  # noqa: E731
    cap.attach(captured_modules(model), vocab_parallel=["output_layer"])
    opt = build_optimizer(side, named)

    cap.begin_step(0)
    cap.params("param", named, layout_of_name)
    cap.end_step()
    for step in range(1, side.steps + 1):
        cap.begin_step(step)
        for name, p in named:
            if specs[name].gtp:  # the weight each GEMM reads (materialized, in GTP terms)
                cap.tensor("materialized", name, p, layout=layouts[name])
        ids = data_mod.step_sample_ids(step, d)
        cap.micro_batch(0, ids)
        tokens, labels = data_mod.batch(d.seed, ids, m)
        opt.zero_grad(set_to_none=True)
        cap.progress("forward_backward")
        losses = token_losses(model(tokens), labels)  # [b, s]
        loss = losses.mean()
        loss.backward()
        for i, sid in enumerate(ids):
            cap.scalar("loss", losses[i].mean().item(), micro_batch=0, sample_ids=[sid])
        cap.params("main_grad", named, layout_of_name, value=lambda p: p.grad)
        grads = [p.grad for p in model.parameters()]
        grad_norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()
        clip(grads, side.clip_grad, grad_norm)
        lr = lr_at(side, step, d.global_batch_size)
        for group in opt.param_groups:
            group["lr"] = lr
        cap.params("param_before", named, layout_of_name)
        cap.progress("optimizer")
        opt.step()
        cap.params("param", named, layout_of_name)
        cap.optimizer_state(named, layout_of_name, {id(p): st for p, st in opt.state.items()})
        cap.scalar("reduced_loss", loss.item())
        cap.scalar("grad_norm", grad_norm)
        cap.scalar("lr", lr)
        cap.scalar("lr_logged", lr_at(side, step + 1, d.global_batch_size))
        cap.scalar("num_zeros", float(sum(int((g == 0).sum()) for g in grads)))
        cap.scalar("skipped", 0.0)
        cap.end_step()
