"""The GPT of megatron-core's local layer spec, in plain PyTorch, with MCore's parameter names.

Same math as ``GPTModel`` with ``get_gpt_layer_local_spec()``: positions learned, rotary or none,
pre-norm blocks (LayerNorm or RMSNorm), fused QKV with rows ordered per query group (q, k, v per
head here), per-head query and key norms where ``qk_layernorm`` says, softmax((q k^T) / sqrt(d_head))
with the causal mask filled with -10000 in fp32 (and a sink logit per head where ``softmax_type``
says), the MLP's activation (gated or plain) as ``[model].activation`` says, linear biases where
``add_bias_linear`` / ``add_qkv_bias`` say, the output layer untied or tied to the word embedding
(``untie_embeddings``), hidden states laid out [s, b, h];
and megatron-core's multi-token prediction block (:class:`MTPBlock`) where the model has one.

In one process every layer is plain ``F.linear`` / ``F.embedding`` on the full weights (the
golden model). Distributed, the model is built with its TP-local head count and a
:class:`harness.backends.torch.parallel.Parallel` context is attached to the linear layers and
the word embedding (``module.parallel``): it owns their GEMMs and lookups, with the TP and GTP
communication and the FP8 quantization around them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from harness.scenario.arch_rules import qkv_rows
from harness.scenario.schema import GATED, ModelConfig
from harness.scenario.vocab_rules import padded_vocab_size

from .moe import MoE

LAYERNORM_EPS = 1e-5


def norm(m: ModelConfig, size: int | None = None) -> nn.Module:
    """One of the model's norms over ``size`` channels (the hidden size unless given), as
    megatron-core's ``WrappedTorchNorm`` builds it: torch's own."""
    cls = nn.RMSNorm if m.normalization == "RMSNorm" else nn.LayerNorm
    return cls(size or m.hidden_size, eps=LAYERNORM_EPS)


class CoreAttention(nn.Module):
    """The softmax of megatron-core's ``DotProductAttention`` (``softmax_type``): plain, or
    ``SoftmaxOne``'s: a sink logit per head appended to each row of the masked fp32 scores, the
    softmax over sk + 1, the sink's column dropped. ``off-by-one``: the sink is 0; ``learnable``:
    ``softmax_offset``, one per head of this TP rank."""

    def __init__(self, m: ModelConfig, heads: int):
        super().__init__()
        self.softmax_type, self.heads = m.softmax_type, heads
        if m.softmax_type == "learnable":
            self.softmax_offset = nn.Parameter(torch.empty(heads))

    def softmax(self, scores: torch.Tensor) -> torch.Tensor:
        if self.softmax_type == "vanilla":
            return torch.softmax(scores, dim=-1)
        offset = self.softmax_offset if self.softmax_type == "learnable" else torch.zeros(self.heads)
        b, _, sq, _ = scores.shape
        sink = offset.to(scores.dtype).reshape(1, -1, 1, 1).expand(b, -1, sq, -1)  # [b, np, sq, 1]
        return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


class Linear(nn.Module):
    """A linear layer: ``F.linear`` alone, or the attached parallel context's GEMM; its bias (where
    it has one) added after the GEMM, a row-parallel layer's after the TP reduction (megatron-core's
    ``skip_bias_add``: the bias joins in the bias-dropout-add or before the activation)."""

    def __init__(self, in_features: int, out_features: int, kind: str, bias: bool = False):
        super().__init__()
        self.kind = kind
        """``column`` (TP cuts the output dim) or ``row`` (TP cuts the input dim)."""
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.parallel = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight) if self.parallel is None else self.parallel.linear(self, x)
        return y if self.bias is None else y + self.bias


class WordEmbedding(nn.Module):
    """The token embedding table: ``F.embedding`` alone, or the vocab-parallel lookup."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.parallel = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.parallel is None:
            return F.embedding(tokens, self.weight)
        return self.parallel.embed(self, tokens)


def rope_freqs(m: ModelConfig) -> torch.Tensor | None:
    """megatron-core's ``RotaryEmbedding`` table [s, 1, 1, rotary dim] in fp32 (non-interleaved:
    the frequencies twice), or None without RoPE."""
    if m.position_embedding_type != "rope":
        return None
    dim = m.hidden_size // m.num_attention_heads
    dim = int(dim * m.rotary_percent) if m.rotary_percent < 1.0 else dim
    inv_freq = 1.0 / (m.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(m.seq_length, dtype=torch.float32), inv_freq)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


def apply_rope(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """megatron-core's ``_apply_rotary_pos_emb_bshd``: the first rotary-dim channels of t [s, b, n, hn]
    rotated (cos and sin in fp32, then in t's dtype), the rest passed through."""
    rot = freqs.shape[-1]
    t, rest = t[..., :rot], t[..., rot:]
    cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
    x1, x2 = torch.chunk(t, 2, dim=-1)
    return torch.cat((t * cos + torch.cat((-x2, x1), dim=-1) * sin, rest), dim=-1)


class SelfAttention(nn.Module):
    """Fused QKV rows per query group (its query heads, a key, a value), as megatron-core's
    ``get_query_key_value_tensors``; each group's key and value repeated for its query heads
    (``repeat_interleave``, as its ``DotProductAttention``). Multi-head attention: one head a group."""

    def __init__(self, m: ModelConfig, tp: int = 1):
        super().__init__()
        self.heads = m.num_attention_heads // tp  # heads of this TP rank
        self.groups = (m.num_query_groups or m.num_attention_heads) // tp  # query groups of this TP rank
        self.head_dim = m.hidden_size // m.num_attention_heads
        self.rope = rope_freqs(m)  # a constant table, not a buffer: it stays fp32 as megatron-core's
        self.core_attention = CoreAttention(m, self.heads)
        self.linear_proj = Linear(m.hidden_size, m.hidden_size, "row", m.add_bias_linear)
        qkv_bias = m.add_bias_linear or m.add_qkv_bias
        self.linear_qkv = Linear(m.hidden_size, qkv_rows(m), "column", qkv_bias)
        if m.qk_layernorm:  # over the head dim, each head alike (megatron-core's q_layernorm, k_layernorm)
            self.q_layernorm, self.k_layernorm = norm(m, self.head_dim), norm(m, self.head_dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        s, b, _ = x.shape
        per, hn = self.heads // self.groups, self.head_dim
        qkv = self.linear_qkv(x).view(s, b, self.groups, (per + 2) * hn)
        q, k, v = qkv.split([per * hn, hn, hn], dim=-1)
        q = q.reshape(s, b, self.heads, hn)  # [s, b, np, hn]; k, v: [s, b, ng, hn]
        if hasattr(self, "q_layernorm"):  # after the split, before RoPE (get_query_key_value_tensors)
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if self.rope is not None:
            q, k = apply_rope(q, self.rope[:s]), apply_rope(k, self.rope[:s])
        if per > 1:
            k, v = k.repeat_interleave(per, dim=2), v.repeat_interleave(per, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, np, s, hn]
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        scores = scores.float().masked_fill(mask, -10000.0)
        probs = self.core_attention.softmax(scores).to(v.dtype)
        ctx = torch.matmul(probs, v)  # [b, np, s, hn]
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, -1)
        return self.linear_proj(ctx)


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    return torch.pow(F.relu(x), 2)  # megatron-core's activations.squared_relu


# The activation (the gate's, for a gated one) by the [model] key's name, as megatron-core's.
ACTIVATIONS = {"gelu": F.gelu, "swiglu": F.silu, "geglu": F.gelu, "relu": F.relu,
               "squared_relu": squared_relu}


class MLP(nn.Module):
    """fc1, the activation, fc2. Gated (``swiglu``, ``geglu``): fc1's output is [gate; up] (on a TP
    rank its own rows of each half) and the activation is ``act(gate) * up``, as megatron-core's
    ``glu``."""

    def __init__(self, m: ModelConfig):
        super().__init__()
        self.gated, self.act = m.activation in GATED, ACTIVATIONS[m.activation]
        rows = (2 if self.gated else 1) * m.ffn_hidden_size
        self.linear_fc1 = Linear(m.hidden_size, rows, "column", m.add_bias_linear)
        self.linear_fc2 = Linear(m.ffn_hidden_size, m.hidden_size, "row", m.add_bias_linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear_fc1(x)
        if self.gated:
            gate, up = torch.chunk(y, 2, dim=-1)
            return self.linear_fc2(self.act(gate) * up)
        return self.linear_fc2(self.act(y))


class TransformerLayer(nn.Module):
    def __init__(self, m: ModelConfig, tp: int = 1):
        super().__init__()
        self.input_layernorm = norm(m)
        self.self_attention = SelfAttention(m, tp)
        self.pre_mlp_layernorm = norm(m)
        self.mlp = MoE(m, MLP) if m.num_experts else MLP(m)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x), mask)
        return x + self.mlp(self.pre_mlp_layernorm(x))


class Embedding(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        self.word_embeddings = WordEmbedding(padded_vocab_size(m), m.hidden_size)
        if m.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(m.seq_length, m.hidden_size)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        x = self.word_embeddings(tokens)
        if hasattr(self, "position_embeddings"):
            pos = torch.arange(tokens.shape[1])[None] if pos is None else pos  # [1 or b, s]
            x = x + self.position_embeddings(pos)
        return x.transpose(0, 1).contiguous()  # [s, b, h]


class Decoder(nn.Module):
    def __init__(self, m: ModelConfig, tp: int = 1):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(m, tp) for _ in range(m.num_layers))
        self.final_layernorm = norm(m)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, mask)
        return self.final_layernorm(x)


class MTPLayer(nn.Module):
    """One depth of megatron-core's MTP block (``MultiTokenPredictionLayer``, local spec):
    ``final_layernorm(layer(eh_proj([enorm(embedding), hnorm(hidden)])))``, the embedding first
    in the concatenation as ``_concat_embeddings`` orders it."""

    def __init__(self, m: ModelConfig, tp: int = 1):
        super().__init__()
        self.enorm = norm(m)
        self.hnorm = norm(m)
        self.eh_proj = Linear(2 * m.hidden_size, m.hidden_size, "column")
        self.mtp_model_layer = TransformerLayer(m, tp)
        self.final_layernorm = norm(m)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.eh_proj(torch.cat((self.enorm(embedded), self.hnorm(hidden)), -1))
        return self.final_layernorm(self.mtp_model_layer(x, mask))


class MTPBlock(nn.Module):
    """D depths (one layer object under ``mtp_use_repeated_layer``). Depth d re-embeds the
    tokens and positions shifted left by d + 1, the shifted-in places zero (``roll_tensor``),
    and returns its hidden states; the caller runs the output layer on each."""

    def __init__(self, m: ModelConfig, tp: int = 1):
        super().__init__()
        self.depths, self.repeated = m.mtp_num_layers, m.mtp_use_repeated_layer
        self.layers = nn.ModuleList(MTPLayer(m, tp) for _ in range(1 if self.repeated else self.depths))

    def forward(self, tokens, hidden, embedding: Embedding, mask) -> list[torch.Tensor]:
        pos, out = torch.arange(tokens.shape[1])[None].expand(tokens.shape[0], -1), []
        self.aux_losses = []
        """Each depth's MoE load-balancing loss: a repeated layer's divided by D, as megatron-core's
        router does for it (``attach_and_log_load_balancing_loss``)."""
        for d in range(self.depths):
            tokens, pos = (torch.roll(t, -1, dims=-1).index_fill(-1, torch.tensor([t.shape[-1] - 1]), 0)
                           for t in (tokens, pos))
            layer = self.layers[0 if self.repeated else d]
            hidden = layer(hidden, embedding(tokens, pos), mask)
            out.append(hidden)
            if isinstance(layer.mtp_model_layer.mlp, MoE):
                self.aux_losses.append(layer.mtp_model_layer.mlp.aux_loss / (self.depths if self.repeated
                                                                             else 1))
        return out


class GPT(nn.Module):
    """Returns logits [s, b, vocab / tp], as GPTModel does without labels; with MTP, each
    depth's logits are in ``mtp_logits`` (computed first, as ``process_mtp_loss`` does).

    Parameters are created at their logical shapes; a distributed run replaces them by the
    rank's shards (see ``harness.backends.torch.parallel.shard_model``).
    """

    def __init__(self, m: ModelConfig, tp: int = 1):
        super().__init__()
        self.embedding = Embedding(m)
        self.decoder = Decoder(m, tp)
        if m.mtp_num_layers:
            self.mtp = MTPBlock(m, tp)
        self.output_layer = Linear(m.hidden_size, padded_vocab_size(m), "column")
        if not m.untie_embeddings:  # tied: the output layer computes with the word embedding's parameter
            self.output_layer.weight = self.embedding.word_embeddings.weight
        self.register_buffer(
            "causal_mask", torch.triu(torch.ones(m.seq_length, m.seq_length, dtype=torch.bool), 1),
            persistent=False,
        )
        self.mtp_logits: list[torch.Tensor] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.decoder(self.embedding(tokens), self.causal_mask)
        if hasattr(self, "mtp"):
            self.mtp_logits = [self.output_layer(h)
                               for h in self.mtp(tokens, x, self.embedding, self.causal_mask)]
        return self.output_layer(x)


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross entropy [b, s] in fp32 or better, as MCore's vocab-parallel CE."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    s, b, v = logits.shape
    flat = logits.to(dtype).reshape(s * b, v)
    return F.cross_entropy(flat, labels.t().reshape(-1), reduction="none").view(s, b).t()
