"""Ending a megatron side so that nothing of it outlives it in its process: a launch runs a
batch's sides one after another, a warm worker (:mod:`harness.backends.serve`) hundreds; what one
side leaves (a model, process groups with their gloo threads) the next ones pay for.
:func:`harness.backends.worker.destroy_job_groups` then destroys the groups the side made."""

from __future__ import annotations


def release_model(chunks: list) -> None:
    """Let a side's model be freed when the side ends. DDP's backward hooks sit on the params'
    grad accumulators (C++ autograd nodes, kept in ``grad_accs``) and their closures hold DDP, a
    path Python's collector does not fully see through: with the distributed optimizer and an
    evaluation each step the model was seen to outlive its side (DDP's only referrers were those
    closures), and with it its buffers and process groups, one more per side a process runs.
    Emptying the wrapper frees what it holds, whatever keeps the shell."""
    for chunk in chunks:
        getattr(chunk, "grad_accs", []).clear()
        vars(chunk).clear()


def drop_parallel_state_groups() -> None:
    """Set to None the process groups ``destroy_model_parallel`` leaves in parallel_state (0.19.2:
    ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP``), so that the worker can free them with the side's
    other groups (:func:`harness.backends.worker.destroy_job_groups`)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    for name, value in list(vars(ps).items()):
        held = value if isinstance(value, (list, tuple)) else [value]
        if name.isupper() and held and all(isinstance(g, dist.ProcessGroup) for g in held):
            setattr(ps, name, None)


def forget_trackers() -> None:
    """Forget the process-global loggers megatron-core sizes by the first model that logs into them
    (MTP's per-depth losses, MoE's per-layer metrics): the next side may have other counts."""
    from harness.backends.megatron import moe, mtp

    mtp.reset_tracker()
    moe.reset_metrics_tracker()
