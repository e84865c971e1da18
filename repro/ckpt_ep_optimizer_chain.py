"""A torch_dist checkpoint of megatron-core's (non-distributed) optimizer loads only into a layout
whose optimizer chain is the saved one's.

megatron-core's tiny MoE GPT (local spec, 4 routed experts top-2, fp32) is built on 4 ranks at
EP 2 x expert GTP 2 x GTP 2, given one Adam step, and its model and optimizer ``sharded_state_dict``
saved with ``dist_checkpointing`` as Megatron-LM does (``chained_optim_avoid_prefix``). Then each
load layout is built on the same 4 ranks and the checkpoint loaded into it (``dist_checkpointing.load``,
the model's and the optimizer's ``load_state_dict``). Prints, per layout, how many optimizers
``get_megatron_optimizer`` chained (2: the routed experts, tagged ``allreduce = False``, have one
of their own), the expert weight's ``allreduce`` tag and the load's outcome: loaded, or
megatron-core's exception. On the 0.19.2 wheel the saved run keeps its experts in the dense
optimizer (``_gtp_slice_one_param`` drops the tag), so EP 2 without expert GTP cannot load it;
with abf04f46e3 (Megatron-LM main) the saved experts have their own optimizer and EP 1 cannot.

    export PYTHONPATH=$PWD; .venv/bin/python repro/ckpt_ep_optimizer_chain.py [--megatron git:REPO@REV]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from repro._common import megatron_banner, parse_args, spawn  # noqa: E402

SAVED = (2, 2, 2)  # EP, expert GTP, GTP
LOADS = {"ep2-egtp2-gtp2": (2, 2, 2), "ep2-egtpoff-gtpoff": (2, 1, 1), "ep1-egtpoff-gtpoff": (1, 1, 1)}
EXPERT = "module.decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"


def _build(ep: int, eg: int, g: int):
    """Model (under DDP) and optimizer of one layout on 4 ranks."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import gtp_api
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from harness.backends.megatron import compat

    compat.reset_gtp_state()
    ps.initialize_model_parallel(1, gtp_remat_size=g, expert_model_parallel_size=ep, expert_gtp_remat_size=eg)
    model_parallel_cuda_manual_seed(1)
    torch.manual_seed(1)
    gtp_api.configure_gtp_remat_from_recipe(calculate_per_token_loss=False)
    cfg = TransformerConfig(
        num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
        tensor_parallel_num_weight_shards=g, expert_tensor_parallel_num_weight_shards=eg,
        num_moe_experts=4, moe_router_topk=2, expert_model_parallel_size=ep,
            moe_token_dispatcher_type="alltoall",
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
        gradient_accumulation_fusion=False, deterministic_mode=True,
    )
    model = GPTModel(config=cfg,
                     transformer_layer_spec=get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False),
                     vocab_size=64, max_sequence_length=8, share_embeddings_and_output_weights=False,
                     position_embedding_type="learned_absolute")
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, params_dtype=torch.float32),
                                 [ddp])
    return ddp, opt


def _layout(ddp, opt) -> dict:
    tag = getattr(dict(ddp.named_parameters())[EXPERT], "allreduce", "absent")
    return {"optimizers": len(opt.chained_optimizers), "expert_allreduce": str(tag)}


def _done() -> None:
    from megatron.core import parallel_state as ps

    from harness.backends.megatron import compat

    ps.destroy_model_parallel()
    compat.reset_gtp_state()


def _rank(rank: int, world: int, directory: str, loads: list[str]) -> dict:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from harness.backends.megatron import compat
    from harness.backends.megatron.checkpoint import allow_listed_reads, sharded_state

    compat.in_process_checkpoint_writes()
    ddp, opt = _build(*SAVED)
    for p in ddp.parameters():  # one Adam step on a constant gradient: the optimizer has state to save
        p.main_grad.fill_(1e-2)
    opt.step()
    out = {"saved": _layout(ddp, opt)}
    dist_checkpointing.save(sharded_state(ddp, opt, is_loading=False), directory,
                            sharded_strategy=TorchDistSaveShardedStrategy("torch_dist", 1))
    dist.barrier()
    _done()
    for label in loads:
        ddp, opt = _build(*LOADS[label])
        out[label] = _layout(ddp, opt)
        try:
            with allow_listed_reads():
                loaded = dist_checkpointing.load(sharded_state(ddp, opt, is_loading=True), directory)
            ddp.module.load_state_dict(loaded["model"])
            opt.load_state_dict(loaded["optimizer"])
            out[label]["load"] = "loaded"
        except Exception as e:  # megatron-core's refusal is the finding: recorded, not raised
            out[label]["load"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        dist.barrier()
        _done()
    return out


def main(argv=None) -> int:
    import json

    args = parse_args(__doc__, LOADS, argv, flag="--loads", what="load layouts")
    print(f"== {megatron_banner()}: saved at EP 2 x expert GTP 2 x GTP 2 (world 4) ==")
    with tempfile.TemporaryDirectory(prefix="gtp-ckpt-ep-") as tmp:
        ranks = spawn(_rank, 4, tmp, args.chosen)
    first = ranks[0]
    print(f"saved: {first['saved']['optimizers']} optimizer(s), expert allreduce "
          f"{first['saved']['expert_allreduce']}")
    for label in args.chosen:
        r = first[label]
        print(f"load at {label}: {r['optimizers']} optimizer(s), expert allreduce {r['expert_allreduce']}: "
              f"{r['load']}")
    if args.json:
        args.json.write_text(json.dumps(ranks, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
