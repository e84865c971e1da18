"""The Muon hyper-parameters both backends use: the megatron backend hands them to
megatron-core's ``OptimizerConfig`` (``muon_*``), the golden (:mod:`harness.backends.torch.muon`)
computes with them. Written out here, not read from megatron-core's defaults, so a tree whose
defaults change (Megatron-LM main made ``muon_tp_mode`` default to ``duplicated``) still runs
the Muon the golden computes. The values are megatron-core 0.19.2's defaults."""

from __future__ import annotations

MUON = {
    "momentum": 0.95,  # EMA momentum: buf = momentum * buf + (1 - momentum) * grad
    "nesterov": False,
    "split_qkv": True,  # q, k and v of the fused QKV weight orthogonalized apart
    "scale_mode": "spectral",  # update scaled by sqrt(max(rows, cols))
    "coefficient_type": "quintic",
    "num_ns_steps": 5,
    "extra_scale_factor": 1.0,
    "fp32_matmul_prec": "medium",  # megatron-core's Newton-Schulz in bf16 (emerging_optimizers)
}


def optimizer_config_kwargs() -> dict:
    """``OptimizerConfig`` keywords of :data:`MUON`."""
    return {f"muon_{k}": v for k, v in MUON.items()}


def is_muon_matrix(name: str, ndim: int) -> bool:
    """Whether megatron-core's Muon steps this parameter (else its scalar optimizer, Adam):
    megatron-core 0.19.2 ``emerging_optimizers._is_nonlinear_or_embedding`` sends params tagged
    ``is_embedding_or_output_parameter`` (the word embedding and the output layer, by
    ``LanguageModule``) and every non-2-D param to Adam. The position embedding is untagged
    and 2-D: Muon steps it."""
    if ndim != 2:
        return False
    return not name.endswith(("embedding.word_embeddings.weight", "output_layer.weight"))


def stepped_by(opt, named) -> dict[str, str]:
    """Which optimizer steps each parameter: ``muon`` (an emerging_optimizers orthogonalized
    optimizer) or the torch optimizer's class name, across megatron-core's chained wrappers
    (their fp32 masters stand for bf16 params) and the golden's :class:`Chained`."""
    parts = getattr(opt, "chained_optimizers", None) or getattr(opt, "parts", None) or [opt]
    owner = {}
    for part in parts:
        inner = getattr(part, "optimizer", part)
        kind = "muon" if hasattr(inner, "scaled_orthogonalize_fn") else type(inner).__name__.lower()
        masters = {id(p32): id(p16) for g16, g32 in zip(getattr(part, "float16_groups", []),
                                                       getattr(part, "fp32_from_float16_groups", []))
                   for p16, p32 in zip(g16, g32)}
        for group in inner.param_groups:
            for p in group["params"]:
                owner[masters.get(id(p), id(p))] = kind
    return {name: owner.get(id(p), "none") for name, p in named}
