"""The ``torch`` backend: the golden model, one process, fp64 or fp32.

It trains the same objective as a megatron-core run of any topology: the token mean of the
cross entropy over the whole global batch, AdamW (decoupled weight decay, as MCore's Adam)
or SGD with MCore's parameter groups (no weight decay on 1-D params and biases), global
grad-norm clipping with MCore's ``max_norm / (norm + 1e-6)`` coefficient, and Megatron-LM's
LR schedule counted in samples, written out here independently so it checks MCore's too.
"""

from __future__ import annotations

import math

import torch

from harness import data as data_mod
from harness.backends import Job
from harness.backends.torch.model import GPT, token_losses
from harness.capture import Capture
from harness.gpt import canonical_state, layout_of, param_specs
from harness.scenario import Side

DTYPES = {"fp64": torch.float64, "fp32": torch.float32}


def lr_at(side: Side, step: int, global_batch: int) -> float:
    """LR applied by the optimizer at ``step`` (1-based), as Megatron-LM schedules it.

    Megatron-LM steps the scheduler after the optimizer, in samples, so step ``s`` uses
    the LR of ``(s - 1) * global_batch`` samples (0 for the first warmup step).
    """
    n = (step - 1) * global_batch
    warmup = side.lr_warmup_steps * global_batch
    decay = (side.lr_decay_steps or side.steps) * global_batch
    if warmup > 0 and n <= warmup:
        return side.lr * n / warmup
    if side.lr_decay_style == "constant":
        return side.lr
    if n > decay:
        return side.min_lr
    ratio = (n - warmup) / (decay - warmup)
    coeff = 1.0 - ratio if side.lr_decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return side.min_lr + coeff * (side.lr - side.min_lr)


def build_optimizer(side: Side, model: torch.nn.Module) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.dim() == 1 or name.endswith(".bias") else decay).append(p)
    groups = [{"params": decay, "weight_decay": side.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]  # fmt: skip
    if side.optimizer == "adam":
        return torch.optim.AdamW(groups, lr=side.lr, betas=(side.adam_beta1, side.adam_beta2), eps=side.adam_eps)
    return torch.optim.SGD(groups, lr=side.lr, momentum=side.sgd_momentum)


def run(job: Job, cap: Capture) -> None:
    side, m, d = job.side, job.model, job.data
    if side.world_size != 1:
        raise NotImplementedError("the torch backend runs in a single process")
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
    modules = {"embedding": model.embedding, "output_layer": model.output_layer,
               "decoder.final_layernorm": model.decoder.final_layernorm}  # fmt: skip
    for i, layer in enumerate(model.decoder.layers):
        modules[f"decoder.layers.{i}"] = layer
        for sub in ("input_layernorm", "self_attention", "pre_mlp_layernorm", "mlp"):
            modules[f"decoder.layers.{i}.{sub}"] = getattr(layer, sub)
    cap.attach(modules, vocab_parallel=["output_layer"])
    opt = build_optimizer(side, model)

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
        if side.clip_grad > 0:
            coeff = side.clip_grad / (grad_norm + 1e-6)
            if coeff < 1.0:
                for g in grads:
                    g.mul_(coeff)
        lr = lr_at(side, step, d.global_batch_size)
        for group in opt.param_groups:
            group["lr"] = lr
        cap.params("param_before", named, layout_of_name)
        cap.progress("optimizer")
        opt.step()
        cap.params("param", named, layout_of_name)
        if cap.wants("optimizer"):
            for name, p in named:
                st = opt.state.get(p, {})
                for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
                    if st.get(key) is not None:
                        cap.tensor("exp_avg" if key == "momentum_buffer" else key, name, st[key],
                                   layout=layouts[name])  # fmt: skip
        cap.scalar("reduced_loss", loss.item())
        cap.scalar("grad_norm", grad_norm)
        cap.scalar("lr", lr)
        cap.scalar("lr_logged", lr_at(side, step + 1, d.global_batch_size))
        cap.scalar("num_zeros", float(sum(int((g == 0).sum()) for g in grads)))
        cap.scalar("skipped", 0.0)
        cap.end_step()
