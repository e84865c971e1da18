"""What a training step records, and in which order: the trace schema the comparison reads.

Every backend's loop runs through :func:`train`; a backend supplies only how to compute (a
:class:`StepFunctions`), never what is recorded or when. Per rank:

- step 0: the initial weights (``param``);
- each step: the weights each GEMM reads (``materialized``, :class:`Materialized`); per
  micro-batch its sample ids (``input``), activations and logits (forward hooks) and its
  ``loss``; ``main_grad`` after the gradients are final; ``param_before``; the update;
  ``param`` and the optimizer state; then the six step scalars of :data:`STEP_SCALARS`;
- after the steps a side evaluates after: the evaluation's losses (:mod:`harness.backends.evaluation`).

The heartbeat names the phase a rank is in (``forward_backward``, ``optimizer``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import astuple, dataclass, fields
from typing import Protocol, TypeVar

import torch

from harness.capture.api import Capture
from harness.common.layout import Layout

T = TypeVar("T")


@dataclass(frozen=True)
class StepScalars:
    """What a step reports, as Megatron-LM logs it."""

    reduced_loss: float
    """Token-weighted loss summed over the data group (the logged loss)."""
    grad_norm: float
    lr: float
    """The LR the optimizer applied."""
    lr_logged: float
    """The LR Megatron-LM prints after the step (its scheduler has stepped)."""
    num_zeros: float
    skipped: float
    """Steps skipped so far (loss-scale overflow)."""


STEP_SCALARS = tuple(f.name for f in fields(StepScalars))


class StepFunctions(Protocol):
    """How a backend computes one training step; :func:`train` calls these in order."""

    def begin(self, step: int) -> None:
        """Before the forward: per-step set-up (planted rank faults, materialized weights)."""

    def forward_backward(self, step: int) -> None:
        """Every micro-batch (``Capture.micro_batch``, then :meth:`Recording.loss`), then the
        final gradients (:meth:`Recording.grads`)."""

    def prepare_update(self, step: int) -> None:
        """Everything before the weights change: grad norm, clipping, the LR."""

    def update(self, step: int) -> None:
        """The optimizer step."""

    def optimizer_state(self) -> tuple[Mapping[int, dict], Mapping[str, torch.Tensor] | None]:
        """(states by id of the stepped tensor, fp32 masters by name) for :meth:`Capture.optimizer_state`."""

    def scalars(self, step: int) -> StepScalars:
        """The step's scalars (collectives here run on every rank)."""

    def evaluate(self, step: int) -> None:
        """An evaluation on the weights after ``step`` (:mod:`harness.backends.evaluation`);
        called only on sides that evaluate."""


@dataclass
class Recording:
    """One rank's trace of a training loop: the capture and the parameters it records."""

    cap: Capture
    named: list[tuple[str, torch.Tensor]]
    layouts: Mapping[str, Layout]
    param_value: Callable[[torch.Tensor], torch.Tensor] | None = None
    """The value recorded for a parameter where it is not the parameter itself (a distributed
    optimizer whose all-gather of the updated params waits for the next forward)."""

    def layout_of(self, name: str, p: torch.Tensor) -> Layout:
        return self.layouts[name]

    def weights(self, kind: str) -> None:
        self.cap.params(kind, self.named, self.layout_of, value=self.param_value or (lambda p: p))

    def grads(self, value: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
        self.cap.params("main_grad", self.named, self.layout_of, value=value)

    def loss(self, value: float, index: int, sample_ids: list[int]) -> None:
        """The token-mean loss of micro-batch ``index`` (or of one sample of it)."""
        self.cap.scalar("loss", value, micro_batch=index, sample_ids=list(sample_ids))


def train(rec: Recording, steps: int, fns: StepFunctions, start: int = 0, last: int | None = None,
          evals: Sequence[int] = ()) -> None:
    """Run optimizer steps ``start + 1 .. last`` (default: ``steps``) of ``fns``, recording each
    in the trace's order. ``start`` > 0 resumes from a loaded checkpoint of that step, whose
    weights and optimizer state are recorded as that step's. ``evals``: the steps after which
    an evaluation runs, in order (:func:`harness.backends.evaluation.eval_points`)."""
    cap = rec.cap
    if start:
        record_loaded(rec, start, fns.optimizer_state)
    else:
        record_initial(rec)
    for step in range(start + 1, (last or steps) + 1):
        cap.begin_step(step)
        fns.begin(step)
        cap.progress("forward_backward")
        fns.forward_backward(step)
        fns.prepare_update(step)
        record_update(rec, lambda: fns.update(step))
        record_step_end(rec, fns.optimizer_state, fns.scalars(step))
        for _ in range(list(evals).count(step)):
            fns.evaluate(step)


# The pieces of :func:`train`, for loops that drive themselves (Megatron-LM's ``train``): the
# backend calls them from its hooks, in the same order, so the trace is the same.


def record_initial(rec: Recording) -> None:
    """Step 0: the initial weights."""
    rec.cap.begin_step(0)
    rec.weights("param")
    rec.cap.end_step()


def record_loaded(rec: Recording, step: int, optimizer_state: Callable[[], tuple]) -> None:
    """A resumed run's first record: the weights and optimizer state it loaded, as ``step``'s."""
    rec.cap.begin_step(step)
    rec.weights("param")
    if rec.cap.wants("optimizer"):
        rec.cap.optimizer_state(rec.named, rec.layout_of, *optimizer_state())
    rec.cap.end_step()


def record_update(rec: Recording, update: Callable[[], T]) -> T:
    """The weights before and after ``update`` (the optimizer step); returns what it returns."""
    rec.weights("param_before")
    rec.cap.progress("optimizer")
    out = update()
    rec.weights("param")
    return out


def record_step_end(rec: Recording, optimizer_state: Callable[[], tuple], scalars: StepScalars) -> None:
    """The optimizer state, the step's scalars, and the end of the step."""
    if rec.cap.wants("optimizer"):
        rec.cap.optimizer_state(rec.named, rec.layout_of, *optimizer_state())
    for name, value in zip(STEP_SCALARS, astuple(scalars)):
        rec.cap.scalar(name, value)
    rec.cap.end_step()


class Materialized:
    """The weight each GEMM reads, once per step: a GTP param's all-gathered (unpadded) weight
    at its first (forward) gather, reported through :meth:`record`; where GTP is off, the
    parameters ``direct`` themselves at the start of the step. Replicated over GTP peers."""

    def __init__(self, cap: Capture, layouts: Mapping[str, Layout],
                 direct: list[tuple[str, torch.Tensor]] = ()):
        self.cap, self.layouts, self.direct = cap, layouts, list(direct)
        self.seen: set[str] = set()

    def begin_step(self) -> None:
        self.seen = set()
        for name, p in self.direct:
            self.record(name, p)

    def record(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self.seen and self.cap.wants("materialized", name):
            self.seen.add(name)
            self.cap.tensor("materialized", name, tensor, layout=self.layouts[name])

    def at_forward(self, modules: Iterable[torch.nn.Module]) -> None:
        """Record the ``direct`` parameters when their module's forward has read them, not at the
        start of the step: where the weights reach a rank during the forward (DDP's param
        all-gather overlapped with it, finished by its forward pre-hooks), a parameter at the start
        of the step holds only this rank's optimizer range updated, the rest from the step before."""
        names, self.direct = {id(p): n for n, p in self.direct}, []

        def hook_of(own):
            def hook(*_):  # returns None: the module's output stays its own
                for name, p in own:
                    self.record(name, p)
            return hook

        for module in modules:
            own = [(names[id(p)], p) for p in module.parameters(recurse=False) if id(p) in names]
            if own:
                module.register_forward_hook(hook_of(own))


def gathered(layout: Layout) -> Layout:
    """Layout of a gathered (materialized) weight: the param's TP placement only, with its TP
    stride (a gated fc1's TP-local block is ``[gate_r; up_r]`` gathered or not)."""
    strides = {"tp": layout.strides["tp"]} if "tp" in layout.strides else {}
    return Layout(layout.logical_shape, layout.mesh, {"tp": layout.placement("tp")},
                  grid=layout.grid, fixed=layout.fixed, strides=strides, vocab_padding=layout.vocab_padding)
