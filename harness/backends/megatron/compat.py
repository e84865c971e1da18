"""Run megatron-core's own GTP code on CPU with gloo.

megatron-core's GTP path assumes CUDA and Transformer Engine for *plumbing*: streams and
events to overlap collectives, CUDA RNG state, device placement, and a few TE collective
wrappers (all-gather / reduce-scatter along dim 0) that GTP imports. None of these carries
GTP's math (sharding, padding, 1/G pre-scale, reduction order, optimizer). This module swaps
exactly that plumbing for CPU equivalents so the real GTPShardedParam, DDP,
finalize_model_grads and optimizer run unchanged.

Active only when CUDA is unavailable. Every replacement below was read against the source of
the versions in :data:`READ_AGAINST`, and each is applied only where the thing it replaces
exists (:func:`_replace`): on a tree of another version the layer runs with one warning that
names the version and whatever it could not find, instead of accepting the tree silently.
:func:`applied` lists the stand-ins in force, for the trace manifest.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch
import torch.distributed as dist

from harness.backends.megatron import collectives
from harness.backends.megatron.collectives import (  # noqa: F401 (the collectives' names, as compat's)
    _Done, gather_along_first_dim, reduce_scatter_along_first_dim, set_collectives,
)

READ_AGAINST = {
    "0.19.2": "the pinned megatron-core wheel",
    "0.20.0": "Megatron-LM main as of 2026-08-22 (d98e8a64dd)",
}
SUPPORTED_MCORE = "0.19.2"

_installed = False
_applied: list[str] = []
_missing: list[str] = []


# --- streams and events: CPU executes in program order, so ordering primitives are no-ops ---


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _Stream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event or _Event()

    def synchronize(self):
        pass


_CURRENT_STREAM = _Stream()


def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
    """MoE token dispatchers move their split sizes device-to-host (``moe_utils``): on a GPU the
    copy also turns them into numpy arrays, which ``all_to_all_single`` takes as sizes. A CPU
    tensor is already on the host; only the numpy conversion is kept."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


_DUMMY_WGRADS: dict[tuple, torch.Tensor] = {}


def get_dummy_wgrad(shape, dtype, zero=False):
    """TE's placeholder grad for params whose real grad went to main_grad: one buffer per shape
    and dtype, reused by every caller, allocated with ``torch.empty`` and zeroed only on request
    (``transformer_engine.pytorch.module.base.get_dummy_wgrad``). Its content is what the buffer
    last held; a fresh one's is undefined, which the worker's deterministic mode fills with NaN
    (``torch.utils.deterministic.fill_uninitialized_memory``): a sum that reads it shows."""
    key = (*shape, dtype)
    if key not in _DUMMY_WGRADS:
        _DUMMY_WGRADS[key] = torch.empty(shape, dtype=dtype)
    if zero:
        _DUMMY_WGRADS[key].fill_(0)
    return _DUMMY_WGRADS[key].detach()


def no_inference_linear(module) -> bool:
    """Megatron-LM main's ``is_inference_column_parallel_linear``: its inference-optimized linears
    are Transformer Engine subclasses (their constructors assert TE), so without TE no module is
    one; the original's ``isinstance`` against TE's placeholders raises instead."""
    return False


def not_in_recompute_phase():
    """TE's ``in_fp8_activation_recompute_phase()`` outside ``te_checkpoint``'s recompute: no
    CPU run enters TE's recompute phase (megatron-core's own checkpoint never does)."""
    return False


def round_up_to_nearest_multiple(value, multiple):
    return ((value + multiple - 1) // multiple) * multiple


class _NoQuantizedTensor:
    """Stands in for TE's quantized tensor classes: no CPU tensor is ever an instance."""


def _wrap_coalescing(original):
    # Gloo has no coalesced collectives: run the calls inside the block one by one (each is
    # already complete when it returns) and hand back a handle that is already done.
    @contextlib.contextmanager
    def coalescing_manager(group=None, device=None, async_ops=False):
        if dist.get_backend(group) != "gloo":
            with original(group=group, device=device, async_ops=async_ops) as cm:
                yield cm
            return
        yield _Done()

    coalescing_manager._gtp_parity_coalescing = True
    return coalescing_manager


# --- ReduceOp.AVG exists only on NCCL: gloo gets SUM followed by a divide ---


def _wrap_avg(collective):
    @functools.wraps(collective)
    def wrapper(tensor, *args, op=dist.ReduceOp.SUM, group=None, async_op=False, **kwargs):
        if op != dist.ReduceOp.AVG or dist.get_backend(group) != "gloo":
            return collective(tensor, *args, op=op, group=group, async_op=async_op, **kwargs)
        work = collective(tensor, *args, op=dist.ReduceOp.SUM, group=group, async_op=False, **kwargs)
        target = args[0] if collective.__name__ == "reduce_scatter_tensor" else tensor
        target.div_(dist.get_world_size(group))
        return work if async_op else None

    wrapper._gtp_parity_avg = True
    return wrapper


# --- factory calls with device='cuda' (optimizer flags, loss scale) land on the CPU ---


class _CudaToCpu(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def _type_names_as_cuda(original):
    # clip_grads and the mixed-precision optimizer dispatch on CUDA type *names*; answer the
    # CUDA name for CPU tensors so those branches run. Casting calls (with arguments) pass through.
    @functools.wraps(original)
    def tensor_type(self, *args, **kwargs):
        if args or kwargs:
            return original(self, *args, **kwargs)
        return _CUDA_TYPE_NAMES.get(self.dtype) or original(self)

    return tensor_type


def tree_version() -> str:
    """The version of the megatron-core this process imports, from its own package_info."""
    from megatron.core import package_info

    return str(package_info.__version__)


def check_version() -> str:
    """The imported tree's version; one warning when the layer was not read against it."""
    found = tree_version()
    if found not in READ_AGAINST:
        warnings.warn(f"the CPU compatibility layer was read against megatron-core {sorted(READ_AGAINST)}, "
                      f"this tree is {found}: each stand-in is applied only where what it replaces exists"
                      + (f"; not found: {', '.join(_missing)}" if _missing else ""), stacklevel=2)
    return found


def _install_gloo_collectives() -> None:
    """torch.distributed's coalescing and AVG on gloo (above), and DDP's bucket collectives."""
    if not getattr(dist._coalescing_manager, "_gtp_parity_coalescing", False):
        dist._coalescing_manager = _wrap_coalescing(dist._coalescing_manager)
    for name in ("all_reduce", "reduce_scatter_tensor"):
        fn = getattr(dist, name)
        if not getattr(fn, "_gtp_parity_avg", False):
            setattr(dist, name, _wrap_avg(fn))

    from megatron.core.distributed import param_and_grad_buffer as buffers

    # DDP's buckets coalesce through torch's own manager (gloo runs it); their async all-gathers
    # land at the wait (collectives.coalescing_landing_at_wait says why).
    if not getattr(buffers._coalescing_manager, "_gtp_parity_land_at_wait", False):
        _replace(buffers, "_coalescing_manager",
                 collectives.coalescing_landing_at_wait(dist.distributed_c10d._coalescing_manager))


def _replace(holder, attr: str, value, name: str | None = None) -> None:
    """Replace ``holder.attr`` by ``value`` where the attribute exists, recording the stand-in;
    a missing one is recorded as not found (the warning of :func:`check_version` names it)."""
    label = name or f"{getattr(holder, '__name__', type(holder).__name__)}.{attr}"
    if not hasattr(holder, attr):
        _missing.append(label)
        return
    setattr(holder, attr, value)
    _applied.append(label)


def record_stand_in(label: str) -> None:
    """Record a stand-in applied outside :func:`_replace` (the manifest lists it)."""
    _applied.append(label)


def applied() -> dict:
    """The stand-ins in force and those not found, with the tree's version (empty when the
    layer is not installed: CUDA is there)."""
    if not _installed:
        return {}
    return {"version": tree_version(), "read_against": sorted(READ_AGAINST), "applied": sorted(set(_applied)),
            "not_found": sorted(set(_missing))}


def install() -> bool:
    """Install the CPU replacements. Returns False (and changes nothing) when CUDA is usable.

    Idempotent. Must run before megatron-core builds a model.
    """
    global _installed
    if torch.cuda.is_available():
        return False
    if _installed:
        return True
    cuda = torch.cuda
    for attr, value in (
        ("current_device", lambda: "cpu"), ("Event", _Event), ("Stream", _Stream),
        ("current_stream", lambda device=None: _CURRENT_STREAM),
            ("stream", lambda stream=None: contextlib.nullcontext()),
        ("synchronize", lambda device=None: None), ("empty_cache", lambda: None),
        ("get_rng_state", lambda device="cuda": torch.get_rng_state()),
        ("set_rng_state", lambda state, device="cuda": torch.set_rng_state(state)),
        # torch.manual_seed itself calls cuda.manual_seed_all: seed the CPU generator directly.
        ("manual_seed", lambda seed: torch.default_generator.manual_seed(int(seed))),
        ("manual_seed_all", lambda seed: None),
        # finalize_model_grads asks before its graph-safe paths (main); no CPU stream captures.
        ("is_current_stream_capturing", lambda: False),
    ):
        _replace(cuda, attr, value, f"torch.cuda.{attr}")
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.Tensor.type = _type_names_as_cuda(torch.Tensor.type)
    _install_gloo_collectives()

    from megatron.core.tensor_parallel import random as mrandom

    _replace(mrandom, "_get_cuda_rng_state",
             lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state())
    _replace(mrandom, "_set_cuda_rng_state", lambda new_state, device=-1,
             graph_safe=False: torch.set_rng_state(new_state))

    from megatron.core.tensor_parallel import generalized_tensor_parallelism as gtp
    from megatron.core.tensor_parallel import gtp_api

    for attr, value in (
        ("gather_along_first_dim", gather_along_first_dim),
            ("reduce_scatter_along_first_dim", reduce_scatter_along_first_dim),
        ("in_fp8_activation_recompute_phase", not_in_recompute_phase),
        # main binds TE's function once more at import, under the name its call sites use
        # (a MagicMock without TE: always truthy, every gather taken as a recompute's).
        ("in_activation_recompute_phase", not_in_recompute_phase), ("get_dummy_wgrad", get_dummy_wgrad),
        ("round_up_to_nearest_multiple", round_up_to_nearest_multiple),
        ("nvtx_range_push", lambda *a, **k: None), ("nvtx_range_pop", lambda *a, **k: None),
        ("QuantizedTensor", _NoQuantizedTensor), ("MXFP8TensorStorage", _NoQuantizedTensor),
        ("NVFP4TensorStorage", _NoQuantizedTensor), ("MXFP8Quantizer", _NoQuantizedTensor),
        ("_NVFP4AllGatherAsyncHandle", _NoQuantizedTensor), ("HAVE_TE", True),
    ):
        _replace(gtp, attr, value, f"gtp.{attr}")
    _replace(gtp_api, "HAVE_GTP", True, "gtp_api.HAVE_GTP")

    from megatron.core.transformer import multi_token_prediction as mtp

    if hasattr(mtp, "is_inference_column_parallel_linear"):  # main (d98e8a64dd); not in 0.19.2
        _replace(mtp, "is_inference_column_parallel_linear", no_inference_linear,
                 "multi_token_prediction.is_inference_column_parallel_linear")

    from megatron.core.transformer.moe import token_dispatcher

    # The dispatcher imported the helper by name: its CPU tensors never became numpy split sizes.
    _replace(token_dispatcher, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu,
             "token_dispatcher.maybe_move_tensor_to_cpu")
    check_version()

    _CudaToCpu().__enter__()
    _installed = True
    return True


def reset_gtp_state() -> None:
    """Clear GTP's process-global state so the next model in this process starts fresh.

    ``reset_gtp_state`` clears the prefetch chains; the buffer cache, the registry of GTP
    params, in-flight handles and the wgrad pool are module globals that survive
    ``destroy_model_parallel`` too and would hand a new model the previous model's buffers.
    """
    from megatron.core.tensor_parallel import generalized_tensor_parallelism as gtp

    gtp.reset_gtp_state()
    gtp._GTP_CACHE = None
    gtp._GTP_PARAMS.clear()
    gtp._inflight_comm_params.clear()
    gtp._AG_STREAMS.clear()
    gtp._RS_STREAMS.clear()
    gtp._wgrad_buf_pool.clear()
    _DUMMY_WGRADS.clear()  # TE's placeholder buffers: a process-global cache too
    gtp.GTP_CONFIG.__init__()
    collectives.forget_in_flight()


def layer_norm_for_sequence_parallel() -> None:
    """Let the local spec's torch LayerNorm run under sequence parallelism (until the side's
    patches are undone). megatron-core's ``WrappedTorchNorm`` refuses SP only because TE's
    norm is the one that tags its params; LayerNorm is per token, so it is built from a config
    copy with SP off and its params are tagged ``sequence_parallel``, after which
    ``finalize_model_grads`` all-reduces their grads over TP as it does for TE's LayerNorm."""
    import copy

    from megatron.core.transformer import torch_norm

    from harness.backends.patching import patch

    original = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, **kw):
        if not config.sequence_parallel:
            return original(cls, config, hidden_size, eps, **kw)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = original(cls, plain, hidden_size, eps, **kw)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm

    patch(torch_norm.WrappedTorchNorm, "__new__", staticmethod(new))


def in_process_checkpoint_writes() -> None:
    """Let ``dist_checkpointing.save`` write in this process without a manager process.

    megatron-core's synchronous ``torch_dist`` save still runs its async writer
    (``FileSystemWriterAsync``), whose results queue is a ``multiprocessing`` manager queue
    created with the ``spawn`` context (``filesystem_async.get_write_results_queue``): a new
    Python process per rank, re-importing the caller's main module. A synchronous save
    writes and reads that queue in this process only, so a thread-safe in-process queue
    carries the same results. Its writer also logs the process's memory through psutil
    (``_process_memory``, debug log only), which this environment does not ship: the
    standard library's peak RSS stands in."""
    import queue
    import resource

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    if not filesystem_async.HAVE_PSUTIL:
        filesystem_async._process_memory = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
