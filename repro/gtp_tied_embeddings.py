"""A tied output layer (share_embeddings_and_output_weights) under GTP 2 vs GTP off (TP1, world 2,
gloo, CPU, one forward/backward pass).

Per side: whether the step raised (the exception and the innermost megatron-core frames), else
its loss and grad norm. Exit status 1 while the GTP side raises.

On the 0.19.2 wheel and on Megatron-LM main d98e8a64dd the GTP side raises at its first forward:
GPTModel hands the output layer shared_embedding_or_output_weight(), the word embedding's
parameter, which under GTP is this rank's GTP shard (vocabulary 72 padded to 96, 48 rows per
rank); ColumnParallelLinear.forward checks a supplied weight against the TP-local shape (72, 64)
before any GTP gather, and GTP gathers only the layer's own weight. No configuration check
refuses the combination first. GTP off runs.

    python repro/gtp_tied_embeddings.py [--megatron git:<Megatron-LM>@<rev>] [--json OUT]
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402
from gtp_mtp_shared_weights import _side  # noqa: E402  (a side that may raise, named where)

MODEL = c.Model(vocab_size=72)  # padded under GTP 2: 96 rows, 48 per GTP rank
SIDES = (c.Run("gtp-off-tied", gtp=1, tied=True, model=MODEL),
         c.Run("gtp2-tied", gtp=2, tied=True, model=MODEL))


def _on_rank(rank, world, sides):
    out = {"tree": c.megatron_banner()}
    for s in map(_side, sides):
        out[s["label"]] = ({"raised": s["raised"], "where": s["where"]} if "raised" in s
                           else {"loss": s["loss"], "grad_norm": s["grad_norm"]})
    return out


def main(argv=None) -> int:
    by_label = {s.label: s for s in SIDES}
    args = c.parse_args(__doc__, by_label, argv)
    results = c.spawn(_on_rank, 2, tuple(by_label[x] for x in args.chosen))
    print(f"== tied embeddings under GTP, TP1 x GTP2 vs GTP off: {results[0]['tree']} (rank 0) ==")
    raised = False
    for label, s in results[0].items():
        if label == "tree":
            continue
        raised |= "raised" in s
        print(f"{label:>13}: " + (f"raised {s['raised']} at {s['where']}" if "raised" in s
                                   else f"loss {s['loss']:.6f}  grad norm {s['grad_norm']:.6f}"))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 1 if raised else 0


if __name__ == "__main__":
    sys.exit(main())
