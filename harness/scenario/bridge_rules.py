"""The ``bridge`` backend's rules: what a Megatron-Bridge side may say, checked before launch.

What the side's Bridge tree supports (GTP needs the PR's ``training/gtp.py``) is checked once the
tree is resolved (:func:`harness.run.tree_checks.check_bridge_trees`, before anything launches); the
form of the keys here.
"""

from __future__ import annotations

from harness.common.errors import BadInput
from harness.scenario.schema import Scenario, Side
from harness.scenario.tree_specs import spec_problem


def validate_bridge(s: Scenario, side: Side, where: str) -> None:
    """``bridge`` belongs to bridge sides; a bridge side runs Bridge's dense GPT path."""
    if side.backend != "bridge":
        if side.bridge != "installed":
            raise BadInput(f"{where}.bridge", f"a key of the bridge backend, not {side.backend}")
        return
    if (problem := spec_problem(side.bridge)) is not None:
        raise BadInput(f"{where}.bridge", problem)
    if side.data not in ("synthetic", "mock"):
        raise BadInput(f"{where}.data", f"unknown data {side.data!r}; one of ['mock', 'synthetic']")
    other = s.candidate if side is s.reference else s.reference
    if side.data == "mock" and (other.backend not in ("mlm", "bridge") or other.data != "mock"):
        # Bridge's mock samples are not the synthetic ones: the sides would read different data.
        raise BadInput(f"{where}.data",
                       "a mock-data side is compared with another mlm or bridge side on mock data only")
    if side.eval_interval:
        raise BadInput(f"{where}.eval_interval",
                       "the bridge backend records no evaluation yet (eval_interval = 0)")
    if side.optimizer not in ("adam", "sgd"):
        raise BadInput(f"{where}.optimizer",
                       f"{side.optimizer!r}: the bridge backend runs Bridge's adam or sgd")
    if side.inject:
        raise BadInput(f"{where}.inject", "planted faults are not implemented by the bridge backend")
    if side.recipe != "none":
        raise BadInput(f"{where}.recipe", "recipes need Transformer Engine on the bridge backend")
    if side.gtp_pad_alignment != 16:  # configure_gtp_remat_from_recipe sets it, without FP8: 16
        raise BadInput(f"{where}.gtp_pad_alignment", "Bridge's GTP wiring pads GTP shards to 16 rows")
    if s.data.loss_mask != "none":
        raise BadInput(f"{s.source}: [data].loss_mask", "the bridge backend reads Bridge's own loss mask")
    if side.num_microbatches(s.data) < 1:
        raise BadInput(f"{s.source}: [data].global_batch_size", "fewer samples than data ranks")

