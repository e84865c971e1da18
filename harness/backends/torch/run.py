"""The ``torch`` backend: the golden model in one process, or TP x GTP x DP with FP8 recipes.

One process, fp64 or fp32 and no recipe, it is the golden model: the token mean of the cross
entropy over the whole global batch in one forward, full tensors, the optimizer and schedule
of :mod:`.optim`. Any other side (several ranks, a quantization recipe, or bf16 params with
fp32 masters) runs the distributed path (:mod:`.distributed`): megatron-core's layouts,
reductions, data distribution, loss normalization and mixed precision, on torch.distributed.
"""

from __future__ import annotations

import torch

from harness.backends import data as data_mod
from harness.backends import mtp
from harness.run.job import Job
from harness.backends.evaluation import EvalRecorder, eval_points, eval_sample_ids
from harness.backends.recording import Materialized, Recording, StepScalars, train
from harness.capture.api import Capture
from harness.common.dtypes import DTYPES
from harness.backends.gpt import captured_modules, canonical_state, layout_of, param_specs

from .distributed import run_distributed
from .model import GPT, token_losses
from .routed import routed_aux_loss, set_loss_mask, set_micro_batch_size
from harness.common.muon import stepped_by
from .optim import build_optimizer, clip, lr_at

__all__ = ["lr_at", "run"]


def run(job: Job, cap: Capture) -> None:
    side = job.side
    if side.world_size == 1 and side.recipe == "none" and side.precision in ("fp64", "fp32"):
        _run_golden(job, cap)
    else:
        run_distributed(job, cap)


def _run_golden(job: Job, cap: Capture) -> None:
    side, m = job.side, job.model
    dtype = DTYPES[side.precision]
    model = GPT(m).to(dtype)
    set_micro_batch_size(model, job.data.micro_batch_size)
    state = canonical_state(m, side.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(state[name].to(dtype))
    specs = {s.name: s for s in param_specs(m)}
    layouts = {n: layout_of(s, side) for n, s in specs.items()}
    named = list(model.named_parameters())
    modules = captured_modules(model)
    depths = mtp.attach(cap, model, m.mtp_num_layers, modules)
    cap.attach(modules, vocab_parallel=["output_layer"])
    rec = Recording(cap, named, layouts)
    train(rec, side.steps, _GoldenStep(job, rec, model, specs, depths), evals=eval_points(side))


class _GoldenStep:
    """One step of the golden model: the whole global batch in one forward, full tensors."""

    def __init__(self, job: Job, rec: Recording, model: GPT, specs: dict,
                 depths: mtp.DepthCapture | None = None):
        self.job, self.rec, self.model, self.depths = job, rec, model, depths
        self.opt = build_optimizer(job.side, rec.named, job.model)
        rec.cap.info["stepped_by"] = stepped_by(self.opt, rec.named)
        # The weight each GEMM reads is the parameter itself (materialized, in GTP terms).
        self.materialized = Materialized(rec.cap, rec.layouts, [(n, p) for n, p in rec.named if specs[n].gtp])
        self.evals = EvalRecorder(rec.cap)

    def begin(self, step: int) -> None:
        self.materialized.begin_step()

    def forward_backward(self, step: int) -> None:
        d, m = self.job.data, self.job.model
        ids = data_mod.step_sample_ids(step, d)
        self.rec.cap.micro_batch(0, ids)
        tokens, labels = data_mod.batch(d.seed, ids, m)
        self.opt.zero_grad(set_to_none=True)
        mask = None if d.loss_mask == "none" else data_mod.loss_mask(d, ids, m.seq_length)
        set_loss_mask(self.model, mask)
        losses = token_losses(self.model(tokens), labels)  # [b, s]
        if mask is None:
            self.loss = losses.mean()
            per_sample = [row.mean() for row in losses]
        else:  # megatron-core's per-token loss: the token sum over the global token count
            mask = mask.to(losses.dtype)
            self.loss = (losses * mask).sum() / mask.sum()
            per_sample = (losses * mask).sum(1) / mask.sum(1)
        aux = routed_aux_loss(self.model, self.rec.cap, m, tuple(ids))
        (self.loss + self._mtp_loss(labels, ids, losses.dtype) + aux).backward()
        for i, sid in enumerate(ids):
            self.rec.loss(per_sample[i].item(), 0, [sid])
        self.rec.grads(lambda p: p.grad)

    def _mtp_loss(self, labels: torch.Tensor, ids: list[int], dtype: torch.dtype):
        """megatron-core's MTP objective (``process_mtp_loss``): each depth's token mean under its
        shifted labels and loss mask (:func:`mtp.depth_objective`: under a variable loss mask
        weighted per micro-batch of one sample as megatron-core's per-token loss weights it), their
        sum times ``mtp_loss_scaling_factor / D``; each depth's per-sample loss recorded."""
        m, total = self.job.model, 0.0
        mask = data_mod.loss_mask(self.job.data, ids, m.seq_length).to(dtype)
        for depth, logits in enumerate(self.model.mtp_logits):
            losses, kept = token_losses(logits, mtp.shifted(labels, depth)), mtp.shifted(mask, depth)
            self.depths.record_loss(depth, mtp.per_sample(losses, kept))
            total = total + mtp.depth_objective(losses, kept, mask, self.job.data.loss_mask != "none")
        return total * (m.mtp_loss_scaling_factor / m.mtp_num_layers) if m.mtp_num_layers else total

    def evaluate(self, step: int) -> None:
        """Each iteration's global batch in one forward (eval mode, no graph): per-sample losses
        and the token mean over every iteration's samples, as Megatron-LM reports it."""
        d, m, side = self.job.data, self.job.model, self.job.side
        index, total, tokens = self.evals.begin(), 0.0, 0.0
        set_loss_mask(self.model, None)  # the training step's mask is not the evaluation batch's
        self.model.eval()
        with torch.no_grad():
            for it in range(side.eval_iters):
                ids = eval_sample_ids(index, it, side, d)
                inputs, labels = data_mod.batch(d.seed, ids, m)
                mask = data_mod.loss_mask(d, ids, m.seq_length).to(torch.float64)
                losses = token_losses(self.model(inputs), labels).to(torch.float64) * mask
                for i, sid in enumerate(ids):
                    self.evals.sample((losses[i].sum() / mask[i].sum()).item(), [sid], mask[i].sum().item(),
                                      it, 0)
                total, tokens = total + losses.sum().item(), tokens + mask.sum().item()
        self.model.train()
        self.evals.report(total / tokens)

    def prepare_update(self, step: int) -> None:
        side, gbs = self.job.side, self.job.data.global_batch_size
        self.grads = [p.grad for p in self.model.parameters()]
        self.grad_norm = torch.sqrt(sum((g.double() ** 2).sum() for g in self.grads)).item()
        clip(self.grads, side.clip_grad, self.grad_norm)
        self.lr = lr_at(side, step, gbs)
        for group in self.opt.param_groups:
            group["lr"] = self.lr

    def update(self, step: int) -> None:
        self.opt.step()

    def optimizer_state(self):
        return {id(p): st for p, st in self.opt.state.items()}, None

    def scalars(self, step: int) -> StepScalars:
        side, gbs = self.job.side, self.job.data.global_batch_size
        return StepScalars(
            reduced_loss=self.loss.item(), grad_norm=self.grad_norm, lr=self.lr,
            lr_logged=lr_at(side, step + 1, gbs),
            num_zeros=float(sum(int((g == 0).sum()) for g in self.grads)), skipped=0.0,
        )
