"""The rules of evaluating sides (``eval_interval`` > 0), checked before anything is launched:
every side evaluates alike (the golden too: it computes the evaluation's losses on the same
samples), and what each backend's evaluation covers, said as a limit of the harness where it
is one.
"""

from __future__ import annotations

from harness.common.errors import BadInput
from harness.scenario.schema import Scenario, Side



def validate_eval(s: Scenario) -> None:
    sides = s.sides
    alike = {name: (side.eval_interval, side.eval_iters) for name, side in sides.items()}
    if len(set(alike.values())) != 1:
        raise BadInput(f"{s.source}: eval_interval", f"every side must evaluate alike (eval_interval, "
                                                     f"eval_iters), got {alike}: set them in [train]")
    for name, side in sides.items():
        if side.eval_interval:
            _validate_evaluating(s, name, side, f"{s.source}: [{name}]")


def _validate_evaluating(s: Scenario, name: str, side: Side, where: str) -> None:
    if side.backend == "torch" and name != "golden":
        raise BadInput(f"{where}.eval_interval",
                       "the torch backend evaluates on its single-process golden side only")
    if side.backend == "mlm" and side.data == "mock":
        raise BadInput(f"{where}.eval_interval",
                       "evaluation reads the synthetic validation samples (data = \"synthetic\")")
    if getattr(s.model, "mtp_num_layers", 0):
        raise BadInput(f"{where}.eval_interval",
                       "the harness evaluates models without multi-token prediction "
                                                 "(mtp_num_layers = 0)")
    if side.pipeline_parallel > 1:
        raise BadInput(f"{where}.eval_interval",
                       "the harness evaluates without pipeline stages (pipeline_parallel = 1)")
    if side.save_step or side.load_step:
        raise BadInput(f"{where}.eval_interval",
                       "the harness evaluates in plain runs, not around a checkpoint")
    if side.overlap_param_gather:
        # Megatron-LM's train() disables the param-gather pre-hooks around an evaluation (a
        # forced param sync); the harness's loop does not.
        raise BadInput(f"{where}.eval_interval", "not with overlap_param_gather (the harness's loop does "
                                                 "not sync the params before an evaluation as Megatron-LM's "
                                                 "does)")
