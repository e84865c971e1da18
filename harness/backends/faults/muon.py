"""The planted fault of Muon under GTP (:data:`harness.scenario.faults.MUON_FAULTS`): a run-time
patch of megatron-core's ``TensorParallelMuon``, undone with the side's other patches."""

from __future__ import annotations

import copy
import math

from harness.backends.patching import patch

# The weight whose update the scale fault scales, and by how much: GTP's alignment padding counted
# in Muon's spectral scale, as a matrix of 80 real rows padded to 96 would have it.
SCALED_WEIGHT = "decoder.layers.0.mlp.linear_fc1.weight"
PADDED_SCALE = math.sqrt(96 / 80)


def _gather_over_tp_group(ctx) -> None:
    # Muon's GTP all-gather of a sharded momentum (and its reshard) runs over the TP group, as a
    # process-group collection with the wrong member in ``gtp_remat`` would make it: at TP = G
    # a group of the right size whose members hold other rows of other TP blocks.
    from megatron.core.optimizer import emerging_optimizers

    cls = emerging_optimizers.TensorParallelMuon
    original = cls.scaled_orthogonalize_fn_with_gtp_remat

    def over_tp_group(self, p, grad, tp_group, partition_dim):
        right = self.pg_collection
        wrong = copy.copy(right)
        wrong.gtp_remat = right.tp
        self.pg_collection = wrong
        try:
            return original(self, p, grad, tp_group, partition_dim)
        finally:
            self.pg_collection = right

    patch(cls, "scaled_orthogonalize_fn_with_gtp_remat", over_tp_group)


def _update_scaled_as_padded(ctx) -> None:
    # One weight's orthogonalized update scaled by sqrt(96 / 80): Muon's spectral scale taken from
    # a padded shape (the upstream bug class of GTP's alignment rows counted in Newton-Schulz).
    from megatron.core.optimizer import emerging_optimizers

    target = dict(ctx.named_params)[SCALED_WEIGHT]
    cls = emerging_optimizers.TensorParallelMuon
    original = cls.scaled_orthogonalize_fn_with_gtp_remat

    def scaled(self, p, grad, tp_group, partition_dim):
        out = original(self, p, grad, tp_group, partition_dim)
        return out * PADDED_SCALE if p is target else out

    patch(cls, "scaled_orthogonalize_fn_with_gtp_remat", scaled)


MUON_INSTALLERS = {"muon-gtp-gather-tp-group": _gather_over_tp_group,
                   "muon-update-padded-scale": _update_scaled_as_padded}
