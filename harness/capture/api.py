"""Capture: record a rank's tensors and scalars into a trace, from any training loop.

The public API, in the order a loop uses it (:mod:`harness.backends.recording` runs it for
the built-in backends)::

    cap = Capture(trace_dir, rank=rank, world_size=world, coord={"tp": t, "gtp": g, "dp": d},
                  mesh={"tp": TP, "gtp": G, "dp": DP}, policy=CapturePolicy())
    cap.attach({"decoder.layers.0": model.decoder.layers[0]})   # activations, by forward hooks
    layout = lambda name, p: from_mcore_param(p, cap.mesh)
    cap.begin_step(0)
    cap.params("param", named_params, layout)                    # initial weights
    cap.end_step()
    for step in range(1, steps + 1):
        cap.begin_step(step)
        for mb, ids in enumerate(microbatches):
            cap.micro_batch(mb, ids)   # what the hooks capture next is tagged with these ids
            ...                        # forward / backward
        cap.params("main_grad", named_params, layout, value=lambda p: p.main_grad)
        cap.scalar("grad_norm", grad_norm)
        cap.end_step()                 # one safetensors file per rank and step
    cap.close()                        # the rank's index
    Capture.finalize(trace_dir, world_size=world, coords=coords, mesh=mesh)  # rank 0, last

Layouts are declared per tensor (:class:`harness.common.layout.Layout`) or read off megatron-core's
parameter attributes (:func:`harness.common.layout.from_mcore_param`). Activations are stored
[batch, seq, ...] so that offline assembly aligns them by global sample id.
"""

from __future__ import annotations

import atexit
import copy
import fnmatch
import platform
import queue
import sys
import threading
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch
from torch.distributed.tensor import Replicate, Shard

from harness.capture.fingerprint import fingerprint
from harness.common.layout import Layout
from harness.scenario.schema import CapturePolicy
from harness.capture.trace import (DIGEST, FORMAT, FORMAT_VERSION, Entry, content_hash, tensor_key,
                                   write_tensors)
from harness.common.jsonio import write_json

def versions() -> dict[str, str | None]:
    out = {"python": platform.python_version()}
    for dist in ("torch", "megatron-core", "transformer-engine"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    # The megatron-core this process imported may be a checkout's, not the wheel's.
    if (info := sys.modules.get("megatron.core.package_info")) is not None:
        out["megatron-core"] = str(info.__version__)
    return out


WRITE_QUEUE = 2
"""Steps whose copies may wait for the writer thread; a step beyond them waits for a write."""


class _CopyPool:
    """The step's copies, recycled once the writer is done with them: a step copies into
    buffers whose pages are already mapped (a fresh allocation of a large tensor faults in
    every page, which costs more than the copy). At most one more step's copies than the
    writer's queue holds are kept per tensor shape."""

    def __init__(self):
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def copy(self, value: torch.Tensor) -> torch.Tensor:
        with self._lock:
            free = self._free.get((value.dtype, value.device, tuple(value.shape)))
            buf = free.pop() if free else None
        return value.clone(memory_format=torch.contiguous_format) if buf is None else buf.copy_(value)

    def release(self, tensors: Iterable[torch.Tensor]) -> None:
        with self._lock:
            for t in tensors:
                free = self._free.setdefault((t.dtype, t.device, tuple(t.shape)), [])
                if len(free) <= WRITE_QUEUE:
                    free.append(t)


class _Writer:
    """One thread that runs writes in order; the first error is raised at the next submit or close."""

    def __init__(self):
        self._queue: queue.Queue = queue.Queue(maxsize=WRITE_QUEUE)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="capture-writer", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # a rank leaving without close() still writes what it recorded

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            if self._error is None:
                try:
                    job()
                except BaseException as e:  # raised in the training thread, at its next call
                    self._error = e
            self._queue.task_done()
        self._queue.task_done()

    def submit(self, job: Callable[[], None]) -> None:
        self._raise()
        self._queue.put(job)

    def close(self) -> None:
        atexit.unregister(self.close)
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error


class Capture:
    """Records one rank's part of a trace. See the module docstring for the call order."""

    def __init__(
        self,
        trace_dir: str | Path,
        *,
        rank: int,
        world_size: int,
        coord: Mapping[str, int],
        mesh: Mapping[str, int],
        policy: CapturePolicy = CapturePolicy(),
        node: int | None = None,
    ):
        self.dir = Path(trace_dir)
        self.rank, self.world_size = rank, world_size
        self.node = node
        """The node (machine) this rank runs on, named in its heartbeat (None: not recorded)."""
        self.coord, self.mesh, self.policy = dict(coord), dict(mesh), policy
        self.rank_dir = self.dir / f"rank{rank}"
        self.rank_dir.mkdir(parents=True, exist_ok=True)
        self.step: int | None = None
        self._mb: int | None = None
        self._ids: tuple[int, ...] | None = None
        self._pending: dict[str, torch.Tensor] = {}  # copies to write
        self._to_fingerprint: dict[str, torch.Tensor] = {}  # copies to fingerprint in the writer
        self._copies = _CopyPool()
        self._entries: list[Entry] = []
        self._recorded: set[tuple[int, str]] = set()
        self._scalars: list[dict] = []
        self._hooks = []
        self._writer = _Writer()
        self._flushed = 0  # entries already handed to the writer
        self.info: dict = {}
        """Free-form facts about this rank's run (e.g. GTP params and their prefetch chains)."""

    # --- what to keep ---

    def wants(self, kind: str, name: str = "", step: int | None = None) -> bool:
        step = self.step if step is None else step
        family = kind.split(":")[0]
        if family in ("exp_avg", "exp_avg_sq", "master", "step"):
            family = "optimizer"
        if family in ("param_before", "materialized"):
            family = "param"
        if family == "mtp_loss":  # an MTP depth's per-sample loss (harness.common.mtp)
            family = "loss"
        if family == "grad_terms":  # what the main_grad's bound needs (harness.backends.megatron.terms)
            family = "main_grad"
        if family not in self.policy.kinds:
            return False
        if step not in (None, 0) and self.policy.steps is not None and step not in self.policy.steps:
            return False
        return not name or any(fnmatch.fnmatchcase(name, p) for p in self.policy.tensors)

    # --- recording ---

    def begin_step(self, step: int) -> None:
        self.step = step
        self.progress("begin")

    @property
    def micro_batch_index(self) -> int | None:
        """The micro-batch being recorded (None outside one)."""
        return self._mb

    @property
    def sample_ids(self) -> tuple[int, ...] | None:
        """The global sample ids of the micro-batch being recorded (None outside one)."""
        return self._ids

    def micro_batch(self, index: int, sample_ids: Iterable[int], record: bool = True) -> None:
        """Tag what is captured next with this micro-batch and its global sample ids (and record
        them as ``input`` unless ``record`` is False: a micro-batch read again, by another model
        chunk of an interleaved pipeline)."""
        self._mb, self._ids = index, tuple(int(i) for i in sample_ids)
        if record and self.wants("input"):
            self.tensor("input", "sample_ids", torch.tensor(self._ids, dtype=torch.int64),
                        layout=None, micro_batch=index, sample_ids=self._ids)

    def tensor(
        self,
        kind: str,
        name: str,
        value: torch.Tensor,
        *,
        layout: Layout | None,
        micro_batch: int | None = None,
        sample_ids: tuple[int, ...] | None = None,
        step: int | None = None,
    ) -> None:
        step = self.step if step is None else step
        if step is None:
            raise RuntimeError("Capture.tensor outside a step: call begin_step(step) first")
        if not self.wants(kind, name, step):
            return
        value = value.detach()
        key = tensor_key(kind, name, micro_batch)
        if (step, key) in self._recorded:
            raise RuntimeError(f"{key} recorded twice at step {step}: one tensor, one record")
        self._recorded.add((step, key))
        entry = Entry(
            rank=self.rank, step=step, kind=kind, name=name, key=key, dtype=str(value.dtype),
            local_shape=tuple(value.shape), layout=layout, micro_batch=micro_batch,
            sample_ids=sample_ids,
        )
        if self.policy.mode == "fingerprint" and kind != "input":
            if self.policy.fingerprint_async:
                self._to_fingerprint[key] = self._copies.copy(value)  # the step waits for the copy only
            else:
                entry.fingerprint = fingerprint(value)
        else:
            self._pending[key] = self._copies.copy(value)  # the step waits for this copy only
        self._entries.append(entry)

    def params(
        self,
        kind: str,
        named: Iterable[tuple[str, torch.Tensor]],
        layout_of: Callable[[str, torch.Tensor], Layout],
        value: Callable[[torch.Tensor], torch.Tensor | None] = lambda p: p,
        step: int | None = None,
    ) -> None:
        """Record one tensor per parameter (the parameter itself, its main_grad, a state...)."""
        for name, p in named:
            if not self.wants(kind, name, self.step if step is None else step):
                continue
            v = value(p)
            if v is not None:
                self.tensor(kind, name, v.view(p.shape), layout=layout_of(name, p), step=step)

    def optimizer_state(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        layout_of: Callable[[str, torch.Tensor], Layout],
        states: Mapping[int, dict],
        masters: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Adam moments, or SGD momentum (as ``exp_avg``), per parameter, and its fp32 master
        where it has one, in the parameter's layout. ``states`` is keyed by ``id`` of the
        tensor the optimizer steps (the master where there is one, else the parameter)."""
        if not self.wants("optimizer"):
            return
        masters = masters or {}
        for name, p in named:
            master = masters.get(name, p)
            layout = layout_of(name, p)
            if master is not p:
                self.tensor("master", name, master.view(p.shape), layout=layout)
            state = states.get(id(master), {})
            for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
                if state.get(key) is not None:
                    kind = "exp_avg" if key == "momentum_buffer" else key
                    self.tensor(kind, name, state[key].view(p.shape), layout=layout)

    def scalar(self, name: str, value: float, **extra) -> None:
        if self.wants("scalar") or name in ("loss", "reduced_loss", "eval_loss", "eval_sample_loss"):
            self._scalars.append({"step": self.step, "name": name, "value": float(value), **extra})

    def progress(self, phase: str) -> None:
        """Heartbeat read by the launcher to name the last step a hung or crashed rank reached."""
        self.phase, beat = phase, {"rank": self.rank, "step": self.step, "phase": phase}
        write_json(self.rank_dir / "progress.json", beat if self.node is None else beat | {"node": self.node})

    def end_step(self) -> None:
        """Hand the step's copies to the writer thread: it fingerprints or hashes them, writes
        the step's file, then the index up to this step (a rank that dies later leaves a
        readable, incomplete trace). At most :data:`WRITE_QUEUE` steps wait, bounding the
        copies held in memory."""
        pending, to_fingerprint, entries = self._pending, self._to_fingerprint, self._entries[self._flushed:]
        self._flushed = len(self._entries)
        path = self.rank_dir / f"step{self.step}.safetensors"
        index = self._index_doc(len(self._entries))

        def write() -> None:
            for e in entries:
                if e.key in to_fingerprint:
                    e.fingerprint = fingerprint(to_fingerprint[e.key])
                elif e.key in pending:
                    e.digest, e.digest_alg = content_hash(pending[e.key]), DIGEST
            if pending:
                write_tensors(path, pending)
            write_json(self.rank_dir / "index.json", index())
            self._copies.release([*pending.values(), *to_fingerprint.values()])

        self._writer.submit(write)
        self._pending, self._to_fingerprint = {}, {}
        self._mb = self._ids = None
        self.progress("end")

    # --- activations through forward hooks ---

    def attach(self, modules: Mapping[str, torch.nn.Module], *, vocab_parallel: Iterable[str] = (),
               sequence_parallel: bool = False) -> None:
        """Capture each module's output, [s, b, ...] stored as [b, s, ...].

        Outputs of modules named in ``vocab_parallel`` are TP-sharded on their last dim
        (the logits); the others are replicated across TP, or, under ``sequence_parallel``,
        TP-sharded along the sequence.
        """
        vocab_parallel = set(vocab_parallel)
        for name, module in modules.items():
            kind = "logits" if name in vocab_parallel else "activation"
            self._hooks.append(module.register_forward_hook(self._hook(kind, name, sequence_parallel)))

    def _hook(self, kind: str, name: str, sequence_parallel: bool = False):
        return lambda module, args, output: self.output(kind, name, output, sequence_parallel)

    def output(self, kind: str, name: str, output, sequence_parallel: bool = False) -> None:
        """Record a module's output ``[s, b, ...]`` (a tuple's first, plus the bias megatron-core's attention
        and MLP return beside it) as ``name``, as :meth:`attach`'s hooks do, or a hook naming each call."""
        if (self.step is None or self._mb is None or not self.wants(kind, name)
                or torch._C._current_graph_task_id() != -1):  # a recompute in backward: recorded at forward
            return
        out, rest = (output[0], output[1:]) if isinstance(output, tuple) else (output, ())
        if len(rest) == 1 and torch.is_tensor(rest[0]) and rest[0].shape == out.shape[-1:]:
            out = out + rest[0]  # the bias added later: not a layer's (output, context)
        value = out.detach().transpose(0, 1)
        shape, placements = list(value.shape), {}
        if kind == "logits" and self.mesh.get("tp", 1) > 1:
            placements["tp"] = Shard(value.dim() - 1)
            shape[-1] *= self.mesh["tp"]
        elif sequence_parallel and self.mesh.get("tp", 1) > 1:
            placements["tp"] = Shard(1)  # [b, s/TP, ...]
            shape[1] *= self.mesh["tp"]
        layout = Layout(tuple(shape), {"tp": self.mesh.get("tp", 1)}, placements or {"tp": Replicate()})
        self.tensor(kind, name, value, layout=layout, micro_batch=self._mb, sample_ids=self._ids)

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # --- closing ---

    def close(self) -> None:
        self.detach()
        self._writer.close()
        write_json(self.rank_dir / "index.json", self._index_doc(len(self._entries))())

    def _index_doc(self, n_entries: int) -> Callable[[], dict]:
        """The index as of now (its first ``n_entries`` entries), serialized when called: by
        then the writer has set their content hashes."""
        # Copies: the training thread goes on recording while the writer serializes them.
        entries, scalars, info = self._entries[:n_entries], list(self._scalars), copy.deepcopy(self.info)
        return lambda: {"rank": self.rank, "tensors": [e.to_json() for e in entries], "scalars": scalars,
                        "info": info}

    @staticmethod
    def finalize(
        trace_dir: str | Path,
        *,
        world_size: int,
        coords: Mapping[int, Mapping[str, int]],
        mesh: Mapping[str, int],
        meta: Mapping | None = None,
        complete: bool = True,
    ) -> None:
        """Write the manifest (rank 0, after every rank closed): the trace is then complete."""
        write_json(
            Path(trace_dir) / "manifest.json",
            {
                "format": FORMAT,
                "version": FORMAT_VERSION,
                "complete": complete,
                "world_size": world_size,
                "mesh": dict(mesh),
                "coords": {str(r): dict(c) for r, c in coords.items()},
                "versions": versions(),
                **(meta or {}),
            },
        )
