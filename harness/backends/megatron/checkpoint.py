"""Checkpoint topology: megatron-core's distributed checkpointing (``torch_dist``) on a side.

A source side trains to step k and saves its model and optimizer as Megatron-LM does:
``dist_checkpointing.save`` of the model's ``sharded_state_dict`` (GTP weights through
``make_sharded_tensors_for_checkpoint_with_gtp_remat``) and the optimizer's, built on it,
plus the LR scheduler's state. A resumed side builds another topology, loads that checkpoint
with ``dist_checkpointing.load``, records the loaded weights and optimizer state as step k
and trains on to the last step.

Loading a ``torch_dist`` checkpoint unpickles twice: torch's ``FileSystemReader.read_metadata``
(``pickle.load`` of ``.metadata``, torch/distributed/checkpoint/filesystem.py) and
``DefaultLoadPlanner.load_bytes`` (``torch.load(weights_only=False)`` of every byte item,
default_planner.py), which carries the common state (param groups, the scheduler) as
megatron-core's ``common_state`` object. While this module loads, both read through
allow-lists instead (:func:`allow_listed_reads`): the metadata's classes are torch's
checkpoint-metadata dataclasses, and byte items are ``torch.load(weights_only=True)``. A
pickle naming anything else is refused before any of it runs. A legacy ``common.pt`` (plain
``torch.load`` in megatron-core) is refused outright.
"""

from __future__ import annotations

import contextlib
import io
import pickle
from pathlib import Path

import torch
import torch.distributed as dist

from harness.backends import faults

# What Megatron-LM passes to sharded_state_dict: the distributed optimizer's format that
# reshards across data-parallel sizes (per-parameter tensors in model space), and layer-stacked
# (not per-layer singleton) shards.
METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True}

# The only globals a torch_dist ``.metadata`` pickle may name: torch's checkpoint-metadata
# dataclasses and enums (megatron-core keeps the save plans in it too), sizes, dtypes, layouts.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", n) for n in
    ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
     "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.planner", n) for n in
    ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "LoadItemType")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"),
    ("torch", "Size"), ("collections", "OrderedDict"),
    *(("torch", str(d).removeprefix("torch.")) for d in
      (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8,
       torch.bool)),
}


class UnsafePickle(pickle.UnpicklingError):
    """A checkpoint's pickle names a global outside the allow-list."""


class _AllowList(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _METADATA_GLOBALS:
            raise UnsafePickle(f"checkpoint metadata names {module}.{name}, which is not checkpoint metadata")
        return super().find_class(module, name)


def read_metadata(path: str | Path):
    """A ``torch_dist`` checkpoint's ``.metadata``, read through the allow-list."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    with open(path, "rb") as f:
        metadata = _AllowList(f).load()
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


@contextlib.contextmanager
def allow_listed_reads():
    """While loading: torch's metadata reader and byte-item loader read through allow-lists."""
    from torch.distributed.checkpoint import default_planner, filesystem

    def metadata(self, *args, **kwargs):
        out = read_metadata(self._get_metadata_path(kwargs.get("rank")))
        out.storage_meta.load_id = self.load_id
        return out

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            default_planner.set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn],
                                        loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded

    old = filesystem.FileSystemReader.read_metadata, default_planner.DefaultLoadPlanner.load_bytes
    filesystem.FileSystemReader.read_metadata = metadata
    default_planner.DefaultLoadPlanner.load_bytes = load_bytes
    try:
        yield
    finally:
        filesystem.FileSystemReader.read_metadata, default_planner.DefaultLoadPlanner.load_bytes = old


def _model(ddp):
    """The GPTModel (or its Float16Module) under megatron-core's DDP wrapper."""
    return ddp.module


def sharded_state(ddp, opt, is_loading: bool) -> dict:
    """The model's and the optimizer's sharded state dicts, as Megatron-LM builds them."""
    # A fresh copy each time: megatron-core stores this side's process groups in it (dp_cp_group).
    model = _model(ddp).sharded_state_dict(metadata=dict(METADATA))
    return {"model": model,
            "optimizer": opt.sharded_state_dict(model, is_loading=is_loading, metadata=dict(METADATA))}


def save(ddp, opt, scheduler, directory: str | Path, ctx=None) -> None:
    """Save a ``torch_dist`` checkpoint of the model, the optimizer and the LR scheduler
    (``ctx``: the side's planted faults, which may alter what is saved)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from harness.backends.megatron import compat

    compat.in_process_checkpoint_writes()
    directory = Path(directory)
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = sharded_state(ddp, opt, is_loading=False)
    state["opt_param_scheduler"] = scheduler.state_dict()
    if ctx is not None:
        faults.checkpoint_state(ctx, state)
    dist_checkpointing.save(state, str(directory),
                            sharded_strategy=TorchDistSaveShardedStrategy("torch_dist", 1))
    dist.barrier()


def _states_to_load_into(opt) -> None:
    """Give a fresh DistributedOptimizer the states a checkpoint is loaded into.

    Without Apex or Transformer Engine, megatron-core 0.19.2's ``DistributedOptimizer.state_dict``
    (optimizer/distrib_optimizer.py l.837-839) asserts that every state of its torch Adam holds
    one common ``step``, which a freshly built optimizer, whose state is empty, does not: its
    ``sharded_state_dict(is_loading=True)`` fails before anything is read. megatron-core's own
    remedy, used on its ``fsdp_dtensor`` load path (``_init_optimizer_states_with_dummy_values``,
    l.1422), steps the inner optimizer once on zero gradients; every value it writes is then
    overwritten by the load, which the load step's bitwise check confirms."""
    from megatron.core.optimizer import distrib_optimizer

    for part in getattr(opt, "chained_optimizers", None) or [opt]:
        if (isinstance(part, distrib_optimizer.DistributedOptimizer) and not distrib_optimizer.HAVE_APEX_OR_TE
                and not part.optimizer.state):
            part._init_optimizer_states_with_dummy_values()


def refuse_legacy_common(directory: str | Path) -> None:
    """A legacy checkpoint keeps its common state in ``common.pt``, which megatron-core reads
    with a plain ``torch.load`` (dist_checkpointing/strategies/common.py l.48, no
    ``weights_only``): such a checkpoint is refused rather than unpickled."""
    if (Path(directory) / "common.pt").exists():
        raise UnsafePickle(f"{directory}/common.pt: a legacy common state megatron-core would unpickle "
                           f"unchecked")


def load(ddp, opt, scheduler, directory: str | Path) -> None:
    """Load a ``torch_dist`` checkpoint into this side's model, optimizer and LR scheduler."""
    from megatron.core import dist_checkpointing

    refuse_legacy_common(directory)
    _states_to_load_into(opt)
    state = sharded_state(ddp, opt, is_loading=True)
    state["opt_param_scheduler"] = scheduler.state_dict()
    with allow_listed_reads():
        loaded = dist_checkpointing.load(state, str(directory))
    _model(ddp).load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(loaded["opt_param_scheduler"])


def train(job, rec, fns, ddp, opt, scheduler, ctx=None) -> None:
    """The side's steps around its checkpoint: resume from one, save one, or neither."""
    from harness.backends.evaluation import eval_points
    from harness.backends.recording import train as run_steps

    side = job.side
    if side.load_step:
        rec.cap.progress("load")
        load(ddp, opt, scheduler, job.checkpoint_dir)
        run_steps(rec, side.steps, fns, start=side.load_step)
    elif side.save_step:
        run_steps(rec, side.steps, fns, last=side.save_step)
        rec.cap.progress("save")
        save(ddp, opt, scheduler, job.checkpoint_dir, ctx)
    else:
        run_steps(rec, side.steps, fns, evals=eval_points(side))
