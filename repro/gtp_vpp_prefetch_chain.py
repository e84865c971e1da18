"""Interleaved pipeline (PP 2 x VPP 2) with GTP 2: the forward prefetch chain crosses model chunks
into a gather buffer that other chunks' gathers refill.

World 4 (TP 1, GTP 2, PP 2, VPP 2), megatron-core's tiny GPT (local spec, fp32, 4 layers: chunk 0
of stage 0 holds layer 0, chunk 1 layer 2; stage 1 layers 1 and 3), one step of 4 micro-batches
through megatron-core's interleaved schedule, DDP and ``finalize_model_grads``. Prints per side the
loss, the largest relative difference of any logical gradient from the GTP-off side, and every
forward hand-out of a GTP weight that is not its own weight (whose weight it is instead). The
hand-out is checked when GTP returns it, so it follows program order (no timing): the weight GTP
prefetched for the next chunk's first GEMM was overwritten by an interleaved micro-batch's gather
into the same buffer before that GEMM ran.

    export PYTHONPATH=$PWD; .venv/bin/python repro/gtp_vpp_prefetch_chain.py [--sides a,b] [--json OUT]
    [--megatron TREE]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from repro._common import logical, megatron_banner, parse_args, spawn, token_sum_loss  # noqa: E402

SIDES = {"gtp-off": (1, True), "gtp2-prefetch-on": (2, True), "gtp2-prefetch-off": (2, False)}
LAYERS, HIDDEN, FFN, HEADS, VOCAB, SEQ, MBS, MICRO = 4, 64, 80, 4, 72, 16, 1, 4


def _build(gtp: int, prefetch: bool):
    """Two model chunks per rank (``vp_stage`` 0 and 1), each wrapped in megatron-core's DDP."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import generalized_tensor_parallelism as gtp_impl
    from megatron.core.tensor_parallel import gtp_api
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from harness.backends.megatron import compat

    compat.reset_gtp_state()
    ps.initialize_model_parallel(1, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                                 gtp_remat_size=gtp)
    model_parallel_cuda_manual_seed(1)
    if gtp > 1:
        gtp_api.configure_gtp_remat_from_recipe(calculate_per_token_loss=False)
        gtp_impl.update_gtp_config(weight_prefetch=prefetch)
    cfg = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
        tensor_parallel_num_weight_shards=gtp, pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2, overlap_p2p_comm=True, batch_p2p_comm=False,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
        gradient_accumulation_fusion=False, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        init_method_std=0.05, deterministic_mode=True,
    )
    chunks = []
    for vp in range(2):
        # Same full weights on every side: one CPU seed per (stage, chunk), GTP slices them after.
        torch.manual_seed(1000 + 10 * ps.get_pipeline_model_parallel_rank() + vp)
        model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                         max_sequence_length=SEQ, share_embeddings_and_output_weights=False,
                         position_embedding_type="learned_absolute",
                         pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                         post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                             vp_stage=vp)
        chunks.append(DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                              model,
                                              disable_bucketing=bool(chunks)))
    if gtp > 1:
        gtp_api.classify_gtp_remat_chains(chunks)
    return cfg, chunks


def _global_names(chunks) -> dict:
    """id(param) -> (name with the global layer number, param): chunks number their layers from 0."""
    names = {}
    for c in chunks:
        offsets = {j: layer.layer_number - 1 for j, layer in enumerate(c.module.decoder.layers)}
        for n, p in c.named_parameters():
            n = n.removeprefix("module.")
            if n.startswith("decoder.layers."):
                j, rest = n[len("decoder.layers."):].split(".", 1)
                n = f"decoder.layers.{offsets[int(j)]}.{rest}"
            names[id(p)] = (n, p)
    return names


def _record_handouts(names: dict, weights: dict, handouts: list):
    """Wrap GTP's forward hand-out: note each weight that is not its own; returns the undo."""
    from megatron.core.tensor_parallel import generalized_tensor_parallelism as gtp_impl

    cls = gtp_impl.GTPShardedParam
    original = cls.all_gather_and_prefetch

    def record(param, fwd=True, nvtx_label=None):
        out = original(param, fwd=fwd, nvtx_label=nvtx_label)
        if torch._C._current_graph_task_id() == -1:  # forward, not a recompute
            own = names.get(id(param), ("?",))[0]
            if not torch.equal(out, weights.get(own, out)):
                match = [n for n, w in weights.items() if w.shape == out.shape and torch.equal(w, out)]
                handouts.append({"param": own, "index": len(handouts), "holds": match
                                 or ["no parameter's weight"]})
            else:
                handouts.append(None)
        return out

    cls.all_gather_and_prefetch = record
    return lambda: setattr(cls, "all_gather_and_prefetch", original)


def _side(gtp: int, prefetch: bool) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from harness.backends.megatron import compat

    cfg, chunks = _build(gtp, prefetch)
    names = _global_names(chunks)
    weights = {n: logical(p, p.data) for n, p in names.values()}
    handouts = []
    undo = _record_handouts(names, weights, handouts)
    data_rank, data_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    tokens = torch.randint(0, VOCAB, (data_size, MICRO, MBS, SEQ + 1),
                           generator=torch.Generator().manual_seed(7))[data_rank]
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), 1)
    positions = torch.arange(SEQ)[None].expand(MBS, -1)
    totals = []
    loss_func = token_sum_loss(totals)

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        return model(b[:, :-1], positions, mask, labels=b[:, 1:]), loss_func

    cfg.finalize_model_grads_func = finalize_model_grads
    try:
        for c in chunks:
            c.zero_grad_buffer()
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=[iter(list(tokens)) for _ in chunks], model=chunks,
            num_microbatches=MICRO, seq_length=SEQ, micro_batch_size=MBS, forward_only=False,
        )
    finally:
        undo()
    total = torch.stack(totals).sum(0) if totals else torch.zeros(2)
    dist.all_reduce(total)  # the last stage's ranks hold the losses
    grads = {n: logical(p, p.main_grad) for n, p in names.values()}
    ps.destroy_model_parallel()
    compat.reset_gtp_state()
    wrong = [h for h in handouts if h is not None]
    return {"loss": float(total[0] / total[1]), "grads": grads, "wrong": wrong,
            "handouts": len(handouts)}


def _rank(rank: int, world: int, sides: list) -> dict:
    results = {s: _side(*SIDES[s]) for s in sides}
    base = results[sides[0]]["grads"]
    out = {}
    for s, r in results.items():
        rel = {n: float((g - base[n]).abs().max() / base[n].abs().max().clamp_min(1e-30))
               for n, g in r["grads"].items()}
        worst = max(rel, key=rel.get)
        out[s] = {"loss": r["loss"], "worst_grad": worst, "worst_rel_diff": rel[worst],
                  "wrong_handouts": r["wrong"], "handouts": r["handouts"]}
    return out


def main(argv=None) -> int:
    args = parse_args(__doc__, SIDES, argv)
    sides = args.chosen
    per_rank = spawn(_rank, 4, sides)
    print(f"== {megatron_banner()}: PP 2 x VPP 2, GTP 2 vs off, world 4 ==")
    for s in sides:
        rows = [r[s] for r in per_rank]
        worst = max(rows, key=lambda x: x["worst_rel_diff"])
        print(f"{s:>18}: loss {rows[0]['loss']:.6f}  worst grad rel diff vs {sides[0]}: "
              f"{worst['worst_rel_diff']:.3e}"
              f" ({worst['worst_grad']})")
        for rank, r in enumerate(rows):
            for h in r["wrong_handouts"][:3]:
                print(f"{'':>20}rank {rank}: forward hand-out #{h['index']} of {h['param']} holds "
                      f"{', '.join(h['holds'])}")
    if args.json:
        args.json.write_text(json.dumps(per_rank, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
