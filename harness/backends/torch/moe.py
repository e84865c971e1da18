"""The golden MoE layer: megatron-core's MoE (local spec, ``aux_loss`` load balancing) in plain
PyTorch, full tensors, one process.

Same math as ``MoELayer`` with ``TopKRouter``, ``SequentialMLP`` and ``SharedExpertMLP`` in
megatron-core 0.19.2 (``moe_utils.topk_routing_with_score_function``, ``group_limited_topk``,
``compute_routing_scores_for_aux_loss``, ``switch_load_balancing_loss_func``,
``MLP.forward(per_token_scale=)``):

- router logits = x W_r^T (in the input's dtype). Score ``softmax``: each token goes to the top-k
  experts by logit (``torch.topk``, as megatron-core), weighted by the softmax over those k logits;
  ``sigmoid``: to the top-k by sigmoid(logit), weighted by those k sigmoids over their sum (+ 1e-20;
  k = 1: the sigmoid itself). Group-limited (``moe_router_group_topk``): the E experts in G groups
  of consecutive indices, a group's score the sum of its top (k / group_topk) scores (the logits
  under softmax), the token's top-k taken among its group_topk best groups;
- expert e computes ``fc2(act(fc1(x)) * p)`` on its tokens (gated: ``act(gate) * up`` of fc1's
  ``[gate; up]``); outputs are summed per token; the shared experts' MLP (every token) is added;
- load-balancing loss per micro-batch u of T tokens:
  ``E * coeff / (k * T^2) * sum_i tokens_i * sum_t score_t,i`` with megatron-core's aux scores
  (softmax over all logits, or the sigmoids normalized over all experts) and its own top-k of
  them (never group-limited; token counts carry no gradient). megatron-core computes it per
  micro-batch and scales its gradient by 1 / micro-batches, then averages over data ranks: the
  golden adds the mean over the global batch's micro-batches (``micro_batch_size`` samples each)
  to the loss it differentiates (:attr:`MoE.aux_loss`). Under a variable loss mask (per-token loss)
  the sum of each micro-batch's value times its token count over the global loss-token count; with
  ``moe_router_padding_mask`` the tokens the mask drops score and count 0 and T is the kept tokens.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from harness.scenario.schema import ModelConfig


class Router(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(m.num_experts, m.hidden_size))


class Experts(nn.Module):
    def __init__(self, m: ModelConfig, mlp: type):
        super().__init__()
        self.local_experts = nn.ModuleList(mlp(m) for _ in range(m.num_experts))


def activate(mlp: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """An MLP's activation of its fc1 output (gated: ``act(gate) * up``, megatron-core's ``glu``)."""
    if mlp.gated:
        gate, up = torch.chunk(y, 2, dim=-1)
        return mlp.act(gate) * up
    return mlp.act(y)


class MoE(nn.Module):
    """Returns [s, b, h]; after a forward, ``aux_loss`` (the mean over micro-batches),
    ``aux_per_sample`` [b] (each sample's micro-batch value), ``logits`` and ``routing_map``
    ([s * b, E], tokens in [s, b] order) hold what the step records."""

    def __init__(self, m: ModelConfig, mlp: type):
        super().__init__()
        self.router = Router(m)
        self.experts = Experts(m, mlp)
        if shared := m.moe_shared_expert_intermediate_size:
            self.shared_experts = mlp(replace(m, ffn_hidden_size=shared))
        self.topk, self.coeff, self.num_experts = m.moe_topk, m.moe_aux_loss_coeff, m.num_experts
        self.sigmoid = m.moe_router_score_function == "sigmoid"
        self.groups, self.group_topk = m.moe_router_num_groups, m.moe_router_group_topk
        self.micro_batch_size = 1
        """Samples per micro-batch: the load-balancing loss's token set (set by the golden run)."""
        self.kept: torch.Tensor | None = None
        """[b, s] the loss mask of a variable-mask step (set by the golden run), else None."""
        self.padding_mask = m.moe_router_padding_mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)
        logits = F.linear(tokens, self.router.weight)
        probs, top = self.route(logits)
        self.logits = logits
        self.routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)
        self._load_balancing(logits.view(s, b, -1))
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts.local_experts):
            rows, slot = (top == e).nonzero(as_tuple=True)
            if rows.numel():
                hidden = activate(expert, expert.linear_fc1(tokens[rows])) * probs[rows, slot].unsqueeze(-1)
                out = out.index_add(0, rows, expert.linear_fc2(hidden))
        out = out.view(s, b, h)
        return out + self.shared_experts(x) if hasattr(self, "shared_experts") else out

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's k weights and experts [T, k] (``topk_routing_with_score_function``)."""
        if not self.sigmoid:
            top_logits, top = self._topk(logits)
            return torch.softmax(top_logits, dim=-1), top
        top_scores, top = self._topk(torch.sigmoid(logits))
        if self.topk == 1:
            return top_scores, top
        return top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20), top

    def _topk(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.group_topk:
            return torch.topk(scores, k=self.topk, dim=1)
        t, g = scores.shape[0], self.groups
        by_group = scores.view(t, g, -1).topk(self.topk // self.group_topk, dim=-1)[0].sum(dim=-1)
        chosen = torch.topk(by_group, k=self.group_topk, dim=-1, sorted=False)[1]
        allowed = torch.zeros_like(by_group, dtype=torch.bool).scatter(1, chosen, True)
        allowed = allowed.unsqueeze(-1).expand(t, g, self.num_experts // g).reshape(t, -1)
        return torch.topk(scores.masked_fill(~allowed, float("-inf")), k=self.topk, dim=-1)

    def _load_balancing(self, logits: torch.Tensor) -> None:
        s, b, _ = logits.shape
        mbs = self.micro_batch_size
        if self.sigmoid:  # compute_routing_scores_for_aux_loss
            scores = torch.sigmoid(logits)
            scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            scores = torch.softmax(logits, dim=-1)
        top = torch.topk(scores, k=self.topk, dim=-1)[1]  # its own top-k: never group-limited
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, top, True)
        kept = torch.ones(s, b, 1, dtype=torch.bool) if self.kept is None else self.kept.T.bool()[..., None]
        if self.padding_mask:  # compute_routing_scores_for_aux_loss: dropped tokens score and count 0
            scores, routing_map = scores * kept, routing_map & kept
        values, tokens = [], []
        for u in range(0, b, mbs):
            chosen = routing_map[:, u:u + mbs].reshape(-1, self.num_experts)
            sc = scores[:, u:u + mbs].reshape(-1, self.num_experts)
            # the token total: the kept tokens' (a tensor, get_tokens_per_expert_and_token_count) or all
            t = kept[:, u:u + mbs].sum().to(sc.dtype) if self.padding_mask else sc.shape[0]
            counts = chosen.sum(0).to(sc.dtype)
            values.append((sc.sum(0) * counts).sum() * (self.num_experts * self.coeff / (self.topk * t * t)))
            tokens.append(t)
        stacked = torch.stack(values)
        self.aux_loss = stacked.mean() if self.kept is None else self._weighted(stacked, tokens)
        self.aux_per_sample = stacked.repeat_interleave(mbs)[:b]

    def _weighted(self, values: torch.Tensor, tokens: list) -> torch.Tensor:
        """Under per-token loss (a variable mask's) megatron-core attaches each micro-batch's value times
        its token count t_u (attach_and_log_load_balancing_loss: valid_token_count, the kept tokens with a
        padding mask, else all) and finalize_model_grads divides every grad by the global loss-token
        count: sum_u t_u aux_u / sum of the loss mask."""
        counts = torch.stack([torch.as_tensor(t, dtype=values.dtype) for t in tokens])
        return (values * counts).sum() / self.kept.sum()
