"""Sequence parallel at TP2 x GTP2 with GTP weight prefetch on vs off, vs GTP off (TP2 + SP).

Runs megatron-core 0.19.2's tiny GPT at TP2 x GTP2 (world 4, gloo, CPU) for two forward/backward
passes and prints loss, grad norm, the first parameter whose gradient differs from GTP off, and every
GEMM that read a weight other than its own. Sequence parallel uses megatron-core's torch
LayerNorm built without its SP assertion (see _common._norm_without_sp_assert).

    python repro/gtp_sequence_parallel_prefetch.py [--json OUT]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402

# hidden 128, ffn 256 at TP2: linear_fc1 (256/2 x 128) and linear_fc2 (128 x 256/2) are both
# 128 x 128 TP-locally, consecutive in the forward prefetch chain (the harness's default model).
MODEL = c.Model(hidden_size=128, ffn_hidden_size=256, vocab_size=128)
# Two forward/backward passes: the first links the prefetch chain and gathers on demand.
TP2 = dict(tp=2, model=MODEL, iterations=2)
SIDES = (
    c.Run("gtp-off", gtp=1, sequence_parallel=True, **TP2),
    c.Run("gtp2-prefetch-off", gtp=2, sequence_parallel=True, weight_prefetch=False, **TP2),
    c.Run("gtp2-prefetch-on", gtp=2, sequence_parallel=True, **TP2),
    c.Run("gtp2-prefetch-on-sync-gathers", gtp=2, sequence_parallel=True, sync_gathers=True, **TP2),
    c.Run("gtp2-prefetch-on-no-sp", gtp=2, **TP2),
    c.Run("gtp2-prefetch-on-no-sp-sync-gathers", gtp=2, sync_gathers=True, **TP2),
)


def main(argv=None):
    c.cli(__doc__, "sequence parallel x GTP weight prefetch, TP2 x GTP2", SIDES, 4, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
