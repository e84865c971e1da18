"""The ``mlm`` backend: Megatron-LM's own loop, ``megatron.training.pretrain``, captured.

Megatron-LM drives the loop; the harness supplies the providers (:mod:`.providers`) and
records at Megatron-LM's hook points, calling :mod:`harness.backends.recording`'s pieces in
the order :func:`~harness.backends.recording.train` calls them, so the trace has the same
schema and order as every other backend's:

- ``train_step`` (wrapped, a module global of ``megatron.training.training``): the step's
  begin and end, and its scalars from what ``train_step`` returns (the logged loss, reduced
  by Megatron-LM over the GTP-inclusive data group; grad norm; num-zeros);
- the forward step's micro-batches and ``loss_func``: sample ids and per-micro-batch losses;
- ``finalize_model_grads`` (wrapped; ``train`` installs it as the schedule's finalize hook):
  ``main_grad`` after the reduction;
- ``optimizer.step`` (wrapped for the step): LR applied, weights before and after, state;
- ``training_log``'s printed line (``print_rank_last``, every rank builds it): the loss the
  frontend logs for the step, ``loss_logged`` (:func:`logged_loss`).
- ``evaluate`` (wrapped, a module global ``evaluate_and_print_results`` calls): an evaluation's
  per-micro-batch losses (its forward steps go through the same ``loss_func``) and the loss it
  returns, as :mod:`harness.backends.evaluation` records them.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys

import torch.distributed as dist

from harness.backends import data as data_mod
from harness.backends import faults
from harness.run.job import Job
from harness.backends.evaluation import EvalRecorder
from harness.backends.megatron import arch, compat
from harness.backends.megatron.gathers import record_gathers
from harness.backends.megatron.optimizer_ranges import optimizer_state
from harness.backends.megatron.run import _GTP_SHARDABLE, _load_canonical, canonical_name
from harness.backends.mlm import compat as training_compat
from harness.backends.mlm import providers
from harness.backends.mlm.args import CPU_FLAGS, side_argv
from harness.backends.recording import (
    Materialized, Recording, StepScalars, gathered, record_initial, record_step_end, record_update,
)
from harness.capture.api import Capture
from harness.backends.gpt import captured_modules, mesh_of
from harness.backends.patching import patch


@contextlib.contextmanager
def _argv(argv: list[str]):
    # Megatron-LM's parse_args reads sys.argv.
    saved = sys.argv
    sys.argv = ["pretrain_gpt.py", *argv]
    try:
        yield
    finally:
        sys.argv = saved


def run(job: Job, cap: Capture) -> None:
    """Train ``job``'s side with ``megatron.training.pretrain`` on this rank."""
    run_argv(job, cap, side_argv(job.model, job.data, job.side))


def run_argv(job: Job, cap: Capture, argv: list[str]) -> None:
    """``pretrain`` on ``argv`` (pretrain_gpt.py flags; on CPU, :data:`CPU_FLAGS` first)."""
    from megatron.core.enums import ModelType
    from megatron.training import training
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    # validate_args asserts it with TP > 1 (it orders kernels on CUDA's queues); Megatron-LM's
    # launch scripts export it. A value the user set is kept.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    on_cpu = training_compat.install_training()
    compat.reset_gtp_state()
    hooks = _Hooks(job, cap)
    try:
        with _argv([*(CPU_FLAGS if on_cpu else ()), *argv]):
            args = parse_and_validate_args()
        patch(training, "train_step", hooks.train_step(training.train_step))
        patch(training, "finalize_model_grads", hooks.finalize(training.finalize_model_grads))
        patch(training, "print_rank_last", logged_loss(cap, training.print_rank_last))
        patch(training, "evaluate", hooks.evaluate(training.evaluate))
        synthetic = (lambda: providers.SyntheticDataset(job.data.seed,
                                                        job.model)) if job.side.data == "synthetic" else None
        training.pretrain(
            pretrain_cfg_container_from_args(args),
            providers.dataset_provider(synthetic),
            ModelType.encoder_or_decoder,
            providers.forward_step(hooks.micro_batch, args.seq_length),
            model_provider=providers.model_provider(hooks.after_build),
        )
    finally:
        faults.uninstall()  # the faults' patches, the hooks' and the gather recorder's
        training.destroy_global_state()  # Megatron-LM's globals: the next side parses afresh
        compat.reset_gtp_state()


_LOGGED_LOSS = re.compile(r"\| lm loss: ([-+0-9.eEinfa]+) \|")


def logged_loss(cap: Capture, print_rank_last):
    """``print_rank_last`` recording the loss its line logs (``lm loss: %.6E``) as the scalar
    ``loss_logged`` of the step just recorded: what the frontend shows its user, which need
    not be the step's reduced loss (a log line may average over several steps)."""

    def print_line(message, *args, **kwargs):
        found = _LOGGED_LOSS.search(message) if isinstance(message, str) else None
        if found is not None and cap.step:
            cap.scalar("loss_logged", float(found.group(1)))
        return print_rank_last(message, *args, **kwargs)

    return print_line


class _Hooks:
    """What the harness does at each of Megatron-LM's hook points, on one rank."""

    def __init__(self, job: Job, cap: Capture):
        self.job, self.cap, self.side = job, cap, job.side
        self.rank = dist.get_rank()
        self.mesh, self.coord = mesh_of(self.side), data_mod.coord(self.rank, self.side)
        self.rec: Recording | None = None
        self.mb = 0
        self.skipped = 0
        # eval_mb: micro-batches read in the running evaluation
        self.evals, self.eval_mb = EvalRecorder(cap), None

    def after_build(self, model) -> None:
        _load_canonical(model, self.job, self.mesh, self.coord)

    def _start(self, model, optimizer) -> None:
        """At the first train_step: the recording, the fault context, the initial weights."""
        from megatron.core import parallel_state as ps

        chunk = model[0]
        named = [(canonical_name(n), p) for n, p in chunk.named_parameters()]
        layouts = arch.param_layouts(named, self.mesh, self.job.model)
        inner = chunk.module.module if self.side.precision == "bf16" else chunk.module
        self.cap.attach(captured_modules(inner), vocab_parallel=["output_layer"])
        self.cap.info["gtp_params"] = {n: getattr(p, "chain_id", None) for n, p in named
                                       if getattr(p, "is_gtp_weight_remat", False)}
        self.cap.info["data_parallel_rank"] = ps.get_data_parallel_rank()
        self.cap.info["data_parallel_size"] = ps.get_data_parallel_world_size()
        self.pgc = inner.pg_collection
        self.ctx = faults.Context(backend="mlm", side=self.side, model=chunk, optimizer=optimizer,
                                  rank=self.rank,
                                  coord=self.coord, named_params=named)
        self.ctx.saved["data"] = self.job.data
        faults.install(self.side.inject, self.ctx)
        self.rec = Recording(self.cap, named, layouts)
        gtp_on = self.side.gtp > 1
        direct = [] if gtp_on else [(n, p) for n, p in named if _GTP_SHARDABLE(n)]
        self.materialized = Materialized(self.cap, {n: gathered(lay) for n, lay in layouts.items()}, direct)
        if gtp_on:
            record_gathers(named, self.materialized.record, self.cap)
        record_initial(self.rec)

    def micro_batch(self, sample_ids: list[int]):
        if self.eval_mb is not None:  # an evaluation's forward step: no tensors, its losses
            iteration, index = divmod(self.eval_mb, self.side.num_microbatches(self.job.data))
            self.eval_mb += 1
            return lambda value, tokens: self.evals.sample(value, sample_ids, tokens, iteration, index)
        index = self.mb
        self.mb += 1
        self.cap.micro_batch(index, sample_ids)
        return lambda value, tokens: self.rec.loss(value, index, sample_ids)

    def evaluate(self, original):
        def evaluate(*args, **kwargs):
            self.evals.begin()
            self.eval_mb = 0
            try:
                out = original(*args, **kwargs)
            finally:
                self.eval_mb = None
            if out[0] and "lm loss" in out[0]:  # the loss evaluate_and_print_results prints
                self.evals.report(float(out[0]["lm loss"]))
            return out

        return evaluate

    def finalize(self, original):
        def finalize_model_grads(model_chunks, num_tokens=None, **kwargs):
            out = original(model_chunks, num_tokens, **kwargs)
            faults.after_finalize(self.ctx)
            self.rec.grads(lambda p: getattr(p, "main_grad", None))
            return out

        return finalize_model_grads

    def train_step(self, original):
        def train_step(forward_step_func, data_iterator, model, optimizer, *args, iteration=None, **kwargs):
            if self.rec is None:
                self._start(model, optimizer)
            step = iteration + 1
            self.cap.begin_step(step)
            self.materialized.begin_step()
            faults.at_step(self.ctx, step)
            self.mb = 0
            self.cap.progress("forward_backward")
            report_group = self.pgc.dp_cp_gtp_remat
            optimizer.step = self._optimizer_step(optimizer, optimizer.step)
            try:
                out = original(forward_step_func, data_iterator, model, optimizer, *args, iteration=iteration,
                               **kwargs)
            finally:
                del optimizer.step  # the instance attribute: the class's step again
                self.pgc.dp_cp_gtp_remat = report_group
            self._end(optimizer, out)
            return out

        return train_step

    def _optimizer_step(self, optimizer, step):
        def optimizer_step():
            self.lr_applied = optimizer.param_groups[0]["lr"]

            def update():
                faults.before_step(self.ctx)
                out = step()
                faults.after_step(self.ctx)
                return out

            out = record_update(self.rec, update)
            # train_step reduces the logged loss after the step, over this group.
            self.pgc.dp_cp_gtp_remat = faults.loss_report_group(self.ctx, self.pgc.dp_cp_gtp_remat)
            return out

        return optimizer_step

    def _end(self, optimizer, out) -> None:
        loss_reduced, skipped, grad_norm, num_zeros = out[0], out[1], out[5], out[6]
        self.skipped += int(skipped)
        nan = float("nan")
        scalars = StepScalars(
            reduced_loss=float(loss_reduced["lm loss"]) if "lm loss" in loss_reduced else nan,
            grad_norm=float(grad_norm) if grad_norm is not None else nan,
            lr=self.lr_applied, lr_logged=optimizer.param_groups[0]["lr"],
            num_zeros=float(num_zeros) if num_zeros is not None else nan,
            skipped=float(self.skipped),
        )
        record_step_end(self.rec, lambda: optimizer_state(optimizer, self.rec.named), scalars)
