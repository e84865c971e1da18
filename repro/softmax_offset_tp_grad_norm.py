"""The learnable softmax's offsets at TP 2: cut over TP with the heads, tagged as replicated, so
the grad norm counts TP rank 0's alone.

World 2, TP 2 (GTP off: the offsets are no GTP weight, and GTP changes nothing here), one layer
of megatron-core's GPTModel on the local spec with ``softmax_type = "learnable"``, DDP and
``finalize_model_grads``, one forward/backward on the same tokens. Prints, per rank, the shape of
layer 0's ``core_attention.softmax_offset`` (its own heads), whether it carries megatron-core's
``tensor_model_parallel`` tag and what ``param_is_not_tensor_parallel_duplicate`` says of it; then
on rank 0 the squared grad norm megatron-core's optimizer computes (``get_grad_norm``), the
logical one (every TP shard once, replicated parameters once) and their difference beside the
squared sum of TP rank 1's offset grads. ``--json PATH`` writes every rank's numbers (also the
squared norm of megatron-core's own selection summed in fp64, and the count of its terms).

    export PYTHONPATH=$PWD; .venv/bin/python repro/softmax_offset_tp_grad_norm.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from repro._common import spawn  # noqa: E402

OFFSET = "module.decoder.layers.0.self_attention.core_attention.softmax_offset"


def _rank(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads,
    )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel_cuda_manual_seed(1)
    torch.manual_seed(1)
    cfg = TransformerConfig(
        num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
        tensor_model_parallel_size=2, softmax_type="learnable", init_method_std=0.5,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
        gradient_accumulation_fusion=False, attention_softmax_in_fp32=True, deterministic_mode=True,
    )
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                     max_sequence_length=8, share_embeddings_and_output_weights=False)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=0.0), [ddp])
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(7))
    mask = torch.triu(torch.ones(1, 1, 8, 8, dtype=torch.bool), 1)
    ddp(tokens, torch.arange(8)[None].expand(2, -1), mask, labels=tokens).float().mean().backward()
    finalize_model_grads([ddp])
    named = dict(ddp.named_parameters())
    for p in named.values():  # the optimizer reads .grad (FP32Optimizer: main_grad handed over)
        p.grad = p.main_grad
    megatron_norm = float(opt.get_grad_norm())
    # megatron-core's own filter, summed in fp64: the optimizer's selection without its fp32 rounding.
    kept = sum(float(p.main_grad.double().pow(2).sum()) for p in named.values()
               if param_is_not_tensor_parallel_duplicate(p))
    filtered = torch.tensor([kept], dtype=torch.float64)
    dist.all_reduce(filtered)
    # Logical: a TP-cut parameter's shards all count (the offsets are cut: each rank holds its heads');
    # a parameter whole on every TP rank counts once.
    tp_rank = ps.get_tensor_model_parallel_rank()
    cut = {n for n, p in named.items() if getattr(p, "tensor_model_parallel", False) or n == OFFSET}
    local = sum(float(p.main_grad.double().pow(2).sum()) for n, p in named.items()
                if n in cut or tp_rank == 0)
    total = torch.tensor([local], dtype=torch.float64)
    dist.all_reduce(total)
    offset = named[OFFSET]
    rank1_offset = torch.tensor([float(offset.main_grad.double().pow(2).sum()) if tp_rank == 1 else 0.0],
                                dtype=torch.float64)
    dist.all_reduce(rank1_offset)
    out = {"softmax_offset_shape": list(offset.shape),
           "tensor_model_parallel": getattr(offset, "tensor_model_parallel", "absent"),
           "counted_in_grad_norm": param_is_not_tensor_parallel_duplicate(offset),
           "megatron_grad_norm_sq": megatron_norm ** 2, "filtered_grad_norm_sq": float(filtered),
           "logical_grad_norm_sq": float(total), "terms": sum(p.numel() for p in named.values()),
           "difference": float(total) - megatron_norm ** 2,
           "tp_rank1_offset_grad_sq": float(rank1_offset)}
    ps.destroy_model_parallel()
    return out


def main() -> int:
    results = spawn(_rank, 2)
    if "--json" in sys.argv:
        Path(sys.argv[sys.argv.index("--json") + 1]).write_text(json.dumps(results))
    for r, res in enumerate(results):
        keys = ("softmax_offset_shape", "tensor_model_parallel", "counted_in_grad_norm")
        print(f"rank {r}: " + ", ".join(f"{k} {res[k]}" for k in keys))
    res = results[0]
    print(f"grad norm^2: megatron-core {res['megatron_grad_norm_sq']:.9e}, logical "
          f"{res['logical_grad_norm_sq']:.9e}, difference {res['difference']:.6e}; TP rank 1's "
          f"softmax_offset grad^2 {res['tp_rank1_offset_grad_sq']:.6e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
