"""Record the weight each GEMM reads under GTP: megatron-core's all-gathered weight.

The gather happens inside ``GTPShardedParam.all_gather_and_prefetch``; a wrapper (a run-time
patch, undone with the side's other patches) hands its forward output to the recorder.
"""

from __future__ import annotations

from typing import Callable

import torch

from harness.patching import patch


def record_gathers(named: list[tuple[str, torch.Tensor]], record: Callable[[str, torch.Tensor], None]) -> None:
    """Call ``record(name, gathered)`` on every forward all-gather of a parameter in ``named``."""
    from megatron.core.tensor_parallel.generalized_tensor_parallelism import GTPShardedParam

    names = {id(p): n for n, p in named}
    original = GTPShardedParam.all_gather_and_prefetch

    def all_gather_and_prefetch(self, fwd=True, nvtx_label=None):
        out = original(self, fwd=fwd, nvtx_label=nvtx_label)
        if fwd and id(self) in names:
            record(names[id(self)], out)
        return out

    patch(GTPShardedParam, "all_gather_and_prefetch", all_gather_and_prefetch)
