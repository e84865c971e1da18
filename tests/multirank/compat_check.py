"""Run under torchrun (world 4): the CPU compatibility layer's collectives against plain
torch.distributed, and the harness's sample-to-rank mapping against megatron-core's groups.
Writes a JSON report to argv[1] (one file per rank)."""

import json
import sys

import torch
import torch.distributed as dist

from harness.backends.megatron import compat
from harness.backends.data import coord, rank_sample_ids
from harness.scenario.schema import DataConfig, Side


def _issue_order(group, n: int, rounds: int = 200) -> bool:
    """Two async collectives into one output, issued back to back: the later one's result must
    be what stays (a CUDA stream / NCCL communicator runs them in issue order); gloo alone
    lets them finish in either order, and rewrites a reduce-scatter's output at every wait."""
    rows = 1 << 12
    gathered = torch.empty(rows * n)
    scattered = torch.empty(rows)
    ok = True
    for _ in range(rounds):
        handles = [compat.gather_along_first_dim(torch.full((rows,), float(v)), group, async_op=True,
                                                 output_tensor=gathered)[1] for v in (1, 2)]
        handles += [compat.reduce_scatter_along_first_dim(torch.full((rows * n,), float(v)), group,
                                                          async_op=True, output=scattered)[1]
                    for v in (1, 2)]
        for h in reversed(handles):
            h.wait()
        scattered_once = bool(scattered.eq(2 * n).all())
        for h in handles:  # waiting again (GTP and the ordering both may) must not rewrite
            h.wait()
        ok &= bool(gathered.eq(2).all()) and scattered_once and bool(scattered.eq(2 * n).all())
    return ok


def _lagging(group, n: int) -> bool:
    """``lagging``: an async collective's output is untouched until its handle, or a later one
    of its group, is waited; then every earlier one lands first, in issue order."""
    rows = 1 << 10
    compat.set_collectives("lagging")
    try:
        first, second = torch.full((rows * n,), -1.0), torch.full((rows * n,), -1.0)
        h1 = compat.gather_along_first_dim(torch.full((rows,), 1.0), group, async_op=True,
                                           output_tensor=first)[1]
        h2 = compat.gather_along_first_dim(torch.full((rows,), 2.0), group, async_op=True,
                                           output_tensor=second)[1]
        untouched = bool(first.eq(-1).all() and second.eq(-1).all())  # issuing h2 completed h1, unlanded
        h2.wait()
        landed = bool(first.eq(1).all() and second.eq(2).all())
        h1.wait()  # already landed: no rewrite
        scattered = torch.full((rows,), -1.0)
        h3 = compat.reduce_scatter_along_first_dim(torch.full((rows * n,), 3.0), group, async_op=True,
                                                   output=scattered)[1]
        rs_untouched = bool(scattered.eq(-1).all())
        h3.wait()
        return (untouched and landed and rs_untouched and bool(scattered.eq(3 * n).all())
                and _issue_order(group, n, 20))
    finally:
        compat.set_collectives("async")


def _ddp_coalesced(group, n: int) -> bool:
    """DDP's coalesced bucket all-gathers (param_and_grad_buffer's manager, as installed): an
    async block's outputs stay untouched until its handle is waited, even once gloo's thread
    has long finished; a synchronous block's are there when it ends."""
    import time

    from megatron.core.distributed import param_and_grad_buffer as buffers

    rows = 1 << 10
    rank = dist.get_rank()
    expected = torch.cat([torch.full((rows,), float(r))
                          for r in sorted(dist.get_process_group_ranks(group or dist.group.WORLD))])
    out = torch.full((rows * n,), -1.0)
    with buffers._coalescing_manager(group, async_ops=True) as cm:
        dist.all_gather_into_tensor(out, torch.full((rows,), float(rank)), group=group, async_op=True)
    time.sleep(0.2)
    untouched = bool(out.eq(-1).all())
    cm.wait()
    landed = torch.equal(out, expected)
    sync = torch.full((rows * n,), -1.0)
    with buffers._coalescing_manager(group, async_ops=False):
        dist.all_gather_into_tensor(sync, torch.full((rows,), float(rank)), group=group)
    return untouched and landed and torch.equal(sync, expected)


def main(report_path):
    compat.install()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    report = {"rank": rank, "checks": {}}
    checks = report["checks"]
    sub = dist.new_group([0, 1])
    for name, group, members in (("world", None, list(range(world))), ("pair", sub, [0, 1])):
        if rank not in members:
            continue
        n = len(members)
        x = torch.arange(6, dtype=torch.float32).view(3, 2) + 10 * rank
        out, handle = compat.gather_along_first_dim(x, group)
        ref = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(ref, x, group=group)
        checks[f"gather-{name}"] = bool(handle is None and torch.equal(out, torch.cat(ref)))
        out, handle = compat.gather_along_first_dim(x, group, async_op=True)
        handle.wait()
        checks[f"gather-async-{name}"] = torch.equal(out, torch.cat(ref))
        y = torch.arange(4 * n, dtype=torch.float32).view(2 * n, 2) * (rank + 1)
        rs, _ = compat.reduce_scatter_along_first_dim(y, group)
        full = y.clone()
        dist.all_reduce(full, group=group)
        me = members.index(rank)
        checks[f"reduce-scatter-{name}"] = torch.equal(rs, full.chunk(n)[me])
        checks[f"issue-order-{name}"] = _issue_order(group, n)
        checks[f"lagging-{name}"] = _lagging(group, n)
        checks[f"ddp-coalesced-{name}"] = _ddp_coalesced(group, n)
        z = torch.full((3,), float(rank + 1))
        dist.all_reduce(z, op=dist.ReduceOp.AVG, group=group)
        checks[f"avg-{name}"] = torch.allclose(z, torch.full((3,), sum(m + 1 for m in members) / n))
    # Mapping: the harness's data rank equals megatron-core's GTP-inclusive data-parallel rank.
    from megatron.core import parallel_state as ps

    for tp, g in ((2, 2), (1, 2), (1, 4)):
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, gtp_remat_size=g)
        side = Side(world_size=world, tp=tp, gtp=g)
        c = coord(rank, side)
        key = f"tp{tp}-gtp{g}-dp{side.replicate_dp}"
        checks[f"data-rank-{key}"] = c["data"] == ps.get_data_parallel_rank()
        checks[f"data-size-{key}"] = side.data_ranks == ps.get_data_parallel_world_size()
        checks[f"gtp-rank-{key}"] = c["gtp"] == ps.get_gtp_weight_remat_rank()
        checks[f"tp-rank-{key}"] = c["tp"] == ps.get_tensor_model_parallel_rank()
        report[f"samples-{key}"] = rank_sample_ids(1, rank, side, DataConfig(global_batch_size=8))
        ps.destroy_model_parallel()
    with open(f"{report_path}.rank{rank}.json", "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
