"""The choices of the scenario keys that take one of a few names, as ``Literal`` types: the
declarations (:mod:`harness.scenario.options`) read each key's choices from its type."""

from __future__ import annotations

from typing import Literal, get_args

Backend = Literal["megatron", "torch", "mlm", "bridge"]
Precision = Literal["fp64", "fp32", "bf16"]
# "none" or a key of harness.quant.RECIPES (kept literal here: parsing needs no torch).
Recipe = Literal["none", "delayed", "float8_current_scaling", "mxfp8", "float8_block_scaling", "nvfp4"]
Optimizer = Literal["adam", "sgd", "muon"]
# megatron-core's Muon ``tp_mode``: how a TP- (and GTP-) sharded matrix is orthogonalized.
MuonTpMode = Literal["blockwise", "duplicated", "distributed"]
DecayStyle = Literal["constant", "linear", "cosine"]
Recompute = Literal["none", "selective", "full"]
PerTokenLoss = Literal["none", "transformer-config", "both"]
Collectives = Literal["async", "eager", "lagging"]
LossMask = Literal["none", "variable"]
# The MLP's activation: swiglu and geglu gate it (a gated linear unit), the others are plain.
Activation = Literal["gelu", "swiglu", "geglu", "relu", "squared_relu"]
GATED = frozenset({"swiglu", "geglu"})
Normalization = Literal["LayerNorm", "RMSNorm"]
PositionEmbedding = Literal["learned_absolute", "rope", "none"]
# A model family's switches at tiny sizes (harness.scenario.presets).
Preset = Literal["gpt", "llama", "qwen", "mixtral", "deepseek"]
# The MoE router's score function (megatron-core's moe_router_score_function; sqrtsoftplus not covered).
RouterScore = Literal["softmax", "sigmoid"]
# megatron-core's TransformerConfig.softmax_type: the attention softmax, with an extra logit or not.
SoftmaxType = Literal["vanilla", "off-by-one", "learnable"]
ProcessGroups = Literal["parallel-state", "collection", "collection-permuted"]
# The mlm and bridge backends' data: the frontend's --mock-data pipeline, or the harness's samples.
MlmData = Literal["synthetic", "mock"]

BACKENDS = frozenset(get_args(Backend))
# The precisions each backend computes in (a rule between two keys, not a choice of one).
PRECISIONS = {"megatron": frozenset({"fp32", "bf16"}), "torch": frozenset(get_args(Precision)),
              "mlm": frozenset({"fp32", "bf16"}), "bridge": frozenset({"fp32", "bf16"})}
RECIPE_NAMES = frozenset(get_args(Recipe))
