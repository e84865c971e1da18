"""Full activation recompute (uniform, 1 layer) with GTP weight prefetch on vs off, vs GTP off.

Runs megatron-core 0.19.2's tiny GPT at TP1 x GTP2 (world 2, gloo, CPU) for one step and
prints loss, grad norm, the first parameter whose gradient differs from GTP off, and every
GEMM that read a weight other than its own (recompute GEMMs included).

    python repro/gtp_full_recompute_prefetch.py [--json OUT]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402

SIDES = (
    c.Run("gtp-off", gtp=1, recompute=True),
    c.Run("gtp2-prefetch-off", gtp=2, recompute=True, weight_prefetch=False),
    c.Run("gtp2-prefetch-on", gtp=2, recompute=True, weight_prefetch=True),
    c.Run("gtp2-prefetch-on-sync-gathers", gtp=2, recompute=True, sync_gathers=True),
    c.Run("gtp2-prefetch-on-no-recompute", gtp=2, recompute=False),
    c.Run("gtp2-prefetch-on-te-phase", gtp=2, recompute=True, te_recompute_phase=True),
    c.Run("gtp2-prefetch-on-te-phase-iter2", gtp=2, recompute=True, te_recompute_phase=True,
          iterations=2),
)


def main(argv=None):
    c.cli(__doc__, "full recompute x GTP weight prefetch, TP1 x GTP2", SIDES, 2, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
