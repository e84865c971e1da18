"""Routed experts' gradients when expert GTP and dense GTP differ: each layout against the same EP
with every GTP off, on the same tokens per data rank.

megatron-core's tiny MoE GPT (local spec, 4 experts top-2, alltoall dispatcher, SequentialMLP, fp32),
one forward/backward + DDP + ``finalize_model_grads`` per side; each rank feeds its own tokens (GTP
peers are distinct data ranks, so every layout sees the same global batch). For every layout it
prints the experts' ``allreduce`` attribute, whether DDP filed them in an expert buffer, and how
the logical (gathered, unpadded) expert ``main_grad`` relates to the reference's: one factor
``cand = r x ref`` over every expert weight of every rank (the residual says whether a single
factor explains it), or the largest relative error when none does.

Why (FINDINGS.md G): DDP pre-scales expert grads by 1 / ``dp_cp_group.size()``, the dense
GTP-excluded data-parallel size D/G, while an expert GTP shard's reduce-scatter already averages
over the EG expert-GTP peers: expert grads come out scaled by G/EG (finalize's gtp AVG covers only
non-GTP params, and for experts over the expert GTP group). Right only where EG = G. On the
wheel (0.19.2) EP 1 experts stay in the dense buffers (``use_expert_pgs`` ignores expert GTP);
on main (abf04f46e3) they move to the expert topology whenever EG != G, and hit the factor.

    export PYTHONPATH=$PWD; .venv/bin/python repro/moe_expert_grad_scale.py [--cases a,b] [--json OUT]
    [--megatron TREE]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from repro._common import megatron_banner, parse_args, spawn  # noqa: E402

# label: (world, EP, expert GTP, dense GTP)
CASES = {
    "ep1-egtp2-gtp2": (2, 1, 2, 2),
    "ep1-egtp2-gtpoff": (2, 1, 2, 1),
    "ep1-egtpoff-gtp2": (2, 1, 1, 2),
    "ep2-egtpoff-gtp2": (2, 2, 1, 2),
    "ep2-egtp2-gtp2": (4, 2, 2, 2),
    "ep2-egtp2-gtpoff": (4, 2, 2, 1),
}
EXPERTS, HIDDEN, FFN, VOCAB, SEQ = 4, 32, 48, 64, 8


def _side(ep: int, egtp: int, gtp: int) -> dict:
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
    from repro._common import logical

    compat.reset_gtp_state()
    ps.initialize_model_parallel(1, gtp_remat_size=gtp, expert_model_parallel_size=ep,
                                 expert_gtp_remat_size=egtp)
    model_parallel_cuda_manual_seed(1)
    torch.manual_seed(1)
    if gtp > 1 or egtp > 1:
        gtp_api.configure_gtp_remat_from_recipe(calculate_per_token_loss=False)
    cfg = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=4,
        tensor_parallel_num_weight_shards=gtp, expert_tensor_parallel_num_weight_shards=egtp,
        num_moe_experts=EXPERTS, moe_router_topk=2, expert_model_parallel_size=ep,
        moe_token_dispatcher_type="alltoall", use_cpu_initialization=True, hidden_dropout=0.0,
        attention_dropout=0.0, add_bias_linear=False, gradient_accumulation_fusion=False,
        deterministic_mode=True, init_method_std=0.05,
    )
    model = GPTModel(config=cfg,
                     transformer_layer_spec=get_gpt_layer_local_spec(num_experts=EXPERTS,
                                                                     moe_grouped_gemm=False),
                     vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=False,
                     position_embedding_type="learned_absolute")
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    if gtp > 1 or egtp > 1:
        gtp_api.classify_gtp_remat_chains(ddp)
    experts = {n.removeprefix("module."): p for n, p in ddp.named_parameters() if ".experts." in n}
    expert_buffer_params = {id(p) for b in ddp.expert_parallel_buffers for p in b.params}
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(100 + dist.get_rank()))
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), 1)
    ddp(tokens, torch.arange(SEQ)[None].expand(2, -1), mask, labels=tokens).float().mean().backward()
    finalize_model_grads([ddp])
    grads = {n: logical(p, p.main_grad) for n, p in experts.items()}
    first = next(iter(experts.values()))
    out = {"grads": grads, "allreduce": getattr(first, "allreduce", "absent"),
           "expert_buffer": id(first) in expert_buffer_params}
    ps.destroy_model_parallel()
    compat.reset_gtp_state()
    return out


def _relation(cand: dict, ref: dict) -> dict:
    """One factor r with cand = r x ref over all expert weights, and how well it explains cand."""
    a = torch.cat([cand[n].double().flatten() for n in ref])
    b = torch.cat([ref[n].double().flatten() for n in ref])
    r = float(a @ b / (b @ b))
    return {"ratio": r, "residual": float((a - r * b).norm() / a.norm().clamp_min(1e-30)),
            "max_rel_error": float((a - b).abs().max() / b.abs().max())}


def _rank(rank: int, world: int, cases: list) -> dict:
    out, refs = {}, {}
    for label in cases:
        _, ep, egtp, gtp = CASES[label]
        if ep not in refs:
            refs[ep] = _side(ep, 1, 1)
        cand = _side(ep, egtp, gtp)
        out[label] = {"allreduce": cand["allreduce"], "expert_buffer": cand["expert_buffer"],
                      "reference_expert_buffer": refs[ep]["expert_buffer"],
                      **_relation(cand["grads"], refs[ep]["grads"])}
    return out


def _verdict(rel: dict) -> str:
    if rel["max_rel_error"] < 1e-5:
        return "parity"
    if rel["residual"] < 1e-5:
        return f"expert main_grad = {rel['ratio']:.4f} x reference (exactly one factor)"
    return (f"no single factor: max rel error {rel['max_rel_error']:.3e} (best factor {rel['ratio']:.4f}, "
            f"residual {rel['residual']:.2e})")


def main(argv=None) -> int:
    args = parse_args(__doc__, CASES, argv, flag="--cases", what="layouts")
    cases = args.chosen
    print(f"{megatron_banner()}: routed experts' main_grad vs the same EP with every GTP off")
    results = {}
    for world in sorted({CASES[c][0] for c in cases}):
        chosen = [c for c in cases if CASES[c][0] == world]
        per_rank = spawn(_rank, world, chosen)
        for label in chosen:
            rels = [r[label] for r in per_rank]
            # one factor over every rank's experts: the worst rank speaks for the layout
            worst = max(rels, key=lambda x: (x["max_rel_error"], x["residual"]))
            r0 = rels[0]
            results[label] = rels
            print(f"{label:>17} (world {world}): allreduce={r0['allreduce']!s:<5} expert "
                  f"buffer={r0['expert_buffer']!s:<5} "
                  f"-> {_verdict(worst)}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
