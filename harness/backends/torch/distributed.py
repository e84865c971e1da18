"""The torch backend's distributed training loop: TP x GTP x DP on torch.distributed.

One step, as megatron-core and Megatron-LM run it (no pipelining):

1. data: rank ``r`` reads ``rank_sample_ids(step, r)`` (GTP peers are data ranks), one
   micro-batch at a time;
2. forward/backward per micro-batch: vocab-parallel cross entropy, loss = token sum / tokens /
   micro-batches (megatron-core's schedule); GTP weight grads reduce-scattered into
   ``main_grad`` during backward, other grads added to ``main_grad`` after it (DDP's hook);
3. finalize: ``main_grad *= 1/dp`` and SUM over the replicate-DP group (DDP), then an
   average over the GTP group for params not GTP-sharded (``finalize_model_grads``): rank
   (t, g, d) then holds its rows of the DP x G mean gradient;
4. grad norm and zero count over every shard (replicated params counted once), clipping,
   the optimizer on the shards (on fp32 masters for bf16 params, copied back rounded), the
   loss summed over the data group (GTP x DP) for the log.

bf16 runs as megatron-core's ``Float16Module`` does: bf16 params and compute, fp32 softmax
and cross entropy, fp32 ``main_grad`` (GTP weight grads reduce-scattered in bf16, as the
0.19.2 local path does, then added in).

Everything is recorded through :mod:`harness.backends.recording`, as the megatron backend
records it: same kinds, canonical names, layouts and scalars.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness.backends import data as data_mod
from harness.backends import faults
from harness.run.job import Job
from harness.backends.recording import Materialized, Recording, StepScalars, gathered, train
from harness.capture.api import Capture
from harness.common.dtypes import DTYPES
from harness.scenario.faults import TORCH_FAULTS
from harness.backends.gpt import canonical_state, captured_modules, layout_of, param_specs

from . import comm, fp8
from .model import GPT
from .optim import build_optimizer, clip, grad_stats, lr_at
from .parallel import Parallel, shard_model

# Planted faults this backend implements (the others patch megatron-core).
SUPPORTED_FAULTS = TORCH_FAULTS
# Recipes whose weight quantization has a per-tensor amax (the others are block-scaled only).
PER_TENSOR_AMAX = frozenset({"delayed", "float8_current_scaling", "nvfp4"})


def check_faults(side) -> None:
    """Refuse planted faults this backend cannot plant on ``side`` (rather than run clean)."""
    for name in side.inject:
        if name in faults.CATALOG and name not in SUPPORTED_FAULTS:
            raise ValueError(f"fault {name!r} is not implemented by the torch backend; "
                             f"it implements {sorted(SUPPORTED_FAULTS)}")
    if "fp8-unreduced-amax" in side.inject and (side.gtp == 1 or side.recipe not in PER_TENSOR_AMAX):
        raise ValueError(f"fp8-unreduced-amax needs GTP > 1 and a recipe with a per-tensor amax "
                         f"({', '.join(sorted(PER_TENSOR_AMAX))}); got gtp={side.gtp}, "
                         f"recipe={side.recipe}")


def run_distributed(job: Job, cap: Capture) -> None:
    side, m = job.side, job.model
    check_faults(side)
    rank = dist.get_rank() if dist.is_initialized() else 0
    coord = data_mod.coord(rank, side)
    dtype = DTYPES[side.precision]
    recipe = fp8.make_recipe(side.recipe) if side.recipe != "none" else None
    specs = {s.name: s for s in param_specs(m)}
    model = GPT(m, tp=side.tp)
    named = list(model.named_parameters())
    ctx = faults.Context(backend="torch", side=side, model=model, optimizer=None, rank=rank,
                         coord=coord, named_params=named)
    ctx.saved["data"] = job.data
    faults.install(side.inject, ctx)
    try:
        groups = comm.groups_for(side)
        # The fault hook answers None where a GTP shard's amax must go unreduced.
        reduce_amax = groups.gtp is None or faults.amax_reduction_group(ctx, groups.gtp) is not None
        par = shard_model(model, side, specs, canonical_state(m, side.seed), coord, dtype, recipe,
                          reduce_weight_amax=reduce_amax)
        _train(job, cap, model, par, ctx)
    finally:
        faults.uninstall()


def _train(job: Job, cap: Capture, model: GPT, par: Parallel, ctx: faults.Context) -> None:
    side, m = job.side, job.model
    specs = {s.name: s for s in param_specs(m)}
    layouts = {n: layout_of(s, side) for n, s in specs.items()}
    named = ctx.named_params
    cap.attach(captured_modules(model), vocab_parallel=["output_layer"])
    cap.info["gtp_params"] = {n: None for n, p in named if getattr(p, "is_gtp_weight_remat", False)}
    cap.info["data_parallel_rank"] = par.coord["data"]
    cap.info["data_parallel_size"] = side.data_ranks
    rec = Recording(cap, named, layouts)
    train(rec, side.steps, _DistributedStep(job, rec, model, par, ctx, specs))


class _DistributedStep:
    """One TP x GTP x DP step on torch.distributed (see the module docstring)."""

    def __init__(self, job: Job, rec: Recording, model: GPT, par: Parallel, ctx: faults.Context, specs):
        side, named = job.side, rec.named
        self.job, self.rec, self.model, self.par, self.ctx = job, rec, model, par, ctx
        self.masters = _masters(named) if side.precision == "bf16" else {}
        self.opt = build_optimizer(side, [(n, self.masters.get(n, p)) for n, p in named])
        if self.masters:  # megatron-core's Float16 optimizer names, which the fault hooks read
            self.opt.float16_groups = [[p for _, p in named]]
            self.opt.fp32_from_float16_groups = [[self.masters[n] for n, _ in named]]
        ctx.optimizer = self.opt
        # Where GTP is off the weight each GEMM reads is the parameter itself.
        direct = [(n, p) for n, p in named if specs[n].gtp] if side.gtp == 1 else []
        gathered_layouts = {n: gathered(lay) for n, lay in rec.layouts.items()}
        self.materialized = Materialized(rec.cap, gathered_layouts, direct)
        par.on_gather = self.materialized.record

    def begin(self, step: int) -> None:
        self.materialized.begin_step()
        faults.at_step(self.ctx, step)

    def forward_backward(self, step: int) -> None:
        side, named, ctx = self.job.side, self.rec.named, self.ctx
        ids = faults.route_samples(ctx, step, data_mod.rank_sample_ids(step, ctx.rank, side, self.job.data))
        for _, p in named:
            p.main_grad.zero_()
            p.grad = None
        self.totals = [_micro_batch(self.rec, self.model, self.par, mb, mb_ids, len(ids), self.job)
                       for mb, mb_ids in enumerate(ids)]
        _finalize(named, self.par.groups)
        faults.after_finalize(ctx)
        self.rec.grads(lambda p: p.main_grad)

    def prepare_update(self, step: int) -> None:
        side, named = self.job.side, self.rec.named
        self.grad_norm, self.num_zeros = grad_stats(named, self.rec.layouts, self.par.coord,
                                                    self.par.groups.model)
        clip([p.main_grad for _, p in named], side.clip_grad, self.grad_norm)
        self.lr = lr_at(side, step, self.job.data.global_batch_size)
        for group in self.opt.param_groups:
            group["lr"] = self.lr

    def update(self, step: int) -> None:
        named, masters = self.rec.named, self.masters
        faults.before_step(self.ctx)
        for name, p in named:
            masters.get(name, p).grad = p.main_grad
        self.opt.step()
        with torch.no_grad():
            for name, p in named:
                if name in masters:
                    p.copy_(masters[name])  # fp32 master -> bf16 param, round to nearest even
        faults.after_step(self.ctx)

    def optimizer_state(self):
        return {id(p): st for p, st in self.opt.state.items()}, self.masters

    def scalars(self, step: int) -> StepScalars:
        total = comm.all_reduce(torch.stack(self.totals).sum(0), self.par.groups.data)
        return StepScalars(
            reduced_loss=(total[0] / total[1]).item(), grad_norm=self.grad_norm, lr=self.lr,
            lr_logged=lr_at(self.job.side, step + 1, self.job.data.global_batch_size),
            num_zeros=self.num_zeros, skipped=0.0,
        )


def _micro_batch(rec: Recording, model: GPT, par: Parallel, mb: int, ids: list[int], n_mb: int, job: Job):
    """Forward and backward of one micro-batch; returns its (token-loss sum, tokens)."""
    m, d = job.model, job.data
    rec.cap.micro_batch(mb, ids)
    tokens, labels = data_mod.batch(d.seed, ids, m)
    logits = model(tokens)  # [s, b, V/TP]
    losses = comm.vocab_parallel_cross_entropy(logits, labels.t().contiguous(), par.groups.tp)
    losses = losses.transpose(0, 1).contiguous()  # [b, s]
    acc = torch.float64 if losses.dtype == torch.float64 else torch.float32
    mask = torch.ones_like(labels, dtype=acc)
    loss = torch.sum(losses.to(acc) * mask)
    num_tokens = mask.sum().to(torch.int)
    rec.loss((loss / num_tokens).item(), mb, ids)
    out = loss / torch.clamp(num_tokens, min=1) / n_mb
    out.backward()
    for p in model.parameters():
        if p.grad is not None:  # DDP's hook: accumulate into main_grad, free .grad
            p.main_grad.add_(p.grad)
            p.grad = None
    return torch.cat([loss.detach().view(1), num_tokens.to(acc).view(1)])


def _masters(named) -> dict[str, torch.Tensor]:
    """fp32 copies of bf16 params, which the optimizer steps (megatron-core's Float16 optimizer)."""
    return {n: torch.nn.Parameter(p.detach().float(), requires_grad=True) for n, p in named}


def _finalize(named, groups: comm.Groups) -> None:
    """DDP over the replicate-DP group, the TP sum of the query and key norms (each TP rank's
    heads give a part, as ``_allreduce_non_tensor_model_parallel_grads`` sums them), then the
    GTP average of replicated params."""
    dp = comm.size(groups.dp)
    if dp > 1:
        for _, p in named:
            p.main_grad.mul_(1.0 / dp)
            comm.all_reduce(p.main_grad, groups.dp)
    if comm.size(groups.tp) > 1:
        for name, p in named:
            if "q_layernorm" in name or "k_layernorm" in name:
                comm.all_reduce(p.main_grad, groups.tp)
    if comm.size(groups.gtp) > 1:
        for _, p in named:
            if not getattr(p, "is_gtp_weight_remat", False):
                comm.all_reduce_avg(p.main_grad, groups.gtp)
