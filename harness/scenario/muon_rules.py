"""The rules of Muon sides (``optimizer = "muon"``), checked before anything is launched: each
is megatron-core's own constraint (file and check named) or a limit of what the harness covers,
said as such."""

from __future__ import annotations

from importlib.util import find_spec

from harness.common.errors import BadInput
from harness.scenario.schema import Scenario, Side


def validate_muon_side(s: Scenario, side: Side, where: str) -> None:
    if side.muon_blocks > 1 and (side.backend != "torch" or side.optimizer != "muon"):
        raise BadInput(f"{where}.muon_blocks",
                       "the golden's blockwise Muon: a torch side with optimizer = \"muon\"")
    if side.optimizer != "muon":
        return  # muon_tp_mode's declaration refuses it without Muon
    if find_spec("emerging_optimizers") is None:
        # megatron-core 0.19.2 optimizer/__init__.py: _get_megatron_emerging_optimizer raises ImportError.
        raise BadInput(f"{where}.optimizer",
                       "muon needs the emerging-optimizers package (pinned in pyproject.toml)")
    if side.backend == "mlm":
        raise BadInput(f"{where}.optimizer",
                       "muon runs on the megatron backend; the mlm backend does not pass "
                                             "Muon's options to Megatron-LM's loop")
    if side.backend == "torch" and (side.world_size > 1 or side.recipe != "none" or side.precision == "bf16"):
        raise BadInput(f"{where}.optimizer",
                       "the torch backend runs Muon on its single-process golden path only "
                                             "(world_size 1, no recipe, fp32 or fp64)")
    for key in ("hidden_size", "ffn_hidden_size", "num_attention_heads"):
        if getattr(s.model, key) % side.muon_blocks:
            raise BadInput(f"{where}.muon_blocks", f"{side.muon_blocks} blocks must divide [model].{key}")
    if s.model.num_experts:
        raise BadInput(f"{where}.optimizer",
                       "muon with routed experts is not covered: the golden's Muon is not "
                                             "checked against megatron-core's expert-parallel Muon groups")
