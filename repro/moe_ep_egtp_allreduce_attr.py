"""Expert parallelism with expert GTP on the local spec: the routed experts' GTP shards lose
``allreduce = False`` and DDP reduces them over the dense data-parallel group.

World 4, TP 1, EP 2, expert GTP 2 (dense GTP 2), 4 routed experts top-2, one forward/backward of
megatron-core's GPTModel + DDP + ``finalize_model_grads`` on the same tokens, twice: as
megatron-core builds it, and with ``allreduce = False`` put back on the expert weights before
DDP is built (what TE's path and ``copy_gtp_attributes`` would keep). Prints, on rank 0, the
``allreduce`` attribute of an expert weight and whether DDP put it in an expert buffer, and
the largest difference between the two runs' expert main_grads.

    export PYTHONPATH=$PWD; .venv/bin/python repro/moe_ep_egtp_allreduce_attr.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from repro._common import spawn  # noqa: E402

EXPERT = "module.decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"


def _side(restore: bool) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads,
    )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import gtp_api
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from harness.backends.megatron import compat

    compat.reset_gtp_state()
    ps.initialize_model_parallel(1, gtp_remat_size=2, expert_model_parallel_size=2, expert_gtp_remat_size=2)
    model_parallel_cuda_manual_seed(1)
    torch.manual_seed(1)
    gtp_api.configure_gtp_remat_from_recipe(calculate_per_token_loss=False)
    cfg = TransformerConfig(
        num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
        tensor_parallel_num_weight_shards=2, expert_tensor_parallel_num_weight_shards=2,
        num_moe_experts=4, moe_router_topk=2, expert_model_parallel_size=2,
            moe_token_dispatcher_type="alltoall",
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
        gradient_accumulation_fusion=False, deterministic_mode=True,
    )
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    model = GPTModel(config=cfg, transformer_layer_spec=spec,
                     vocab_size=64, max_sequence_length=8, share_embeddings_and_output_weights=False,
                     position_embedding_type="learned_absolute")
    if restore:
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.allreduce = False
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    gtp_api.classify_gtp_remat_chains(ddp)
    named = dict(ddp.named_parameters())
    in_expert_buffer = any(named[EXPERT] in b.params for b in ddp.expert_parallel_buffers)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    mask = torch.triu(torch.ones(1, 1, 8, 8, dtype=torch.bool), 1)
    ddp(tokens, torch.arange(8)[None].expand(2, -1), mask, labels=tokens).float().mean().backward()
    finalize_model_grads([ddp])
    grads = {n: p.main_grad.clone() for n, p in named.items() if ".experts." in n}
    attr = getattr(named[EXPERT], "allreduce", "absent")
    ps.destroy_model_parallel()
    compat.reset_gtp_state()
    return {"allreduce": attr, "in_expert_buffer": in_expert_buffer, "grads": grads}


def _rank(rank: int, world: int) -> dict:
    built, restored = _side(False), _side(True)
    diff = max(float((built["grads"][n] - restored["grads"][n]).abs().max()) for n in built["grads"])
    return {"built": {k: built[k] for k in ("allreduce", "in_expert_buffer")},
            "restored": {k: restored[k] for k in ("allreduce", "in_expert_buffer")},
            "max_expert_main_grad_difference": diff}


def main() -> int:
    results = spawn(_rank, 4)
    for r, res in enumerate(results):
        print(f"rank {r}: {res}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
