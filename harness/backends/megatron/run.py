"""The ``megatron`` backend: megatron-core's GPTModel, GTP, DDP, finalize_model_grads, optimizer.

One call of :func:`run` trains one side on this rank, as Megatron-LM's ``pretrain_gpt.py``
does: MCore's no-pipelining schedule over the rank's micro-batches, ``finalize_model_grads``
as the schedule's finalize hook, MCore's optimizer and ``OptimizerParamScheduler`` (stepped
in samples, as Megatron-LM does). What a step records, and when, is
:mod:`harness.backends.recording`'s; this module supplies how each step computes.
"""

from __future__ import annotations

import dataclasses

from functools import partial

import torch
import torch.distributed as dist

from harness.backends import data as data_mod
from harness.backends import faults
from harness.run.job import Job
from harness.backends.evaluation import EvalRecorder
from harness.backends.megatron import checkpoint, compat, evaluation, groups, moe, pipeline
from harness.backends.megatron import arch, defaults, mtp, teardown
from harness.backends.megatron.gathers import record_gathers
from harness.backends.megatron.optimizer_ranges import optimizer_state, reduced_grad, updated_param
from harness.backends.megatron.terms import GradTerms
from harness.backends.recording import Materialized, Recording, StepScalars, gathered
from harness.capture.api import Capture
from harness.common import muon
from harness.common.dtypes import DTYPES
from harness.backends.gpt import (
    canonical_state, captured_modules, layout_of, mesh_of, param_specs,
)
from harness.common.layout import from_mcore_param, holds, shard
from harness.scenario.options import mcore_kwargs
from harness.scenario.vocab_rules import padded_vocab_size
from harness.common.mesh import on_grid


def canonical_name(name: str) -> str:
    """Strip the DDP / Float16Module wrappers' ``module.`` prefixes."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def _transformer_config(job: Job):
    """megatron-core's TransformerConfig of the side, as Megatron-LM builds it from its flags."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    side, m = job.side, job.model
    return TransformerConfig(
        **mcore_kwargs("TransformerConfig", m, side),  # the declared one-to-one arguments
        tensor_parallel_num_weight_shards=side.tp * side.gtp,
        use_cpu_initialization=True,
        perform_initialization=False,  # canonical weights are loaded after construction
        hidden_dropout=0.0,
        attention_dropout=0.0,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        bf16=side.precision == "bf16",
        params_dtype=DTYPES[side.precision],
        pipeline_dtype=DTYPES[side.precision],
        deterministic_mode=True,
        calculate_per_token_loss=side.per_token_loss != "none",
        **_RECOMPUTE[side.recompute],
        **moe.config_kwargs(job),
        **mtp.config_kwargs(job),
        **arch.config_kwargs(m),
        **pipeline.config_kwargs(side),
    )


def _build(job: Job):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import gtp_api
    from megatron.core.tensor_parallel import generalized_tensor_parallelism as gtp_impl
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    side, m = job.side, job.model
    if side.recipe != "none":
        raise NotImplementedError(f"recipe {side.recipe!r} needs the Transformer Engine path of this backend")
    ps.initialize_model_parallel(tensor_model_parallel_size=side.tp, gtp_remat_size=side.gtp,
                                 **moe.parallel_kwargs(side), **pipeline.parallel_state_kwargs(side))
    pgc = groups.collection(side)  # None: every module reads parallel_state's groups
    faults.before_build(side.inject, pgc)
    model_parallel_cuda_manual_seed(side.seed)
    torch.manual_seed(side.seed)
    if moe.uses_gtp(side):
        # Megatron-LM passes --calculate-per-token-loss here too; a user of the API may not
        # (per_token_loss = "transformer-config"): GTP then keeps its 1/G wgrad pre-scale.
        gtp_api.configure_gtp_remat_from_recipe(calculate_per_token_loss=side.per_token_loss == "both")
        gtp_impl.update_gtp_config(pad_for_alignment=side.gtp_pad_alignment,
                                   weight_prefetch=side.gtp_weight_prefetch)
    compat.set_collectives(side.gtp_collectives)
    if side.sequence_parallel:
        compat.layer_norm_for_sequence_parallel()
    bf16 = side.precision == "bf16"
    config = _transformer_config(job)
    mesh = mesh_of(side)
    coord = data_mod.coord(dist.get_rank(), side)
    ddp_config = DistributedDataParallelConfig(**mcore_kwargs("DistributedDataParallelConfig", side))
    chunks = []  # one model chunk per virtual pipeline stage (one when not interleaved)
    for vp in pipeline.chunk_ids(side):
        model = GPTModel(
            config=config,
            transformer_layer_spec=moe.layer_spec(job),
            **mcore_kwargs("GPTModel", m),
            vocab_size=padded_vocab_size(m, side.tp),  # padded as Megatron-LM pads it
            share_embeddings_and_output_weights=not m.untie_embeddings,
            mtp_block_spec=mtp.block_spec(job, config, moe.layer_spec(job)),
            **pipeline.stage_flags(vp),
            **groups.kwargs(pgc),
        )
        _load_canonical(model, job, mesh, coord, vp)
        if bf16:
            model = Float16Module(config, model)
        # As Megatron-LM's get_model: only the first chunk buckets its grads.
        chunks.append(DistributedDataParallel(config, ddp_config, model, disable_bucketing=bool(chunks),
                                              **groups.kwargs(pgc)))
    if side.overlap_param_gather:  # Megatron-LM's train(): no pre-hooks until the first step is done
        for chunk in chunks:
            chunk.disable_forward_pre_hook(param_sync=False)
    if side.overlap_grad_reduce:  # as Megatron-LM's train() wires an overlapping DDP
        config.no_sync_func = pipeline.one_or_list([c.no_sync for c in chunks])
        config.grad_sync_func = pipeline.one_or_list([c.start_grad_sync for c in chunks])
    if moe.uses_gtp(side):
        gtp_api.classify_gtp_remat_chains(chunks)
    return config, chunks, mesh, coord, pgc


# TransformerConfig's recompute settings per scenario choice (full: one layer per checkpoint).
_RECOMPUTE = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}


def _load_canonical(model, job: Job, mesh: dict, coord: dict, vp: int | None = None) -> None:
    """Cut the canonical weights into this rank's shards, after checking MCore's layout is ours."""
    from megatron.core import parallel_state as ps

    specs = {s.name: s for s in param_specs(job.model)}
    state = canonical_state(job.model, job.side.seed)
    names = pipeline.canonical_names(model, canonical_name)
    stage = ps.get_pipeline_model_parallel_rank()
    side = job.side
    # The parameters this stage (this model chunk) holds: megatron-core must build exactly these.
    mine = pipeline.owned(list(specs), job.model.num_layers, side.pipeline_parallel, stage,
                          side.virtual_pipeline or 1, vp or 0, bool(job.model.mtp_num_layers))
    specs = {n: specs[n] for n in mine}
    seen = set()
    for local, p in model.named_parameters():
        spec = specs.get(name := moe.global_name(names[local], job))
        if spec is None:
            raise RuntimeError(f"megatron-core built a parameter the harness does not know: {name}")
        ours = layout_of(spec, job.side, job.model.num_experts)
        theirs = moe.mcore_layout(p, ours) if spec.expert is not None else from_mcore_param(p, mesh)
        theirs = dataclasses.replace(theirs, vocab_padding=spec.vocab_padding)  # not an attribute of theirs
        theirs = arch.softmax_offset_layout(name, p, theirs)
        if ours.to_json() != theirs.to_json():
            raise RuntimeError(f"{name}: megatron-core lays it out as {theirs.to_json()}, expected "
                               f"{ours.to_json()}")
        with torch.no_grad():
            p.copy_(shard(state[name], ours, on_grid(coord, ours.grid)).to(p.dtype))
        seen.add(name)
    here = {n for n, spec in specs.items() if holds(layout_of(spec, job.side, job.model.num_experts), coord)}
    missing = here - seen  # a routed expert is built on the ranks of its EP coordinate only
    if missing:
        raise RuntimeError(f"megatron-core did not build {sorted(missing)}")


def _optimizer(job: Job, chunks: list, pgc=None):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    side = job.side
    opt = get_megatron_optimizer(
        OptimizerConfig(
            **mcore_kwargs("OptimizerConfig", side),  # the declared one-to-one arguments
            bf16=side.precision == "bf16",
            params_dtype=DTYPES[side.precision],
            log_num_zeros_in_grad=True,
            **_muon_kwargs(side),
        ),
        chunks,
        **groups.optimizer_kwargs(pgc),
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


def _muon_kwargs(side) -> dict:
    """megatron-core's Muon switch and the hyper-parameters the golden's Muon computes with."""
    if side.optimizer != "muon":
        return {}
    return {"muon_tp_mode": side.muon_tp_mode, **muon.optimizer_config_kwargs()}


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
    teardown.forget_trackers()
    reach, chunks = None, []
    try:
        if job.side.mutant or job.lines:  # a mutation campaign's side: undone with the faults' patches
            from harness.backends.faults.mutant import watch

            reach = watch(job.side.mutant, job.lines)
        config, chunks, mesh, coord, pgc = _build(job)
        # Names: global layer numbers on every stage, global expert indices on every EP rank.
        named = [(moe.global_name(pipeline.canonical_names(c, canonical_name)[n], job), p)
                 for c in chunks for n, p in c.named_parameters()]
        ctx = faults.Context(backend="megatron", side=job.side, model=chunks, optimizer=None,
                             rank=dist.get_rank(),
                             coord=coord, named_params=named)
        ctx.saved.update(data=job.data, pg_collection=pgc)
        faults.install(job.side.inject, ctx)  # before the optimizer: a fault may act on how it is built
        ctx.optimizer, scheduler = _optimizer(job, chunks, ctx.saved["pg_collection"])
        cap.info["stepped_by"] = muon.stepped_by(ctx.optimizer, named)
        cap.info["tree_defaults"] = defaults.tree_defaults(job.model, job.data, job.side)
        _train(job, cap, ctx, config, chunks, scheduler, mesh, get_forward_backward_func(),
               finalize_model_grads)
    finally:
        if reach is not None:  # beside the rank's trace files, not in them (see mutation.campaign)
            reach.close(cap.rank_dir / reach.FILE)
        compat.set_collectives("async")
        faults.uninstall()  # the faults' patches and the gather recorder's
        teardown.release_model(chunks)
        ps.destroy_model_parallel()
        teardown.drop_parallel_state_groups()
        compat.reset_gtp_state()


def _train(job, cap, ctx, config, chunks, scheduler, mesh, forward_backward, finalize_model_grads):
    from megatron.core import parallel_state as ps

    side, opt, named = job.side, ctx.optimizer, ctx.named_params
    layouts = pipeline.with_replica_stages(arch.param_layouts(named, mesh, job.model), job)
    layouts.update(moe.expert_layouts(job, named))
    for ddp in chunks:
        inner = ddp.module.module if side.precision == "bf16" else ddp.module
        modules = captured_modules(inner) if side.pipeline_parallel == 1 else pipeline.stage_modules(inner)
        mtp.attach(inner, cap, job, modules, lambda: fns.loss_mask)
        cap.attach(modules, vocab_parallel=["output_layer"], sequence_parallel=side.sequence_parallel)
        moe.attach_router_capture(inner, cap, job.model.seq_length, side.sequence_parallel)
    cap.info["gtp_params"] = {n: getattr(p, "chain_id", None) for n, p in named
                              if getattr(p, "is_gtp_weight_remat", False)}
    cap.info["data_parallel_rank"] = ps.get_data_parallel_rank()
    cap.info["data_parallel_size"] = ps.get_data_parallel_world_size()
    # With the param gather overlapped, the updated params reach every rank in the next forward:
    # the step's new weights are the ranges each rank's optimizer wrote, put together.
    rec = Recording(cap, named, layouts, param_value=updated_param(opt) if side.overlap_param_gather
                    else None)
    fns = _MegatronStep(job, rec, ctx, config, chunks, opt, scheduler, forward_backward)

    def finalize(model_chunks, num_tokens=None, **kw):
        fns.terms.record(rec.layout_of, fns.data_group)  # before DDP sums them
        finalize_model_grads(model_chunks, num_tokens, **faults.finalize_kwargs(ctx, kw))
        faults.after_finalize(ctx)
        rec.grads(reduced_grad(opt))

    config.finalize_model_grads_func = finalize
    config.grad_scale_func = opt.scale_loss
    # plain training unless it saves or resumes (a checkpoint side has one model chunk:
    # harness.scenario.rules)
    checkpoint.train(job, rec, fns, chunks[0], opt, scheduler, ctx)


class _MegatronStep:
    """One step as Megatron-LM's ``train_step`` runs it: MCore's schedule, optimizer, scheduler."""

    def __init__(self, job, rec: Recording, ctx, config, chunks, opt, scheduler, forward_backward):
        self.job, self.rec, self.ctx, self.chunks = job, rec, ctx, chunks
        self.opt, self.scheduler = opt, scheduler
        self.forward_backward_func = forward_backward
        m = job.model
        self.mask = torch.triu(torch.ones(1, 1, m.seq_length, m.seq_length, dtype=torch.bool), 1)
        self.positions = torch.arange(m.seq_length)[None]
        # GTP-inclusive: where samples are spread
        self.data_group = groups.data_group(ctx.saved["pg_collection"])
        self.skipped = 0
        self.evals = EvalRecorder(rec.cap)
        self.terms = GradTerms(job.side, job.model, rec.cap, rec.named)
        gtp_on = moe.uses_gtp(job.side)
        # Where GTP is off the weight each GEMM reads is the parameter itself.
        direct = [(n, p) for n, p in rec.named
                  if _GTP_SHARDABLE(n) and not getattr(p, "is_gtp_weight_remat", False)]
        gathered_layouts = {n: gathered(lay) for n, lay in rec.layouts.items()}
        self.materialized = Materialized(rec.cap, gathered_layouts, direct)
        if job.side.overlap_param_gather:  # the updated weights arrive in the forward
            self.materialized.at_forward(mod for chunk in chunks for mod in chunk.module.modules())
        if gtp_on:
            record_gathers(rec.named, self.materialized.record, rec.cap)

    def begin(self, step: int) -> None:
        self.materialized.begin_step()
        faults.at_step(self.ctx, step)

    def forward_backward(self, step: int) -> None:
        side, m, d, cap = self.job.side, self.job.model, self.job.data, self.rec.cap
        ids = faults.route_samples(self.ctx, step, data_mod.rank_sample_ids(step, self.ctx.rank, side, d))
        mb_state = {"mb": None, "ids": None}

        def batches(chunk: int = 0):  # each model chunk reads every micro-batch; the first records it
            for mb, mb_ids in enumerate(ids):
                if mb and chunk == 0:
                    self.terms.micro_batch_done()  # the schedule ran mb - 1's backward
                faults.before_micro_batch(self.ctx, mb)
                mb_state.update(mb=mb, ids=mb_ids)
                cap.micro_batch(mb, mb_ids, record=chunk == 0)
                yield (*data_mod.batch(d.seed, mb_ids, m), data_mod.loss_mask(d, mb_ids, m.seq_length))

        def forward_step(data_iterator, model):
            tokens, labels, loss_mask = next(data_iterator)
            self.loss_mask = loss_mask  # what MTP's depths roll (process_mtp_loss)
            out = model(tokens, self.positions.expand(tokens.shape[0], -1), self.mask, labels=labels,
                        loss_mask=loss_mask, **moe.forward_kwargs(m, loss_mask))
            return out, partial(_loss_func, self.rec, mb_state, loss_mask)

        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.opt.zero_grad()
        self.terms.begin_step()
        iterators = [batches(c) for c in range(len(self.chunks))]
        self.losses = self.forward_backward_func(
            forward_step_func=forward_step, data_iterator=pipeline.one_or_list(iterators), model=self.chunks,
            num_microbatches=side.num_microbatches(d), seq_length=m.seq_length,
            micro_batch_size=d.micro_batch_size, forward_only=False,
                **groups.kwargs(self.ctx.saved["pg_collection"]),
        )

    def prepare_update(self, step: int) -> None:
        self.lr_applied = self.opt.param_groups[0]["lr"]

    def update(self, step: int) -> None:
        faults.before_step(self.ctx)
        ok, self.grad_norm, self.num_zeros = self.opt.step()
        if self.job.side.overlap_param_gather and step == 1:  # as Megatron-LM's train() does
            for chunk in self.chunks:
                chunk.enable_forward_pre_hook()
        self.skipped += 0 if ok else 1
        self.scheduler.step(increment=self.job.data.global_batch_size)
        faults.after_step(self.ctx)

    def optimizer_state(self):
        return optimizer_state(self.opt, self.rec.named)

    def evaluate(self, step: int) -> None:
        evaluation.evaluate(self, self.evals)

    def scalars(self, step: int) -> StepScalars:
        totals = pipeline.loss_totals(self.losses)  # zeros before the last pipeline stage
        dist.all_reduce(totals, group=faults.loss_report_group(self.ctx, self.data_group))
        pipeline.from_last_stage(totals)
        nan = float("nan")
        return StepScalars(
            reduced_loss=(totals[0] / totals[1]).item(),
            grad_norm=float(self.grad_norm) if self.grad_norm is not None else nan,
            lr=self.lr_applied, lr_logged=self.opt.param_groups[0]["lr"],
            num_zeros=float(self.num_zeros) if self.num_zeros is not None else nan,
            skipped=float(self.skipped),
        )


def _GTP_SHARDABLE(name: str) -> bool:
    return name.endswith(("word_embeddings.weight", "linear_qkv.weight", "linear_proj.weight",
                          "linear_fc1.weight", "linear_fc2.weight", "output_layer.weight"))
