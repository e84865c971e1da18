"""The golden MoE layer: megatron-core's MoE (local spec, ``aux_loss`` load balancing) in plain
PyTorch, full tensors, one process.

Same math as ``MoELayer`` with ``TopKRouter`` and ``SequentialMLP`` in megatron-core 0.19.2
(``moe_utils.topk_routing_with_score_function``, ``switch_load_balancing_loss_func``,
``MLP.forward(per_token_scale=)``):

- router logits = x W_r^T (in the input's dtype); each token goes to the top-k experts by
  logit (``torch.topk``, as megatron-core), weighted by the softmax over those k logits;
- expert e computes ``fc2(gelu(fc1(x)) * p)`` on its tokens; outputs are summed per token;
- load-balancing loss per micro-batch u of T tokens:
  ``E * coeff / (k * T^2) * sum_i tokens_i * sum_t softmax(logits_t)_i`` (token counts carry no
  gradient). megatron-core computes it per micro-batch and scales its gradient by
  1 / micro-batches, then averages over data ranks: the golden adds the mean over the
  global batch's micro-batches (``micro_batch_size`` samples each) to the loss it
  differentiates (:attr:`MoE.aux_loss`).
"""

from __future__ import annotations

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


class MoE(nn.Module):
    """Returns [s, b, h]; after a forward, ``aux_loss`` (the mean over micro-batches),
    ``aux_per_sample`` [b] (each sample's micro-batch value), ``logits`` and ``routing_map``
    ([s * b, E], tokens in [s, b] order) hold what the step records."""

    def __init__(self, m: ModelConfig, mlp: type):
        super().__init__()
        self.router = Router(m)
        self.experts = Experts(m, mlp)
        self.topk, self.coeff, self.num_experts = m.moe_topk, m.moe_aux_loss_coeff, m.num_experts
        self.micro_batch_size = 1
        """Samples per micro-batch: the load-balancing loss's token set (set by the golden run)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)
        logits = F.linear(tokens, self.router.weight)
        top_logits, top = torch.topk(logits, k=self.topk, dim=1)
        probs = torch.softmax(top_logits, dim=-1)
        self.logits = logits
        self.routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)
        self._load_balancing(logits.view(s, b, -1), self.routing_map.view(s, b, -1))
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts.local_experts):
            rows, slot = (top == e).nonzero(as_tuple=True)
            if rows.numel():
                hidden = F.gelu(expert.linear_fc1(tokens[rows])) * probs[rows, slot].unsqueeze(-1)
                out = out.index_add(0, rows, expert.linear_fc2(hidden))
        return out.view(s, b, h)

    def _load_balancing(self, logits: torch.Tensor, routing_map: torch.Tensor) -> None:
        s, b, _ = logits.shape
        mbs = self.micro_batch_size
        scores = torch.softmax(logits, dim=-1)
        values = []
        for u in range(0, b, mbs):
            chosen = routing_map[:, u:u + mbs].reshape(-1, self.num_experts)
            sc = scores[:, u:u + mbs].reshape(-1, self.num_experts)
            t = sc.shape[0]
            counts = chosen.sum(0).to(sc.dtype)
            values.append((sc.sum(0) * counts).sum() * (self.num_experts * self.coeff / (self.topk * t * t)))
        stacked = torch.stack(values)
        self.aux_loss = stacked.mean()
        self.aux_per_sample = stacked.repeat_interleave(mbs)[:b]
