"""TP1 x GTP2 with ffn_hidden_size = hidden_size: three consecutive same-shaped GTP weights.

Runs megatron-core 0.19.2's tiny GPT (hidden 64, ffn 64, 2 heads, vocab 72) at TP1 x GTP2 (world 2,
gloo, CPU) for two forward/backward passes and prints loss, grad norm, the first parameter whose
gradient differs from GTP off, and every GEMM that read a weight other than its own. The
fuzz-found scenario (scenarios/fuzz_found_alignment.toml) differed in gtp_pad_alignment only;
that changes the padded shape of the word embedding (72 rows -> 80 at 8 x G, 96 at 16 x G), not
of the weights that collide, so this reproducer keeps megatron-core's alignment.

    python repro/gtp_alignment_buffer.py [--json OUT]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402

# ffn = hidden = 64: linear_proj (64 x 64), linear_fc1 (64 x 64, gelu: not gated) and linear_fc2
# (64 x 64) share one gather-buffer key and follow each other on the forward prefetch chain.
MODEL = c.Model(hidden_size=64, ffn_hidden_size=64, num_attention_heads=2, vocab_size=72)
# Two forward/backward passes: the first links the prefetch chain and gathers on demand.
TP1 = dict(model=MODEL, iterations=2)
SIDES = (
    c.Run("gtp-off", gtp=1, **TP1),
    c.Run("gtp2-prefetch-off", gtp=2, weight_prefetch=False, **TP1),
    c.Run("gtp2-prefetch-on", gtp=2, **TP1),
    c.Run("gtp2-prefetch-on-sync-gathers", gtp=2, sync_gathers=True, **TP1),
)


def main(argv=None):
    c.cli(__doc__, "same-shaped proj/fc1/fc2 x GTP weight prefetch, TP1 x GTP2", SIDES, 2, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
