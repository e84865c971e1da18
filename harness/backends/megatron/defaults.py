"""The tree's own defaults of the declared options, recorded in every megatron trace
(``info.tree_defaults``): a default that changed between two trees shows in the comparison,
whether the scenario pins the key (as ``muon_tp_mode``: the golden needs the mode) or leaves it
to the tree (a ``tree_default`` option, where the recorded default is the value that ran)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect

from harness.scenario.options import declared
from harness.scenario.schema import DataConfig, ModelConfig, Side

# Where each megatron-core class an option maps to lives.
_MODULES = {
    "TransformerConfig": "megatron.core.transformer.transformer_config",
    "DistributedDataParallelConfig": "megatron.core.distributed",
    "OptimizerConfig": "megatron.core.optimizer",
    "GPTModel": "megatron.core.models.gpt",
}
ABSENT = "(not in this tree)"


def _plain(value):
    return value if value is None or isinstance(value, (bool, int, float, str)) else repr(value)


def _default(cls, arg: str):
    if dataclasses.is_dataclass(cls):
        field = next((f for f in dataclasses.fields(cls) if f.name == arg), None)
        if field is None:
            return ABSENT
        if field.default is not dataclasses.MISSING:
            return _plain(field.default)
        if field.default_factory is not dataclasses.MISSING:
            return _plain(field.default_factory())
        return "(required)"
    method, _, arg = arg.rstrip(")").rpartition("(")  # ``forward(padding_mask)``: a method's argument
    func = getattr(cls, method or "__init__", None)
    param = None if func is None else inspect.signature(func).parameters.get(arg)
    if param is None:
        return ABSENT
    return "(required)" if param.default is inspect.Parameter.empty else _plain(param.default)


def tree_defaults(*objects: ModelConfig | DataConfig | Side) -> dict[str, dict]:
    """``{option: {"target": "Class.argument", "default": value, "left_to_tree": bool}}`` for
    every declared option of ``objects`` that reaches a megatron-core argument, as the imported
    tree declares its default; ``left_to_tree``: the side leaves it unset, so the default ran."""
    out = {}
    for obj in objects:
        for o in declared(type(obj)).values():
            for dest in o.mcore:
                target, _, arg = dest.partition(".")
                arg = arg.split(" (")[0]
                if target not in _MODULES:
                    continue
                owner = getattr(importlib.import_module(_MODULES[target]), target)
                out[o.name] = {"target": f"{target}.{arg}", "default": _default(owner, arg),
                               "left_to_tree": o.tree_default and getattr(obj, o.name) is None}
    return out
