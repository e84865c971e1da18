"""The ``megatron`` backend: megatron-core's GPTModel, GTP, DDP, finalize_model_grads, optimizer.

One call of :func:`run` trains one side on this rank, as Megatron-LM's ``pretrain_gpt.py``
does: MCore's no-pipelining schedule over the rank's micro-batches, ``finalize_model_grads``
as the schedule's finalize hook, MCore's optimizer and ``OptimizerParamScheduler`` (stepped
in samples, as Megatron-LM does). What a step records, and when, is
:mod:`harness.backends.recording`'s; this module supplies how each step computes.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from harness import data as data_mod
from harness import faults
from harness.backends import Job
from harness.backends.megatron import checkpoint, compat
from harness.backends.megatron.gathers import record_gathers
from harness.backends.recording import Materialized, Recording, StepScalars, gathered
from harness.capture import Capture
from harness.dtypes import DTYPES
from harness.gpt import canonical_state, captured_modules, layout_of, mesh_of, param_specs
from harness.layout import from_mcore_param, shard


def canonical_name(name: str) -> str:
    """Strip the DDP / Float16Module wrappers' ``module.`` prefixes."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def _build(job: Job):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import gtp_api
    from megatron.core.tensor_parallel import generalized_tensor_parallelism as gtp_impl
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    side, m = job.side, job.model
    if side.recipe != "none":
        raise NotImplementedError(f"recipe {side.recipe!r} needs the Transformer Engine path of this backend")
    ps.initialize_model_parallel(tensor_model_parallel_size=side.tp, gtp_remat_size=side.gtp)
    model_parallel_cuda_manual_seed(side.seed)
    torch.manual_seed(side.seed)
    if side.gtp > 1:
        # Megatron-LM passes --calculate-per-token-loss here too; a user of the API may not
        # (per_token_loss = "transformer-config"): GTP then keeps its 1/G wgrad pre-scale.
        gtp_api.configure_gtp_remat_from_recipe(calculate_per_token_loss=side.per_token_loss == "both")
        gtp_impl.update_gtp_config(pad_for_alignment=side.gtp_pad_alignment,
                                   weight_prefetch=side.gtp_weight_prefetch)  # fmt: skip
    compat.set_eager_collectives(side.gtp_collectives == "eager")
    if side.sequence_parallel:
        compat.layer_norm_for_sequence_parallel()
    bf16 = side.precision == "bf16"
    config = TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        tensor_model_parallel_size=side.tp,
        tensor_parallel_num_weight_shards=side.tp * side.gtp,
        use_cpu_initialization=True,
        perform_initialization=False,  # canonical weights are loaded below
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        bf16=bf16,
        params_dtype=DTYPES[side.precision],
        pipeline_dtype=DTYPES[side.precision],
        init_method_std=m.init_std,
        deterministic_mode=True,
        calculate_per_token_loss=side.per_token_loss != "none",
        sequence_parallel=side.sequence_parallel,
        **_RECOMPUTE[side.recompute],
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=m.vocab_size,
        max_sequence_length=m.seq_length,
        share_embeddings_and_output_weights=not m.untie_embeddings,
        position_embedding_type="learned_absolute",
    )
    mesh = mesh_of(side)
    coord = data_mod.coord(dist.get_rank(), side)
    _load_canonical(model, job, mesh, coord)
    if bf16:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=side.overlap_grad_reduce,
                                               bucket_size=side.bucket_size,
                                               use_distributed_optimizer=side.distributed_optimizer)  # fmt: skip
    ddp = DistributedDataParallel(config, ddp_config, model)
    if side.overlap_grad_reduce:  # as Megatron-LM's train() wires an overlapping DDP
        config.no_sync_func = ddp.no_sync
        config.grad_sync_func = ddp.start_grad_sync
    if side.gtp > 1:
        gtp_api.classify_gtp_remat_chains(ddp)
    return config, ddp, mesh, coord


# TransformerConfig's recompute settings per scenario choice (full: one layer per checkpoint).
_RECOMPUTE = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}


def _load_canonical(model, job: Job, mesh: dict, coord: dict) -> None:
    """Cut the canonical weights into this rank's shards, after checking MCore's layout is ours."""
    specs = {s.name: s for s in param_specs(job.model)}
    state = canonical_state(job.model, job.side.seed)
    seen = set()
    for name, p in model.named_parameters():
        spec = specs.get(name)
        if spec is None:
            raise RuntimeError(f"megatron-core built a parameter the harness does not know: {name}")
        ours, theirs = layout_of(spec, job.side), from_mcore_param(p, mesh)
        if ours.to_json() != theirs.to_json():
            raise RuntimeError(f"{name}: megatron-core lays it out as {theirs.to_json()}, expected {ours.to_json()}")
        with torch.no_grad():
            p.copy_(shard(state[name], ours, coord).to(p.dtype))
        seen.add(name)
    missing = set(specs) - seen
    if missing:
        raise RuntimeError(f"megatron-core did not build {sorted(missing)}")


def _optimizer(job: Job, ddp):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    side = job.side
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer=side.optimizer,
            lr=side.lr,
            min_lr=side.min_lr,
            weight_decay=side.weight_decay,
            adam_beta1=side.adam_beta1,
            adam_beta2=side.adam_beta2,
            adam_eps=side.adam_eps,
            sgd_momentum=side.sgd_momentum,
            clip_grad=side.clip_grad,
            bf16=side.precision == "bf16",
            params_dtype=DTYPES[side.precision],
            log_num_zeros_in_grad=True,
            use_distributed_optimizer=side.distributed_optimizer,
        ),
        [ddp],
    )
    gbs = job.data.global_batch_size
    # Megatron-LM counts scheduler steps in samples.
    scheduler = OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=side.lr,
        min_lr=side.min_lr,
        lr_warmup_steps=side.lr_warmup_steps * gbs,
        lr_decay_steps=(side.lr_decay_steps or side.steps) * gbs,
        lr_decay_style=side.lr_decay_style,
        start_wd=side.weight_decay,
        end_wd=side.weight_decay,
        wd_incr_steps=side.steps * gbs,
        wd_incr_style="constant",
    )
    return opt, scheduler


def _loss_func(rec: Recording, mb_state: dict, loss_mask, output_tensor):
    losses = output_tensor.float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().to(torch.int)
    rec.loss((loss / num_tokens).item(), mb_state["mb"], mb_state["ids"])
    return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.float().view(1)])}


def run(job: Job, cap: Capture) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    compat.install()
    compat.reset_gtp_state()
    reach = None
    try:
        if job.side.mutant:  # a mutation campaign's side: undone with the faults' patches below
            from harness.mutation.apply import apply

            reach = apply(job.side.mutant, watch=True)
        config, ddp, mesh, coord = _build(job)
        opt, scheduler = _optimizer(job, ddp)
        _train(job, cap, config, ddp, opt, scheduler, mesh, get_forward_backward_func(), finalize_model_grads)
    finally:
        if reach is not None:  # beside the rank's trace files, not in them (see mutation.campaign)
            reach.close(cap.rank_dir / "mutant.json")
        compat.set_eager_collectives(False)
        faults.uninstall()  # the faults' patches and the gather recorder's
        ps.destroy_model_parallel()
        compat.reset_gtp_state()


def _train(job, cap, config, ddp, opt, scheduler, mesh, forward_backward, finalize_model_grads):
    from megatron.core import parallel_state as ps

    side = job.side
    rank = dist.get_rank()
    layouts = {canonical_name(n): from_mcore_param(p, mesh) for n, p in ddp.named_parameters()}
    named = [(canonical_name(n), p) for n, p in ddp.named_parameters()]
    inner = ddp.module.module if side.precision == "bf16" else ddp.module
    cap.attach(captured_modules(inner), vocab_parallel=["output_layer"], sequence_parallel=side.sequence_parallel)
    cap.info["gtp_params"] = {n: getattr(p, "chain_id", None) for n, p in named
                              if getattr(p, "is_gtp_weight_remat", False)}  # fmt: skip
    cap.info["data_parallel_rank"] = ps.get_data_parallel_rank()
    cap.info["data_parallel_size"] = ps.get_data_parallel_world_size()
    ctx = faults.Context(backend="megatron", side=side, model=ddp, optimizer=opt, rank=rank,
                         coord=data_mod.coord(rank, side), named_params=named)  # fmt: skip
    ctx.saved["data"] = job.data
    faults.install(side.inject, ctx)
    rec = Recording(cap, named, layouts)
    fns = _MegatronStep(job, rec, ctx, config, ddp, opt, scheduler, forward_backward)

    def finalize(model_chunks, num_tokens=None, **kw):
        finalize_model_grads(model_chunks, num_tokens, **kw)
        faults.after_finalize(ctx)
        rec.grads(_reduced_grad(opt))

    config.finalize_model_grads_func = finalize
    config.grad_scale_func = opt.scale_loss
    checkpoint.train(job, rec, fns, ddp, opt, scheduler, ctx)  # plain training unless it saves or resumes


class _MegatronStep:
    """One step as Megatron-LM's ``train_step`` runs it: MCore's schedule, optimizer, scheduler."""

    def __init__(self, job, rec: Recording, ctx, config, ddp, opt, scheduler, forward_backward):
        from megatron.core import parallel_state as ps

        self.job, self.rec, self.ctx, self.ddp, self.opt, self.scheduler = job, rec, ctx, ddp, opt, scheduler
        self.forward_backward_func = forward_backward
        m = job.model
        self.mask = torch.triu(torch.ones(1, 1, m.seq_length, m.seq_length, dtype=torch.bool), 1)
        self.positions = torch.arange(m.seq_length)[None]
        self.data_group = ps.get_data_parallel_group()  # GTP-inclusive: the data-distribution group
        self.skipped = 0
        gtp_on = job.side.gtp > 1
        # Where GTP is off the weight each GEMM reads is the parameter itself.
        direct = [] if gtp_on else [(n, p) for n, p in rec.named if _GTP_SHARDABLE(n)]
        self.materialized = Materialized(rec.cap, {n: gathered(l) for n, l in rec.layouts.items()}, direct)
        if gtp_on:
            record_gathers(rec.named, self.materialized.record, rec.cap)

    def begin(self, step: int) -> None:
        self.materialized.begin_step()
        faults.at_step(self.ctx, step)

    def forward_backward(self, step: int) -> None:
        side, m, d, cap = self.job.side, self.job.model, self.job.data, self.rec.cap
        ids = faults.route_samples(self.ctx, step, data_mod.rank_sample_ids(step, self.ctx.rank, side, d))
        mb_state = {"mb": None, "ids": None}

        def batches():
            for mb, mb_ids in enumerate(ids):
                faults.before_micro_batch(self.ctx, mb)
                mb_state.update(mb=mb, ids=mb_ids)
                cap.micro_batch(mb, mb_ids)
                yield data_mod.batch(d.seed, mb_ids, m)

        def forward_step(data_iterator, model):
            tokens, labels = next(data_iterator)
            out = model(tokens, self.positions.expand(tokens.shape[0], -1), self.mask, labels=labels)
            return out, partial(_loss_func, self.rec, mb_state, torch.ones_like(labels, dtype=torch.float32))

        self.ddp.zero_grad_buffer()
        self.opt.zero_grad()
        self.losses = self.forward_backward_func(
            forward_step_func=forward_step, data_iterator=batches(), model=[self.ddp],
            num_microbatches=side.num_microbatches(d), seq_length=m.seq_length,
            micro_batch_size=d.micro_batch_size, forward_only=False,
        )  # fmt: skip

    def prepare_update(self, step: int) -> None:
        self.lr_applied = self.opt.param_groups[0]["lr"]

    def update(self, step: int) -> None:
        faults.before_step(self.ctx)
        ok, self.grad_norm, self.num_zeros = self.opt.step()
        self.skipped += 0 if ok else 1
        self.scheduler.step(increment=self.job.data.global_batch_size)
        faults.after_step(self.ctx)

    def optimizer_state(self):
        return _optimizer_state(self.opt, self.rec.named)

    def scalars(self, step: int) -> StepScalars:
        totals = torch.stack([x["lm loss"] for x in self.losses]).sum(0)
        dist.all_reduce(totals, group=faults.loss_report_group(self.ctx, self.data_group))
        nan = float("nan")
        return StepScalars(
            reduced_loss=(totals[0] / totals[1]).item(),
            grad_norm=float(self.grad_norm) if self.grad_norm is not None else nan,
            lr=self.lr_applied, lr_logged=self.opt.param_groups[0]["lr"],
            num_zeros=float(self.num_zeros) if self.num_zeros is not None else nan,
            skipped=float(self.skipped),
        )  # fmt: skip


def _GTP_SHARDABLE(name: str) -> bool:
    return name.endswith(("word_embeddings.weight", "linear_qkv.weight", "linear_proj.weight",
                          "linear_fc1.weight", "linear_fc2.weight", "output_layer.weight"))


def _parts(opt) -> list:
    """The optimizers behind MCore's wrapper (one per param group family when chained)."""
    return list(getattr(opt, "chained_optimizers", None) or [opt])


def _distributed_group(opt):
    """The data-parallel group of MCore's DistributedOptimizer, or None (local optimizer)."""
    for part in _parts(opt):
        if hasattr(part, "gbuf_ranges"):
            return part.data_parallel_group
    return None


def _owned(opt, p):
    """(the DistributedOptimizer part, the range of ``p``'s elements) this data-parallel rank
    owns, or (None, None): a rank's range maps list only the params it owns a part of."""
    for part in _parts(opt):
        for gbuf in getattr(part, "gbuf_ranges", []):
            for buckets in gbuf.values():
                for bucket in buckets:
                    if p in bucket["param_map"]:
                        return part, bucket["param_map"][p]["param"]
    return None, None


def _whole(group, p, r, shard: torch.Tensor | None, dtype=torch.float32) -> torch.Tensor:
    """A tensor of ``p``'s shape from the range ``r`` of it that each data-parallel rank holds
    (``shard``; None where this rank holds none): the ranges are disjoint, so a SUM of
    zero-filled copies is exact. Every rank of the group calls it, for every parameter."""
    full = torch.zeros(p.numel(), dtype=dtype)
    if shard is not None:
        full[r.start:r.end] = shard.detach().reshape(-1)
    dist.all_reduce(full, group=group)
    return full.view(p.shape)


def _reduced_grad(opt):
    """main_grad after finalize: under the distributed optimizer only this rank's range of
    each grad buffer is reduced, so the whole gradient is put together from every range."""
    group = _distributed_group(opt)

    def value(p):
        grad = getattr(p, "main_grad", None)
        if group is None or grad is None:
            return grad
        _, r = _owned(opt, p)
        return _whole(group, p, r, None if r is None else grad.reshape(-1)[r.start:r.end], grad.dtype)

    return value


# The per-element states of a DistributedOptimizer's range, the same on every rank (whether it
# owns a range or not: each is put together by a collective).
_ADAM_OR_SGD = {"adam": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


def _optimizer_state(opt, named) -> tuple[dict, dict]:
    """(states by id of the stepped tensor, fp32 masters by parameter name) across MCore's
    wrapper, which chains one optimizer per param-group family. Under the distributed
    optimizer each state is put together from the data-parallel ranks' ranges."""
    masters, states = {}, {}
    if (group := _distributed_group(opt)) is not None:
        config = _parts(opt)[0].config
        kinds = _ADAM_OR_SGD[config.optimizer] if config.optimizer == "adam" or config.sgd_momentum else ()
        for name, p in named:
            part, r = _owned(opt, p)
            owned = part._get_main_param_and_optimizer_states(p) if part is not None else {}
            master = _whole(group, p, r, owned.get("param"))
            states[id(master) if p.dtype != torch.float32 else id(p)] = {
                k: _whole(group, p, r, owned.get(k)) for k in kinds}  # fmt: skip
            if p.dtype != torch.float32:  # as the local optimizer: a separate master only in mixed precision
                masters[id(p)] = master
        return states, {name: masters[id(p)] for name, p in named if id(p) in masters}
    for part in _parts(opt):
        for g16, g32 in zip(getattr(part, "float16_groups", []), getattr(part, "fp32_from_float16_groups", [])):
            for p16, p32 in zip(g16, g32):  # mixed precision: the fp32 master copies
                masters[id(p16)] = p32
        states.update({id(p): st for p, st in part.optimizer.state.items()})
    return states, {name: masters[id(p)] for name, p in named if id(p) in masters}
