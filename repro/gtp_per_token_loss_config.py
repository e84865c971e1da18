"""calculate_per_token_loss configured on TransformerConfig only vs also through
configure_gtp_remat_from_recipe, GTP 2 vs GTP off (TP1, world 2, gloo, CPU, one step).

Prints loss, grad norm, the first parameter whose gradient differs from GTP off, the value
of GTP's own switch (GTP_CONFIG.calculate_per_token_loss) and, per parameter kind, the ratio
of the gradient norm to GTP off's: 1/G on GTP-sharded weights is the wgrad pre-scale
(_prescale_wgrads_for_mean_rs) applied on top of the per-token normalization.

    python repro/gtp_per_token_loss_config.py [--json OUT]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402

SIDES = (
    c.Run("gtp-off", gtp=1, per_token_loss=True),
    c.Run("gtp2-transformer-config-only", gtp=2, per_token_loss=True),
    c.Run("gtp2-config-and-gtp-recipe", gtp=2, per_token_loss=True, per_token_loss_gtp=True),
)


def _gtp_switch(run: c.Run) -> bool:
    """GTP_CONFIG.calculate_per_token_loss as megatron-core holds it once ``run`` is built."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import generalized_tensor_parallelism as gtp

    c.build(run)
    seen = gtp.GTP_CONFIG.calculate_per_token_loss
    ps.destroy_model_parallel()
    c.compat.reset_gtp_state()
    return seen


def _ratios(base: dict, side: dict, gtp_names: set) -> dict:
    """Norm of each kind of gradient relative to GTP off's (GTP-sharded vs replicated)."""
    out = {}
    for kind, names in (("gtp_sharded", gtp_names), ("replicated", set(base["grads"]) - gtp_names)):
        num = sum(float(side["grads"][n].double().pow(2).sum()) for n in names) ** 0.5
        den = sum(float(base["grads"][n].double().pow(2).sum()) for n in names) ** 0.5
        out[kind] = num / den
    return out


def _extend(runs, results, summary):
    gtp_names = set(next(r["links"] for r in results if r["links"]))
    for run, side in zip(runs, results):
        entry = summary[side["label"]]
        entry["gtp_config_per_token_loss"] = _gtp_switch(run) if run.gtp > 1 else None
        entry["grad_ratio_vs_gtp_off"] = _ratios(results[0], side, gtp_names)


def main(argv=None):
    results = c.cli(__doc__, "calculate_per_token_loss: TransformerConfig vs GTP's config, TP1 x GTP2",
                    SIDES, 2, argv, extend=_extend)
    for label, s in results[0].items():
        ratio = ", ".join(f"{k} {v:.6f}" for k, v in s["grad_ratio_vs_gtp_off"].items())
        print(f"{label:>28}: GTP_CONFIG.calculate_per_token_loss={s['gtp_config_per_token_loss']}; "
              f"grad norm / first side: {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
