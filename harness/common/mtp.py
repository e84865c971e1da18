"""Multi-token prediction (MTP): the names every stage uses for its depths and shared weights.

megatron-core's MTP block (``MultiTokenPredictionBlock``) predicts the token ``d + 1`` places
ahead at depth ``d`` (0-based) by re-embedding the input shifted by ``d + 1`` with the main
embedding, mixing it with the previous depth's hidden states (``eh_proj``), running one
transformer layer and the main output layer. So the word and position embeddings and the
output layer are consumed ``1 + D`` times per forward, and under ``mtp_use_repeated_layer``
one MTP layer (``mtp.layers.0``) is applied at every depth. These are the *shared* weights.

Activations of the MTP block are named per depth, whatever layer object computed them:
``mtp.layers.{d}.<module>``; depth ``d``'s logits are ``mtp.layers.{d}.output_layer`` and its
per-sample loss ``mtp.layers.{d}.loss`` (kind :data:`LOSS_KIND`).
"""

from __future__ import annotations

import fnmatch

LOSS_KIND = "mtp_loss"
"""The capture kind of an MTP depth's per-sample loss (its family is ``loss``)."""

# The modules of one MTP layer whose outputs are captured, in forward order (eh_proj's output
# is TP-sharded on its last dim and not captured; its consumer mtp_model_layer's input is).
LAYER_MODULES = ("enorm", "hnorm", "mtp_model_layer.input_layernorm", "mtp_model_layer.self_attention",
                 "mtp_model_layer.pre_mlp_layernorm", "mtp_model_layer.mlp", "mtp_model_layer",
                 "final_layernorm")
ALWAYS_SHARED = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
                 "output_layer.weight")


def depth_name(depth: int, module: str = "") -> str:
    """The captured name of depth ``depth``'s output of ``module`` (``""``: the MTP layer)."""
    return f"mtp.layers.{depth}" + (f".{module}" if module else "")


def loss_name(depth: int) -> str:
    return depth_name(depth, "loss")


def logits_name(depth: int) -> str:
    return depth_name(depth, "output_layer")


def shared_weights(mtp_num_layers: int, repeated: bool, tied: bool = False) -> tuple[str, ...]:
    """fnmatch patterns of the parameters used more than once per forward (none without MTP or a
    tied output layer, which computes with the word embedding's parameter)."""
    if not mtp_num_layers:
        return ("embedding.word_embeddings.weight",) if tied else ()
    return ALWAYS_SHARED + (("mtp.layers.0.*",) if repeated and mtp_num_layers > 1 else ())


def is_shared(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


# The weights GTP shards (a shared one among them is gathered and reduce-scattered per use).
GTP_SHARDED = ("word_embeddings.weight", "linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight",
               "linear_fc2.weight", "eh_proj.weight", "output_layer.weight")


def gtp_shared(name: str, patterns: tuple[str, ...]) -> bool:
    """A shared weight GTP shards: under GTP each of its uses has a wgrad reduce-scatter of its own."""
    return is_shared(name, patterns) and name.endswith(GTP_SHARDED)


def manifest_config(model) -> dict:
    """What a trace's ``config`` records of the weights used twice: MTP, a tied output layer (nothing
    without them: older traces read alike)."""
    out = {} if getattr(model, "untie_embeddings", True) else {"tied_embeddings": True}
    if not getattr(model, "mtp_num_layers", 0):
        return out
    return {**out, "mtp_num_layers": model.mtp_num_layers,
            "mtp_use_repeated_layer": model.mtp_use_repeated_layer}


def shared_of_config(cfg: dict | None) -> tuple[str, ...]:
    """:func:`shared_weights` of a trace's recorded ``config``."""
    cfg = cfg or {}
    return shared_weights(int(cfg.get("mtp_num_layers", 0)), bool(cfg.get("mtp_use_repeated_layer", False)),
                          bool(cfg.get("tied_embeddings", False)))
