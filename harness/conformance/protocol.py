"""The DistributedWeight protocol as callers see it, and a recorder of the collectives it issues.

A *distributed weight* is a ``torch.Tensor`` subclass with ``is_distributed_weight = True`` and
four methods: ``materialize_group_for_forward()``, ``materialize_group_for_backward()``,
``finalize_group_grads(wgrads)`` and ``grad_buffer()``. Callers never call the first three
directly but go through list-shaped dispatchers: a bare weight counts as a list of one, the first
weight of a list (the leader) makes one call for the whole group, results always come back as
lists, and plain tensors pass through untouched. ``grad_buffer()`` has no dispatcher: TE's
modules call each member's own (as ``main_grad_func``).

The kit drives Transformer Engine's own dispatchers: :func:`te_dispatch` loads the pinned
release's ``distributed_weight.py`` (:mod:`harness.conformance.te_source`) on its own. Where
that file is not available :data:`KIT_DISPATCH` stands in, a mirror of it that follows TE's
code (:data:`harness.conformance.te_contract.DISAGREEMENTS` lists what it corrected);
:func:`select_dispatch` picks one and says why.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from harness.conformance import te_source


@runtime_checkable
class DistributedWeight(Protocol):
    """The kit's mirror of TE's runtime-checkable protocol: the marker and the four methods."""

    is_distributed_weight: bool

    def materialize_group_for_forward(self) -> Any: ...

    def materialize_group_for_backward(self) -> Any: ...

    def finalize_group_grads(self, wgrads: Any) -> Any: ...

    def grad_buffer(self) -> torch.Tensor: ...


def is_distributed_weight(weight: Any) -> bool:
    """True for a protocol implementer; a marker on a non-tensor is an error, as in TE."""
    flag = bool(getattr(weight, "is_distributed_weight", False))
    if flag and not isinstance(weight, torch.Tensor):
        raise TypeError(f"a DistributedWeight must be a torch.Tensor subclass, got {type(weight)}")
    return flag


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def materialize_for_forward(weights: Any) -> list:
    """Tensors for the forward GEMMs: one leader call for the group, or the weights themselves.

    ``weights`` is a bare weight (Linear) or the group's list (GroupedLinear), as in TE.
    """
    weights = _as_list(weights)
    if is_distributed_weight(weights[0]):
        return _as_list(weights[0].materialize_group_for_forward())
    return weights


def materialize_for_backward(weights: Any) -> list:
    """Tensors for the backward (dgrad) GEMMs, with the forward dispatcher's contract."""
    weights = _as_list(weights)
    if is_distributed_weight(weights[0]):
        return _as_list(weights[0].materialize_group_for_backward())
    return weights


def grad_buffers(weights: Any, shape: tuple[int, ...]) -> list:
    """Where the wgrad GEMMs write: each member's ``grad_buffer()``, or fresh scratch.

    TE has no dispatcher for this: its modules call each member's ``grad_buffer`` themselves
    (``main_grad_func``), and so does the kit, whichever dispatchers it drives. ``shape`` is
    the logical (TP-local) weight shape; a buffer of another shape is a clause failure.
    """
    weights = _as_list(weights)
    if is_distributed_weight(weights[0]):
        return [w.grad_buffer() for w in weights]
    return [torch.empty(shape, dtype=w.dtype, device=w.device) for w in weights]


def finalize(weights: Any, wgrads: list) -> list:
    """Hand the group's wgrads to the leader (a bare tensor for a group of one, as TE does)."""
    weights = _as_list(weights)
    if is_distributed_weight(weights[0]):
        out = weights[0].finalize_group_grads(wgrads if len(wgrads) > 1 else wgrads[0])
        return _as_list(out)
    return list(wgrads)


@dataclass(frozen=True, slots=True)
class Dispatch:
    """The caller-side entry points the kit drives the protocol through."""

    name: str
    """Whose dispatchers: "te" (TE's file) or "kit" (the mirror); shown in results."""
    is_distributed_weight: Callable[[Any], bool]
    materialize_for_forward: Callable[[Any], list]
    materialize_for_backward: Callable[[Any], list]
    grad_buffers: Callable[[Any, tuple[int, ...]], list]
    finalize: Callable[[Any, list], list]
    source: str = ""
    """What was driven, for reports: ``TE 2.20.2 distributed_weight.py <sha256>`` or the mirror."""
    note: str = ""
    """Why the mirror stands in for TE's file (empty when TE's file is driven)."""
    protocol: Any = DistributedWeight
    """The runtime-checkable ``DistributedWeight`` protocol (TE's own, from TE's file)."""


KIT_DISPATCH = Dispatch(
    name="kit",
    is_distributed_weight=is_distributed_weight,
    materialize_for_forward=materialize_for_forward,
    materialize_for_backward=materialize_for_backward,
    grad_buffers=grad_buffers,
    finalize=finalize,
    source=f"the kit's own mirror of TE {te_source.TE_VERSION}'s dispatchers",
)


def te_dispatch() -> Dispatch:
    """TE's own dispatchers from the pinned, hash-checked file; raises te_source.SourceError."""
    te_dw, source = te_source.load()
    return Dispatch(
        name="te",
        is_distributed_weight=te_dw.is_distributed_weight,
        materialize_for_forward=te_dw.materialize_weight_for_forward,
        materialize_for_backward=te_dw.materialize_weight_for_backward,
        grad_buffers=grad_buffers,  # no TE dispatcher: the modules call grad_buffer() directly
        finalize=te_dw.finalize_weight_grads,
        source=source.label,
        protocol=te_dw.DistributedWeight,
    )


DISPATCH_CHOICES = ("auto", "te", "kit")
"""``auto``: TE's file when it is cached, else the mirror with the reason; ``te``: TE's file or
an error; ``kit``: the mirror."""


def select_dispatch(choice: str = "auto") -> Dispatch:
    """The dispatchers to drive. ``auto`` falls back to the mirror only when TE's file is
    absent (a refused, corrupted file raises :class:`~harness.conformance.te_source.Refused`)."""
    if choice not in DISPATCH_CHOICES:
        raise ValueError(f"dispatch {choice!r}: expected one of {DISPATCH_CHOICES}")
    if choice == "kit":
        return KIT_DISPATCH
    try:
        return te_dispatch()
    except te_source.Unavailable as exc:
        if choice == "te":
            raise
        note = f"TE's file is not available ({exc}); the kit ran on its own mirror"
        return replace(KIT_DISPATCH, note=note)


# --- collective recorder ----------------------------------------------------------------------

_COLLECTIVES = (
    "all_gather_into_tensor",
    "all_gather",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "all_reduce",
    "broadcast",
    "reduce",
    "all_to_all_single",
    "all_to_all",
)


class _TrackedWork:
    """Wraps an async work handle so the recorder knows whether anyone waited on it yet."""

    def __init__(self, work):
        self._work = work
        self.waited = False

    def wait(self, *args, **kwargs):
        self.waited = True
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


@dataclass
class CallLog:
    """Collectives issued while one protocol call ran."""

    label: str
    rounds: int = 0
    """Collective calls, a coalesced block counting once."""
    pending: list[tuple[_TrackedWork, list[torch.Tensor]]] = field(default_factory=list)
    """Async collectives with the tensors they write into."""

    def inflight_outputs(self) -> list[torch.Tensor]:
        """Outputs of async collectives issued in this call that nobody has waited on yet."""
        return [t for work, outs in self.pending if not work.waited for t in outs]


def _outputs(name: str, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    first = (
        args[0]
        if args
        else next(
            (
                kwargs[k]
                for k in ("output_tensor", "output", "tensor", "tensor_list")
                if k in kwargs
            ),
            None,
        )
    )
    return [t for t in _as_list(first) if isinstance(t, torch.Tensor)]


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when two tensors share any byte of memory."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def extent(t: torch.Tensor) -> tuple[int, int]:
        start = t.storage_offset()
        last = start + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        return start * t.element_size(), (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = extent(a), extent(b)
    return a0 < b1 and b0 < a1


class CollectiveRecorder:
    """Counts torch.distributed collectives per protocol call while installed.

    Use as ``with CollectiveRecorder() as rec: with rec.call("forward") as log: ...``.
    Collectives issued outside any ``call`` are logged under the label "outside".
    """

    def __init__(self):
        self.logs: list[CallLog] = []
        self._current: CallLog | None = None
        self._blocks: list[list[torch.Tensor]] = []  # outputs of each open coalescing block
        self._saved: dict[str, Callable] = {}

    def __enter__(self) -> "CollectiveRecorder":
        for name in (*_COLLECTIVES, "_coalescing_manager"):
            original = getattr(dist, name)
            self._saved[name] = original
            wrap = self._wrap_coalescing if name == "_coalescing_manager" else self._wrap
            setattr(dist, name, wrap(name, original))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)
        self._saved.clear()

    @contextlib.contextmanager
    def call(self, label: str):
        """Attribute collectives issued inside the block to a new :class:`CallLog`."""
        log = CallLog(label)
        outer, self._current = self._current, log
        try:
            yield log
        finally:
            self._current = outer
            self.logs.append(log)

    def _log(self) -> CallLog:
        if self._current is None:
            self._current = CallLog("outside")
            self.logs.append(self._current)
        return self._current

    def _wrap(self, name: str, original: Callable) -> Callable:
        @functools.wraps(original)
        def recorded(*args, **kwargs):
            log = self._log()
            if self._blocks:
                self._blocks[-1].extend(_outputs(name, args, kwargs))
            else:
                log.rounds += 1
            work = original(*args, **kwargs)
            if kwargs.get("async_op") and work is not None:
                work = _TrackedWork(work)
                log.pending.append((work, _outputs(name, args, kwargs)))
            return work

        return recorded

    def _wrap_coalescing(self, name: str, original: Callable) -> Callable:
        @contextlib.contextmanager
        @functools.wraps(original)
        def recorded(*args, **kwargs):
            log = self._log()
            log.rounds += 1
            self._blocks.append([])
            try:
                with original(*args, **kwargs) as manager:
                    if not kwargs.get("async_ops"):
                        yield manager
                        return
                    # The caller waits on the yielded manager after the block: track that wait.
                    tracked = _TrackedWork(manager)
                    yield tracked
            finally:
                outputs = self._blocks.pop()
            log.pending.append((tracked, outputs))

        return recorded
