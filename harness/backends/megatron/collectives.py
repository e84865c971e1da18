"""The Transformer Engine collectives GTP imports, on torch.distributed with gloo.

Signatures are TE's ``distributed.py``; :mod:`harness.backends.megatron.compat` installs them
in GTP's module. How their async handles complete relative to the GEMMs is a scenario's
``gtp_collectives`` (:func:`set_collectives`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


# --- the TE collectives GTP imports, on torch.distributed (signatures of TE's distributed.py) ---

# On a GPU, GTP enqueues a chain's gathers on one side stream and NCCL runs one communicator's
# collectives in issue order, so of two gathers into one buffer the later one's data stays.
# Gloo differs twice: its worker threads may run two async collectives of one group at once
# and finish them in either order (or interleave their writes), and an async reduce-scatter
# writes its output inside wait(), again at every wait(). So each GTP collective starts only
# after the previous one of its group has completed (the caller waits for that previous one,
# never for the one it issues), and the handle GTP gets completes its work once.
_IN_FLIGHT: dict[int, "_Once"] = {}


class _Once:
    """An async collective's handle whose wait() runs the underlying wait exactly once."""

    def __init__(self, work):
        self._work = work

    def finish(self) -> None:
        """Complete the collective (what the next collective of its group waits for)."""
        work, self._work = self._work, None
        if work is not None:
            work.wait()

    def wait(self):
        self.finish()
        return True


def _after_previous(group) -> None:
    previous = _IN_FLIGHT.pop(id(group), None)
    if previous is not None:
        previous.finish()


# How GTP's async collectives complete relative to the GEMMs (a scenario's ``gtp_collectives``):
# ``async``: as gloo completes them (in issue order, above). ``eager``: each completes before
# its call returns, the order of a GPU whose communication stream runs ahead of the GEMMs,
# under which a GEMM reading a gather buffer that a later prefetch reuses reads the later
# weight every time instead of when gloo's timing happens to allow it. ``lagging``: each
# collective runs into a private copy that lands in its output only when its handle, or a
# later one of its group, is waited: a communication stream running behind the GEMMs (a wait
# on a stream covers everything issued on it before), under which a read that skipped its
# wait reads the buffer's previous content every time.
_MODE = "async"
_UNLANDED: dict[int, list["_Lagging"]] = {}


def forget_in_flight() -> None:
    """Drop every group's unfinished and unlanded handles (a side's groups are gone with it)."""
    _IN_FLIGHT.clear()
    _UNLANDED.clear()


def set_collectives(mode: str) -> None:
    global _MODE
    if mode not in ("async", "eager", "lagging"):
        raise ValueError(f"unknown collectives mode {mode!r}")
    _MODE = mode
    _UNLANDED.clear()


class _Lagging(_Once):
    """A lagging collective's handle: its output is written from the private copy at a wait."""

    def __init__(self, work, group, staged: torch.Tensor, out: torch.Tensor):
        super().__init__(work)
        self._staged, self._out = staged, out
        self._queue = _UNLANDED.setdefault(id(group), [])
        self._queue.append(self)

    def wait(self):
        if any(h is self for h in self._queue):  # land every earlier one of the group, then this
            while self._queue:
                handle = self._queue.pop(0)
                handle.finish()
                handle._out.copy_(handle._staged)
                if handle is self:
                    break
        return True


def _target(out: torch.Tensor, async_op: bool) -> torch.Tensor:
    """Where the collective writes: its output, or a private copy while it lags."""
    return torch.empty_like(out) if async_op and _MODE == "lagging" else out


def _issued(group, work, target: torch.Tensor, out: torch.Tensor):
    if work is None:
        return None
    if _MODE == "eager":
        work.wait()
        return _Done()
    handle = _Lagging(work, group, target, out) if target is not out else _Once(work)
    _IN_FLIGHT[id(group)] = handle
    return handle


def gather_along_first_dim(
    inp, process_group, async_op=False, quantizer=None, output_tensor=None, external_coalescing=False
):
    """All-gather ``inp`` along dim 0 in group-rank order; returns (output, handle or None).

    ``external_coalescing`` (the caller batches several gathers) needs nothing on gloo, which
    runs the gathers one by one (see :func:`_coalescing_manager`)."""
    if quantizer is not None:
        raise NotImplementedError("quantized GTP all-gather needs Transformer Engine on a GPU")
    world = dist.get_world_size(process_group)
    shape = (inp.shape[0] * world, *inp.shape[1:])
    out = output_tensor if output_tensor is not None else inp.new_empty(shape)
    _after_previous(process_group)
    target = _target(out, async_op)
    handle = dist.all_gather_into_tensor(target, inp.contiguous(), group=process_group, async_op=async_op)
    return out, _issued(process_group, handle if async_op else None, target, out)


def reduce_scatter_along_first_dim(inp, process_group, async_op=False, output=None):
    """SUM reduce-scatter ``inp`` along dim 0; returns (output, handle or None)."""
    world = dist.get_world_size(process_group)
    shape = (inp.shape[0] // world, *inp.shape[1:])
    out = output if output is not None else inp.new_empty(shape)
    _after_previous(process_group)
    target = _target(out, async_op)
    handle = dist.reduce_scatter_tensor(
        target, inp.contiguous(), op=dist.ReduceOp.SUM, group=process_group, async_op=async_op
    )
    return out, _issued(process_group, handle if async_op else None, target, out)


class _Done:
    """A completed collective's handle."""

    def wait(self):
        return True


# --- DDP's coalesced bucket collectives (param_and_grad_buffer) ---

# Gloo writes an async all-gather's output from its worker thread whenever it finishes (an
# async reduce-scatter's only inside wait()). A read that skipped its wait, such as GTP's
# prefetch of a weight whose bucket's param all-gather is in flight, then saw the new values or
# the old ones by the machine's load. In an async block each all-gather writes into a private
# copy that lands in its output at the block handle's wait: such a read sees the old values
# every time, as under a communication stream running behind; a read after its wait, unchanged.


class _LandAtWait:
    """A coalesced block's handle whose all-gathers land in their outputs at its wait."""

    def __init__(self, cm):
        self._cm, self._staged = cm, []

    def stage(self, private: torch.Tensor, out: torch.Tensor) -> None:
        self._staged.append((private, out))

    def wait(self):
        self._cm.wait()
        for private, out in self._staged:
            out.copy_(private)
        self._staged.clear()
        return True


def coalescing_landing_at_wait(original):
    """torch's ``_coalescing_manager`` (``original``), an async block's all-gathers landing at
    its handle's wait (above); blocks on other backends, and synchronous ones, as they were."""
    from torch.distributed import distributed_c10d as c10d

    @contextlib.contextmanager
    def coalescing_manager(group=None, device=None, async_ops=False):
        with original(group=group, device=device, async_ops=async_ops) as cm:
            if not async_ops or dist.get_backend(group) != "gloo":
                yield cm
                return
            handle = _LandAtWait(cm)
            yield handle
            # The block's collectives are recorded, not yet issued: torch issues them when
            # ``original`` exits, into the outputs recorded here, which become private copies.
            for op in c10d._world.pg_coalesce_state.get(group or c10d._get_default_group(), []):
                if op.op is c10d.all_gather_single:
                    private = torch.empty_like(op.dst_tensor)
                    handle.stage(private, op.dst_tensor)
                    op.dst_tensor = private

    coalescing_manager._gtp_parity_land_at_wait = True
    return coalescing_manager
