"""A padded GTP checkpoint saved at TP1 x GTP2 and loaded at TP2 x GTP2 loads shifted rows, silently.

megatron-core's tiny GPT (local spec, fp32, FFN 80 and vocab 72: not multiples of 16 x 2, so
``linear_fc1``, the word embedding and the output layer carry GTP pad rows) is built at TP1 x GTP2
(world 2) and its model ``sharded_state_dict`` saved with ``dist_checkpointing`` (``torch_dist``).
It is then built at TP2 x GTP2 (world 4) and at TP1 x GTP2 (world 2, the control), every parameter
zeroed, the checkpoint loaded, and each parameter's full logical weight (GTP-gathered, unpadded,
TP-gathered) compared with the saved one. Prints, per load, every parameter that differs: max
|diff| and the first logical row that is wrong.

    export PYTHONPATH=$PWD; .venv/bin/python repro/ckpt_padded_gtp_reshard.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from repro._common import logical, spawn  # noqa: E402

LAYERS, HIDDEN, FFN, HEADS, VOCAB, SEQ = 2, 64, 80, 4, 72, 16


def _build(tp: int, gtp: int):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import gtp_api
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from harness.backends.megatron import compat

    compat.reset_gtp_state()
    ps.initialize_model_parallel(tp, gtp_remat_size=gtp)
    model_parallel_cuda_manual_seed(1)
    torch.manual_seed(1)
    gtp_api.configure_gtp_remat_from_recipe(calculate_per_token_loss=False)
    cfg = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
        tensor_model_parallel_size=tp, tensor_parallel_num_weight_shards=tp * gtp,
            use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False, gradient_accumulation_fusion=False,
        params_dtype=torch.float32, init_method_std=0.05, deterministic_mode=True,
    )
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                    max_sequence_length=SEQ, share_embeddings_and_output_weights=False,
                    position_embedding_type="learned_absolute")


def _full(p) -> torch.Tensor:
    """The full logical weight: GTP-gathered and unpadded, then gathered over TP."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    local = logical(p, p.data)
    if not getattr(p, "tensor_model_parallel", False) or ps.get_tensor_model_parallel_world_size() == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=p.partition_dim)


def _save(rank: int, world: int, directory: str) -> dict:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from harness.backends.megatron import compat

    compat.in_process_checkpoint_writes()
    model = _build(1, 2)
    full = {n: _full(p) for n, p in model.named_parameters()}
    dist_checkpointing.save({"model": model.sharded_state_dict()}, directory,
                            sharded_strategy=TorchDistSaveShardedStrategy("torch_dist", 1))
    if rank == 0:
        for n, t in full.items():
            np.save(Path(directory, f"expected.{n}.npy"), t.numpy(), allow_pickle=False)
    pads = {n: int(getattr(p, "pad_length", 0)) for n, p in model.named_parameters()
            if getattr(p, "pad_length", 0)}
    dist.barrier()
    ps.destroy_model_parallel()
    compat.reset_gtp_state()
    return {"pads": pads}


def _load(rank: int, world: int, directory: str, tp: int) -> dict:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from harness.backends.megatron import compat
    from harness.backends.megatron.checkpoint import allow_listed_reads

    model = _build(tp, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    with allow_listed_reads():  # torch_dist's metadata and byte items through allow-lists, no free unpickling
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, directory)
    model.load_state_dict(loaded["model"])
    out = {}
    for n, p in model.named_parameters():
        got = _full(p)
        want = torch.from_numpy(np.load(Path(directory, f"expected.{n}.npy"), allow_pickle=False))
        if got.shape != want.shape or not torch.equal(got, want):
            same_shape = got.shape == want.shape
            rows = []
            if same_shape:
                rows = (got != want).reshape(got.shape[0], -1).any(1).nonzero().flatten().tolist()
            out[n] = {"max_abs_diff": float((got - want).abs().max()) if same_shape else None,
                      "wrong_rows": len(rows), "rows": got.shape[0], "first_wrong_row": rows[0] if rows
                          else None}
    ps.destroy_model_parallel()
    compat.reset_gtp_state()
    return out


def main() -> int:
    from megatron.core import package_info

    print(f"== megatron-core {package_info.__version__}: padded GTP checkpoint, saved at TP1 x GTP2 ==")
    with tempfile.TemporaryDirectory(prefix="gtp-ckpt-") as tmp:
        pads = spawn(_save, 2, tmp)[0]["pads"]
        print(f"saved; GTP pad rows per shard: {pads}")
        for tp, world in ((1, 2), (2, 4)):
            per_rank = spawn(_load, world, tmp, tp)
            wrong = per_rank[0]
            label = f"loaded at TP{tp} x GTP2 (world {world})"
            if not wrong:
                print(f"{label}: every parameter bitwise equal to the saved one")
                continue
            print(f"{label}: {len(wrong)} parameters differ from the saved ones, no error raised")
            for n, w in wrong.items():
                print(f"    {n}: max |diff| {w['max_abs_diff']:.3e}, {w['wrong_rows']} of {w['rows']} "
                      f"logical rows wrong"
                      f" (first: row {w['first_wrong_row']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
