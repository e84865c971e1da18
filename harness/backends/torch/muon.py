"""The golden's Muon: megatron-core's ``TensorParallelMuon`` on whole logical matrices, in fp64.

emerging_optimizers' ``OrthogonalizedOptimizer`` runs the step (decoupled weight decay, the
EMA momentum ``momentum_buffer``, ``p -= lr * update``) as it does under megatron-core; the
update is the library's Newton-Schulz iteration (its coefficients and its
``newton_schulz_step``) on the whole matrix, scaled by its ``get_muon_scale_factor``, with the
fused QKV weight split into q, k and v as megatron-core splits it (per query group). The library's
``newton_schulz`` takes fp32 only; :func:`newton_schulz` is its driver (transpose to the wide
side, Frobenius normalization, the steps) in the input's dtype, checked bit for bit against
the library's in fp32 (tests/test_muon.py). Which params Muon steps and which fall back to
Adam is :func:`harness.common.muon.is_muon_matrix`, megatron-core's split.
"""

from __future__ import annotations

import torch
from emerging_optimizers.orthogonalized_optimizers import OrthogonalizedOptimizer, get_muon_scale_factor
from emerging_optimizers.orthogonalized_optimizers import muon_utils

from harness.common.muon import MUON

# Newton-Schulz normalizes by max(||X||_F, eps) (muon_utils.newton_schulz's default eps).
NS_EPS = 1e-7


def newton_schulz(x: torch.Tensor, steps: int, coefficient_type: str) -> torch.Tensor:
    """``emerging_optimizers.orthogonalized_optimizers.muon_utils.newton_schulz`` in ``x``'s dtype."""
    if coefficient_type != "quintic":  # the iterator mode below is quintic's (cycle)
        raise ValueError(f"the golden's Newton-Schulz runs quintic coefficients, got {coefficient_type!r}")
    transpose = x.size(-2) > x.size(-1)
    X = x.mT if transpose else x
    X = torch.nn.functional.normalize(X, p=2, dim=(-2, -1), eps=NS_EPS)
    coefficients = muon_utils._COEFFICIENT_SETS[coefficient_type]
    for a, b, c in muon_utils.get_coefficient_iterator(steps, coefficients, mode="cycle"):
        X = muon_utils.newton_schulz_step(X, a, b, c)
    return X.mT if transpose else X


def scaled_orthogonalize(grad: torch.Tensor) -> torch.Tensor:
    """Muon's update of one whole matrix: orthogonalized, times the scale of its shape."""
    orth = newton_schulz(grad, MUON["num_ns_steps"], MUON["coefficient_type"])
    scale = get_muon_scale_factor(grad.size(-2), grad.size(-1), mode=MUON["scale_mode"])
    return orth * scale * MUON["extra_scale_factor"]


class GoldenMuon(OrthogonalizedOptimizer):
    """Muon over whole matrices; ``qkv``: the fused QKV weights and their (q, k, v) rows per
    query group, orthogonalized apart as megatron-core's ``TensorParallelMuon.orthogonalize``.
    ``blocks`` > 1 (megatron-core's blockwise mode at TP = blocks): each part is orthogonalized
    in that many blocks along its TP dim (``tp_dims``, by param id; None: replicated, whole)."""

    def __init__(self, params, lr: float, weight_decay: float, qkv: dict[int, list[int]],
                 blocks: int = 1, tp_dims: dict[int, int | None] | None = None):
        self.qkv, self.blocks, self.tp_dims = qkv, blocks, tp_dims or {}
        super().__init__(params, lr, MUON["momentum"], weight_decay, nesterov=MUON["nesterov"],
                         weight_decay_method="decoupled", fp32_matmul_prec="highest",
                         scaled_orthogonalize_fn=scaled_orthogonalize)

    def orthogonalize(self, p: torch.Tensor, grad: torch.Tensor, **kwargs) -> torch.Tensor:
        shapes = self.qkv.get(id(p)) if MUON["split_qkv"] else None
        dim = self.tp_dims.get(id(p)) if self.blocks > 1 else None
        if shapes is None:
            return self._blockwise(grad, dim)
        groups = grad.shape[0] // sum(shapes)
        parts = torch.split(grad.view(groups, sum(shapes), -1), shapes, dim=1)
        done = [self._blockwise(g.reshape(-1, grad.shape[-1]), dim).view(groups, -1, grad.shape[-1])
                for g in parts]
        return torch.cat(done, dim=1).view(grad.shape)

    def _blockwise(self, grad: torch.Tensor, dim: int | None) -> torch.Tensor:
        """The TP blocks of ``grad`` orthogonalized apart (q, k or v of a QKV weight: its rows
        are in query-group order, so a TP block is whole query groups)."""
        if dim is None:
            return scaled_orthogonalize(grad)
        return torch.cat([scaled_orthogonalize(b) for b in grad.chunk(self.blocks, dim=dim)], dim=dim)


def qkv_split_shapes(model) -> list[int]:
    """Rows of q, k and v per query group (megatron-core ``_get_qkv_split_shapes``: the group's
    query heads, one key head, one value head)."""
    kv_channels = model.hidden_size // model.num_attention_heads
    per = model.num_attention_heads // (model.num_query_groups or model.num_attention_heads)
    return [per * kv_channels, kv_channels, kv_channels]


class Chained:
    """Muon for the matrices, AdamW for the rest: one optimizer to the golden's loop (its
    ``param_groups``, ``state``, ``step``, ``zero_grad``), as megatron-core chains the two."""

    def __init__(self, *parts: torch.optim.Optimizer):
        self.parts = [p for p in parts if p is not None]

    @property
    def param_groups(self) -> list[dict]:
        return [g for part in self.parts for g in part.param_groups]

    @property
    def state(self) -> dict:
        return {p: st for part in self.parts for p, st in part.state.items()}

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)
