"""Multi-token prediction (one depth) under GTP 2 vs GTP off (TP1, world 2, gloo, CPU, two passes).

MTP uses the word embedding and the output layer twice per forward (the main head and the
depth). Per side: whether the step raised (and where in megatron-core), else the loss, the
grad norm, the shared weights' gradients against GTP off (max |diff| relative to GTP off's
largest element, and whether any element is not finite) and the largest relative difference
of any other weight. Exit status 1 while the GTP side raises or a shared weight's gradient
is not finite.

On the 0.19.2 wheel the GTP side raises KeyError: None in GTPShardedParam.wgrad_reduce_scatter:
the embedding's backward for the depth's use runs before decoder layer 0's, and the chain's
deferred finalize reads layer 0's reduce-scatter buffer though none was issued. On Megatron-LM
79e6b6a7f5 it runs, and the embedding's gradient is not finite: DDP adds the placeholder wgrad
of the zero_out_wgrad embedding, TE's shared buffer, never zeroed (the CPU layer keeps TE's
semantics: one torch.empty buffer per shape, which deterministic mode fills with NaN). From
d262dbed3d on (main) every gradient agrees with GTP off up to summation order.

    python repro/gtp_mtp_shared_weights.py [--megatron git:<Megatron-LM>@<rev>] [--json OUT]
"""

import json
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402

# Two forward/backward passes on the same weights (each from zeroed grad buffers): the second
# is the first whose DDP hook can read a placeholder the first left in the embedding's .grad.
SIDES = (c.Run("gtp-off-mtp1", gtp=1, mtp_num_layers=1, iterations=2),
         c.Run("gtp2-mtp1", gtp=2, mtp_num_layers=1, iterations=2))
SHARED = ("embedding.word_embeddings.weight", "output_layer.weight")


def _where(exc: BaseException) -> str:
    """The innermost two megatron-core frames of the exception: file (from megatron/core/),
    function and line of each, outer first."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/megatron/core/" in f.filename]
    return " -> ".join(f"{f.filename.split('/megatron/core/')[-1]}:{f.name}:{f.lineno}" for f in frames[-2:])


def _side(run: c.Run) -> dict:
    from megatron.core import parallel_state as ps

    try:
        return c.run_side(run, instrument=False)
    except Exception as e:  # every rank raises at the same place: the groups are left idle
        ps.destroy_model_parallel()
        c.compat.reset_gtp_state()
        return {"label": run.label, "raised": f"{type(e).__name__}: {e}", "where": _where(e)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


def _on_rank(rank, world, sides):
    results = [_side(run) for run in sides]
    base, out = results[0], {"tree": c.megatron_banner()}
    for s in results:
        if "raised" in s:
            out[s["label"]] = {"raised": s["raised"], "where": s["where"]}
            continue
        others = [n for n in s["grads"] if n not in SHARED]
        out[s["label"]] = {
            "loss": s["loss"], "grad_norm": s["grad_norm"],
            "shared": {n: {"rel_diff": _rel(s["grads"][n], base["grads"][n]),
                           "finite": bool(torch.isfinite(s["grads"][n]).all())} for n in SHARED},
            "others_max_rel_diff": max(_rel(s["grads"][n], base["grads"][n]) for n in others),
        }
    return out


def main(argv=None) -> int:
    by_label = {s.label: s for s in SIDES}
    args = c.parse_args(__doc__, by_label, argv)
    results = c.spawn(_on_rank, 2, tuple(by_label[x] for x in args.chosen))
    print(f"== MTP (1 depth) under GTP, TP1 x GTP2 vs GTP off: {results[0]['tree']} (rank 0) ==")
    bad = False
    for label, s in results[0].items():
        if label == "tree":
            continue
        if "raised" in s:
            bad = True
            print(f"{label:>14}: raised {s['raised']} at {s['where']}")
            continue
        shared = "; ".join(f"{n} {v['rel_diff']:.2e}" + ("" if v["finite"] else " NOT FINITE")
                           for n, v in s["shared"].items())
        bad |= not all(v["finite"] for v in s["shared"].values())
        print(f"{label:>14}: loss {s['loss']:.6f}  grad norm {s['grad_norm']:.6f}  shared grads vs first "
              f"side: "
              f"{shared}; others max rel diff {s['others_max_rel_diff']:.2e}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
