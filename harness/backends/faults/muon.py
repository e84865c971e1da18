"""The planted fault of Muon under GTP (:data:`harness.scenario.faults.MUON_FAULTS`): a run-time
patch of megatron-core's ``TensorParallelMuon``, undone with the side's other patches."""

from __future__ import annotations

import copy

from harness.backends.patching import patch


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


MUON_INSTALLERS = {"muon-gtp-gather-tp-group": _gather_over_tp_group}
