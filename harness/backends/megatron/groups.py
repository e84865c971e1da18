"""Process groups a caller hands megatron-core (``Side.process_groups``).

``parallel-state``: nothing is passed; every module reads parallel_state's globals, as the rest
of this backend always has. ``collection``: parallel_state's own groups gathered into a
``ProcessGroupCollection`` and passed to GPTModel, DDP, finalize_model_grads, the optimizer
and the schedule, as a user of the explicit API (Megatron-Bridge, HyperCommGrid) does.
``collection-permuted``: a collection of the same sizes whose GTP peers are paired across
replicate DP (:data:`harness.common.mesh.PERMUTED`); every group that runs along the GTP or the
DP axis alone is built anew on that pairing, the others are parallel_state's. The harness's
coordinates of each rank (its shards, its trace) follow the collection's groups, so a module
that reads parallel_state's groups instead shards, gathers or reduces on the other pairing.
"""

from __future__ import annotations

import torch.distributed as dist

from harness.common.mesh import Mesh

# Each collection field of the dense decoder, with the mesh axes its groups span (CP = EP = 1:
# the context-parallel and expert fields are parallel_state's on either pairing).
FIELD_AXES = {
    "tp": ("tp",), "tp_cp": ("tp",), "gtp_remat": ("gtp",), "dp": ("dp",), "dp_cp": ("dp",),
    "intra_dp_cp": ("dp",), "dp_cp_gtp_remat": ("gtp", "dp"), "tp_dp_cp": ("tp", "gtp", "dp"),
    "mp": ("tp", "gtp"),
}


def collection(side):
    """The ``ProcessGroupCollection`` ``side`` passes to megatron-core, or None (parallel_state).
    Call on every rank after ``initialize_model_parallel``, in the same order (``new_group``)."""
    if side.process_groups == "parallel-state":
        return None
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgc = ProcessGroupCollection.use_mpu_process_groups()
    usual, mine = Mesh.of_world(side.world_size, side.tp, side.gtp), Mesh.of_side(side)
    rank = dist.get_rank()
    same_on_any_pairing = ([rank], list(range(side.world_size)), usual.group(rank, "tp"))
    for name, group in sorted(vars(pgc).items()):
        # On parallel_state's own pairing every group is the one megatron-core would read anyway.
        if name in FIELD_AXES or not isinstance(group, dist.ProcessGroup) or mine.order == usual.order:
            continue
        if sorted(dist.get_process_group_ranks(group)) not in same_on_any_pairing:
            raise RuntimeError(f"parallel_state's {name} group of rank {rank} spans "
                               f"{dist.get_process_group_ranks(group)}: not built on another pairing here")
    for name, axes in FIELD_AXES.items():
        group = getattr(pgc, name, None)
        if group is None:
            continue
        ranks = dist.get_process_group_ranks(group)
        if sorted(ranks) != usual.group(rank, *axes):  # the collection is built on what this reads
            raise RuntimeError(f"parallel_state's {name} group of rank {rank} is {ranks}, not the mesh's "
                               f"{usual.group(rank, *axes)} over {axes}")
        if mine.order != usual.order and sorted(mine.groups(*axes)) != sorted(usual.groups(*axes)):
            # every rank creates every group of the field, in one order, and keeps its own
            made = [(g, dist.new_group(g)) for g in mine.groups(*axes)]
            setattr(pgc, name, next(pg for g, pg in made if rank in g))
    return pgc


def kwargs(pgc) -> dict:
    """``pg_collection=`` where one is passed, nothing where parallel_state's groups are read."""
    return {} if pgc is None else {"pg_collection": pgc}


def optimizer_kwargs(pgc) -> dict:
    """get_megatron_optimizer's: with a collection it takes no Gloo groups (it raises; GTP builds
    none either: its optimizer checkpoints through torch_dist)."""
    return {} if pgc is None else {"pg_collection": pgc, "use_gloo_process_groups": False}


def data_group(pgc):
    """The data-distribution group (GTP peers included) the loss is averaged over."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group() if pgc is None else pgc.dp_cp_gtp_remat
