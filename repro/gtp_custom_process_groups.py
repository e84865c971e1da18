"""GTP under a caller's ProcessGroupCollection whose GTP peers are paired otherwise than
parallel_state's: which group each GTP weight is gathered and reduce-scattered over, and which
rank the grad norm counts each replicated gradient on.

World 4, TP1 x GTP2 x DP2. parallel_state pairs GTP peers [0, 1], [2, 3]; the collection
handed to GPTModel pairs them [0, 2], [1, 3] (and its replicate-DP and model-parallel groups
follow: DP [0, 1], [2, 3]), the same sizes, as megatron-core's own
``test_gtp_custom_pgs.py`` builds it for a TransformerBlock. For every GTP weight of
megatron-core's tiny GPT (local spec) it prints the ranks of the weight's GTP group
(``GTPShardedParam.group``, what its all-gather and reduce-scatter run over) against the
collection's; for every replicated parameter, whether ``param_is_not_gtp_duplicate`` keeps it
on this rank, against "this rank is rank 0 of the collection's GTP group" (the grad norm sums
the kept squares over the collection's model-parallel group: each replicated gradient must be
kept on exactly one rank of it). No training step: the groups are the finding.

Exit status: 0 when every weight follows the collection, 1 when one does not (so ``git bisect
run`` can use it), 2 on a bad command line.

    export PYTHONPATH=$PWD; .venv/bin/python repro/gtp_custom_process_groups.py [--json OUT] [--megatron TREE]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from repro import _common as c  # noqa: E402

WORLD, PERMUTED_GTP, PERMUTED_DP = 4, [[0, 2], [1, 3]], [[0, 1], [2, 3]]


def _collection():
    """parallel_state's collection with the GTP, replicate-DP and model-parallel groups re-paired
    (every rank creates every group, in one order)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgc, rank = ProcessGroupCollection.use_mpu_process_groups(), dist.get_rank()
    made = {tuple(g): dist.new_group(g) for g in PERMUTED_GTP + PERMUTED_DP}
    gtp = next(made[tuple(g)] for g in PERMUTED_GTP if rank in g)
    dp = next(made[tuple(g)] for g in PERMUTED_DP if rank in g)
    pgc.gtp_remat, pgc.mp = gtp, gtp  # TP 1: the model-parallel group is the GTP group
    pgc.dp = pgc.dp_cp = pgc.intra_dp_cp = dp
    return pgc


def _on_rank(rank, world):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_gtp_duplicate

    made = []
    _, ddp = c.build(c.Run("collection-permuted", gtp=2), collection=lambda: made.append(_collection())
                     or made[0])
    pgc = made[0]
    want = dist.get_process_group_ranks(pgc.gtp_remat)
    counted_here = pgc.gtp_remat.rank() == 0  # each replicated grad once per model-parallel group
    weights, kept = {}, {}
    for name, p in ddp.module.named_parameters():
        if getattr(p, "is_gtp_weight_remat", False):
            weights[c.unwrapped_name(name)] = dist.get_process_group_ranks(p.group)
        else:
            kept[c.unwrapped_name(name)] = bool(param_is_not_gtp_duplicate(p))
    ps.destroy_model_parallel()
    return {"rank": rank, "collection_gtp_group": want, "weights": weights,
            "weights_off_collection": {n: g for n, g in weights.items() if g != want},
            "replicated_counted_here": counted_here,
            "replicated_miscounted": sorted(n for n, k in kept.items() if k != counted_here)}


def main(argv=None) -> int:
    args = c.parse_args(__doc__, ["collection-permuted"], argv)
    print(c.megatron_banner())
    ranks = c.spawn(_on_rank, WORLD)
    for r in ranks:
        off, miscounted = r["weights_off_collection"], r["replicated_miscounted"]
        print(f"rank {r['rank']}: the collection's GTP group {r['collection_gtp_group']}: "
              f"{len(r['weights']) - len(off)} of {len(r['weights'])} GTP weights gather over it"
              + "".join(f"\n    {n} gathers over {g}" for n, g in sorted(off.items())))
        print(f"    replicated grads the norm should count here: "
              f"{'all' if r['replicated_counted_here'] else 'none'}; "
              f"counted otherwise: {len(miscounted)}" + (f" ({', '.join(miscounted[:3])}, ...)" if miscounted
                                                         else ""))
    if args.json:
        args.json.write_text(json.dumps(ranks, indent=1))
    return 1 if any(r["weights_off_collection"] or r["replicated_miscounted"] for r in ranks) else 0


if __name__ == "__main__":
    sys.exit(main())
