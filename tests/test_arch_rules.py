"""Bad inputs of the architecture switches of [model] (harness/scenario/arch_rules.py and the keys'
declarations): each is one clear line naming the key and the rule, exit 2, at ``validate`` and at
``run`` before anything launches (the same check as tests/test_bad_inputs.py's scenarios)."""

from __future__ import annotations

import pytest

from tests import test_bad_inputs
from tests.test_bad_inputs import edit

CASES = [
    ("bias-and-qkv-bias", edit("model", "add_bias_linear = true\nadd_qkv_bias = true"),
     "[model].add_qkv_bias", "already gives the fused QKV projection its bias"),
    ("bias-with-experts", edit("model", "add_bias_linear = true\nnum_experts = 4"), "[model].add_bias_linear",
     "routed experts with linear biases"),
    ("bias-flag-in-mlm-args", edit("candidate", 'backend = "mlm"\nargs = ["--disable-bias-linear"]'),
     "[candidate].args", "what the key [model].add_bias_linear sets"),
    ("geglu-on-mlm", edit("model", 'activation = "geglu"', text=edit("candidate", 'backend = "mlm"')),
     "[model].activation", "Megatron-LM's flags reach gelu, swiglu, squared_relu only"),
    ("swiglu-with-muon", edit("model", 'activation = "swiglu"', text=edit("train", 'optimizer = "muon"')),
     "[reference].optimizer", "Muon with a gated MLP"),
    ("activation-unknown", edit("model", 'activation = "tanh"'), "[model].activation", "unknown activation"),
    ("squared-relu-flag-in-mlm-args", edit("candidate", 'backend = "mlm"\nargs = ["--squared-relu"]'),
     "[candidate].args", "[model].activation = \"squared_relu\""),
    ("normalization-unknown", edit("model", 'normalization = "L2Norm"'), "[model].normalization",
     "unknown normalization"),
    ("normalization-flag-in-mlm-args",
     edit("candidate", 'backend = "mlm"\nargs = ["--normalization=RMSNorm"]'), "[candidate].args",
     "what the key [model].normalization sets"),
    ("rotary-percent-without-rope", edit("model", "rotary_percent = 0.5"), "[model].rotary_percent",
     "only with position_embedding_type"),
    ("rotary-dim-odd", edit("model", 'position_embedding_type = "rope"\nrotary_percent = 0.2'),
     "[model].rotary_percent", "must be even"),
    ("rope-with-mtp", edit("model", 'position_embedding_type = "rope"\nmtp_num_layers = 1'),
     "[model].position_embedding_type", "MTP is covered with learned absolute positions only"),
    ("rotary-base-flag-in-mlm-args", edit("candidate", 'backend = "mlm"\nargs = ["--rotary-base", "100"]'),
     "[candidate].args", "what the key [model].rotary_base sets"),
    ("query-groups-not-dividing-heads", edit("model", "num_query_groups = 3"), "[model].num_query_groups",
     "must divide num_attention_heads"),
    ("query-groups-fewer-than-tp", edit("model", "num_query_groups = 1", text=edit("train", "tp = 2")),
     "[reference].tp", "not covered yet"),
    ("query-groups-flag-in-mlm-args",
     edit("candidate", 'backend = "mlm"\nargs = ["--num-query-groups", "2"]'), "[candidate].args",
     "what the key [model].num_query_groups sets"),
    ("qkv-bias-flag-in-mlm-args", edit("candidate", 'backend = "mlm"\nargs = ["--add-qkv-bias"]'),
     "[candidate].args", "what the key [model].add_qkv_bias sets"),
    ("softmax-type-unknown", edit("model", 'softmax_type = "sparsemax"'), "[model].softmax_type",
     "unknown softmax_type"),
    ("softmax-type-on-bridge",
     edit("model", 'softmax_type = "off-by-one"', text=edit("candidate", 'backend = "bridge"')),
     "[candidate].backend", "only the megatron, mlm, torch backends take [model].softmax_type"),
    ("qk-layernorm-flag-in-mlm-args", edit("candidate", 'backend = "mlm"\nargs = ["--qk-layernorm"]'),
     "[candidate].args", "what the key [model].qk_layernorm sets"),
    ("softmax-type-flag-in-mlm-args",
     edit("candidate", 'backend = "mlm"\nargs = ["--softmax-type=learnable"]'), "[candidate].args",
     "what the key [model].softmax_type sets"),
]


@pytest.mark.parametrize(("text", "where", "rule"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_architecture(tmp_path, capsys, text, where, rule):
    test_bad_inputs.test_bad_scenario(tmp_path, capsys, text, where, rule)
