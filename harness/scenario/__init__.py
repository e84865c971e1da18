"""Stage 1, scenario: TOML files -> validated :class:`Scenario` dataclasses.

The schema (:mod:`.schema`), parsing (:mod:`.parse`), the rules between keys (:mod:`.rules`,
:mod:`.moe_rules`), ``[matrix]`` expansion (:mod:`.matrix`), ``[checkpoint]`` expansion
(:mod:`.checkpoint`), the planted-fault catalog (:mod:`.faults`) and planting faults into
scenarios (:mod:`.planting`). Nothing here imports torch.
"""

from harness.scenario.parse import load, parse_scenario
from harness.scenario.schema import (
    COMPARED_ROLES, POLICIES, CapturePolicy, ComparePolicy, DataConfig, KnownDivergence, ModelConfig, Role,
        Scenario, Side,
    check_scenario_name,
)

__all__ = [
    "COMPARED_ROLES", "POLICIES", "CapturePolicy", "ComparePolicy", "DataConfig", "KnownDivergence",
        "ModelConfig", "Role",
    "Scenario", "Side", "check_scenario_name", "load", "parse_scenario",
]
