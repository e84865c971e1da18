"""[model].preset: a family's switches at tiny sizes, under the keys a scenario sets itself."""

from __future__ import annotations

import dataclasses
import textwrap
from typing import get_args

import pytest

from harness import scenario
from harness.common.errors import BadInput
from harness.scenario.choices import Preset
from harness.scenario.presets import PRESETS
from harness.scenario.schema import ModelConfig

SCENARIO = """
name = "p"
[model]
{model}
[data]
global_batch_size = 2
[train]
world_size = 1
steps = 2
[reference]
[candidate]
"""


def _load(tmp_path, model: str) -> scenario.Scenario:
    path = tmp_path / "p.toml"
    path.write_text(textwrap.dedent(SCENARIO.format(model=model)))
    return scenario.load(path)[0]


def test_every_choice_has_a_preset_of_declared_keys():
    assert set(PRESETS) == set(get_args(Preset))
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    for name, keys in PRESETS.items():
        assert set(keys) <= fields - {"preset"}, (name, set(keys) - fields)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_preset_alone_is_a_valid_model_with_its_switches(tmp_path, name):
    m = _load(tmp_path, f'preset = "{name}"').model
    assert m.preset == name
    for key, value in PRESETS[name].items():
        assert getattr(m, key) == value, (name, key)


def test_a_key_beside_the_preset_overrides_it(tmp_path):
    m = _load(tmp_path, 'preset = "qwen"\nuntie_embeddings = true\nffn_hidden_size = 96').model
    assert (m.untie_embeddings, m.ffn_hidden_size) == (True, 96)
    assert (m.add_qkv_bias, m.normalization, m.rotary_base) == (True, "RMSNorm", 1000000)  # the rest: qwen's


def test_an_unknown_preset_names_the_choices(tmp_path):
    with pytest.raises(BadInput, match=r"\[model\]\.preset") as e:
        _load(tmp_path, 'preset = "falcon"')
    assert "'llama'" in str(e.value) and "'falcon'" in str(e.value)
