"""Without Apex or Transformer Engine, megatron-core's DistributedOptimizer cannot load its own
``fully_reshardable`` checkpoint: torch Adam's per-parameter ``step`` is copied into but never read.

Without Apex or TE, ``get_megatron_optimizer`` runs torch's Adam(W) (``USING_PYTORCH_OPTIMIZER``),
which keeps a ``step`` tensor in every parameter's state. megatron-core's tiny GPT (local spec,
fp32) is built on 2 ranks (DP 2) with the distributed optimizer, given one Adam step and saved
with ``dist_checkpointing`` in the format named by ``distrib_optim_sharding_type`` (Megatron-LM's
``--dist-ckpt-optim-fully-reshardable``; ``dp_reshardable`` is its default). A second model and
optimizer are then built and the checkpoint loaded into them (``dist_checkpointing.load``, then
``load_state_dict``, as Megatron-LM's ``load_checkpoint`` does), either as built (empty state) or
after megatron-core's own ``_init_optimizer_states_with_dummy_values`` (its ``fsdp_dtensor`` load
path's remedy for the empty state). Prints each load's outcome and, after a load that completes,
whether the loaded fp32 main parameters and Adam moments equal the saved ones bit for bit.

    export PYTHONPATH=$PWD; .venv/bin/python repro/distopt_ckpt_torch_adam_step.py [--megatron git:REPO@REV]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from repro._common import megatron_banner, parse_args, spawn  # noqa: E402

LOADS = {  # label: (checkpoint format, fill the fresh optimizer's state first)
    "fully_reshardable-fresh": ("fully_reshardable", False),
    "fully_reshardable-filled": ("fully_reshardable", True),
    "dp_reshardable-fresh": ("dp_reshardable", False),
    "dp_reshardable-filled": ("dp_reshardable", True),
}


def _build():
    """Model (under DDP) and distributed optimizer, DP 2."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from harness.backends.megatron import compat

    compat.reset_gtp_state()
    ps.initialize_model_parallel(1)
    model_parallel_cuda_manual_seed(1)
    torch.manual_seed(1)
    cfg = TransformerConfig(
        num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=2,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
        gradient_accumulation_fusion=False, deterministic_mode=True,
    )
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=72,
                     max_sequence_length=16, share_embeddings_and_output_weights=False,
                     position_embedding_type="learned_absolute")
    ddp = DistributedDataParallel(
        cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, params_dtype=torch.float32,
                                                 use_distributed_optimizer=True), [ddp])
    return ddp, opt


def _done() -> None:
    from megatron.core import parallel_state as ps

    from harness.backends.megatron import compat

    ps.destroy_model_parallel()
    compat.reset_gtp_state()


def _parts(opt) -> list:
    """The DistributedOptimizers ``get_megatron_optimizer`` chained (one here)."""
    return getattr(opt, "chained_optimizers", None) or [opt]


def _state(opt) -> dict[str, torch.Tensor]:
    """This rank's fp32 main parameters and Adam moments, by position in the inner optimizers."""
    out = {}
    for o, part in enumerate(_parts(opt)):
        inner = part.optimizer
        for g, group in enumerate(inner.param_groups):
            for i, p in enumerate(group["params"]):
                out[f"{o}.{g}.{i}.param"] = p.detach().clone()
                for k in ("exp_avg", "exp_avg_sq"):
                    if k in inner.state[p]:
                        out[f"{o}.{g}.{i}.{k}"] = inner.state[p][k].detach().clone()
    return out


def _state_dict(ddp, opt, fmt: str, is_loading: bool) -> dict:
    meta = {"distrib_optim_sharding_type": fmt, "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True}
    model = ddp.module.sharded_state_dict(metadata=dict(meta))
    return {"model": model, "optimizer": opt.sharded_state_dict(model, is_loading=is_loading,
                                                                metadata=dict(meta))}


def _where(e: BaseException) -> str:
    """The innermost frame inside megatron-core: file:function:line."""
    import traceback

    frames = [f for f in traceback.extract_tb(e.__traceback__) if "/megatron/core/" in f.filename]
    if not frames:
        return "?"
    f = frames[-1]
    return f"{f.filename.split('/megatron/core/')[-1]}:{f.name}:{f.lineno}"


def _rank(rank: int, world: int, directory: str, loads: list[str]) -> dict:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from megatron.core.optimizer import distrib_optimizer

    from harness.backends.megatron import compat
    from harness.backends.megatron.checkpoint import allow_listed_reads

    compat.in_process_checkpoint_writes()
    out = {"have_apex_or_te": distrib_optimizer.HAVE_APEX_OR_TE}
    saved = {}
    for fmt in sorted({LOADS[label][0] for label in loads}):
        ddp, opt = _build()
        (part,) = _parts(opt)
        out["inner_optimizer"] = type(part.optimizer).__name__
        for p in ddp.parameters():  # one Adam step on a constant gradient: state to save
            p.main_grad.fill_(1e-2)
        opt.step()
        out["state_keys"] = sorted(next(iter(part.optimizer.state.values())).keys())
        saved[fmt] = _state(opt)
        if rank == 0:
            Path(directory, fmt).mkdir()
        dist.barrier()
        dist_checkpointing.save(_state_dict(ddp, opt, fmt, is_loading=False), f"{directory}/{fmt}",
                                sharded_strategy=TorchDistSaveShardedStrategy("torch_dist", 1))
        dist.barrier()
        _done()
    for label in loads:
        fmt, fill = LOADS[label]
        ddp, opt = _build()
        try:
            if fill:
                for part in _parts(opt):
                    part._init_optimizer_states_with_dummy_values()
            with allow_listed_reads():
                loaded = dist_checkpointing.load(_state_dict(ddp, opt, fmt, is_loading=True),
                                                 f"{directory}/{fmt}")
            ddp.module.load_state_dict(loaded["model"])
            opt.load_state_dict(loaded["optimizer"])
            got, want = _state(opt), saved[fmt]
            same = got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
            out[label] = {"load": "loaded", "state_bitwise": same}
        except Exception as e:  # megatron-core's exception is the finding: recorded, not raised
            out[label] = {"load": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                          "where": _where(e)}
        dist.barrier()
        _done()
    return out


def main(argv=None) -> int:
    import json

    args = parse_args(__doc__, LOADS, argv, flag="--loads", what="loads")
    print(f"== {megatron_banner()}: distributed optimizer, DP 2, one Adam step saved ==")
    with tempfile.TemporaryDirectory(prefix="gtp-ckpt-distopt-") as tmp:
        ranks = spawn(_rank, 2, tmp, args.chosen)
    first = ranks[0]
    print(f"Apex or TE: {first['have_apex_or_te']}; inner optimizer {first['inner_optimizer']}, "
          f"per-parameter state {first['state_keys']}")
    for label in args.chosen:
        r = first[label]
        tail = f" (state bitwise: {r['state_bitwise']})" if "state_bitwise" in r else f" at {r['where']}"
        print(f"load {label}: {r['load']}{tail}")
    if args.json:
        args.json.write_text(json.dumps(ranks, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
