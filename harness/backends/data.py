"""Synthetic token data and the sample-to-rank mapping.

A sample depends only on (seed, global sample id), so every topology sees the same samples
and traces can be aligned by sample id. The mapping follows megatron-core's data
distribution: GTP peers are distinct *data* ranks (the data group is gtp_remat x dp), with
data rank = global rank // TP when PP = CP = 1, and Megatron's pretraining sampler hands data
rank ``d`` the slice ``[d * mbs, (d + 1) * mbs)`` of each global micro-batch of
``mbs * data_ranks`` consecutive samples.
"""

from __future__ import annotations

import torch

from harness.common.mesh import Mesh, expert_coord
from harness.scenario.schema import DataConfig, ModelConfig, Side


def sample_tokens(seed: int, sample_id: int, seq_length: int, vocab_size: int) -> torch.Tensor:
    """Tokens of one sample, ``seq_length + 1`` long (inputs and shifted labels)."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + sample_id) % (2**63 - 1))
    return torch.randint(0, vocab_size, (seq_length + 1,), generator=gen, dtype=torch.int64)


def batch(seed: int, sample_ids: list[int], model: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, labels), each [len(sample_ids), seq_length]."""
    rows = torch.stack([sample_tokens(seed, i, model.seq_length, model.vocab_size) for i in sample_ids])
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def loss_mask(data: DataConfig, sample_ids: list[int], seq_length: int) -> torch.Tensor:
    """[len(sample_ids), seq_length] float mask of the tokens the loss counts (1) and the
    padding (0). ``variable``: sample ``i`` counts its first ``n_i`` tokens, ``n_i`` drawn
    uniformly from 1..seq_length by (seed, sample id) on a stream apart from the tokens'."""
    mask = torch.ones(len(sample_ids), seq_length)
    if data.loss_mask == "none":
        return mask
    for row, i in enumerate(sample_ids):
        gen = torch.Generator().manual_seed((data.seed * 1_000_003 + i) * 2 + 1)
        n = int(torch.randint(1, seq_length + 1, (1,), generator=gen))
        mask[row, n:] = 0.0
    return mask


def coord(rank: int, side: Side) -> dict[str, int]:
    """Mesh coordinates of ``rank`` (:mod:`harness.common.mesh`), with its data rank as ``data``."""
    mesh = Mesh.of_side(side)
    experts = {}
    etp = getattr(side, "etp", side.tp)
    if getattr(side, "ep", 1) * getattr(side, "expert_gtp", 1) > 1 or etp != side.tp:  # the expert grid's too
        experts = expert_coord(rank, side.world_size, etp, side.ep, side.expert_gtp, side.pipeline_parallel)
    return {**mesh.coord(rank), "data": mesh.data_rank(rank), **experts}


def step_sample_ids(step: int, data: DataConfig) -> list[int]:
    """Global sample ids of optimizer step ``step`` (1-based)."""
    start = (step - 1) * data.global_batch_size
    return list(range(start, start + data.global_batch_size))


def rank_sample_ids(step: int, rank: int, side: Side, data: DataConfig) -> list[list[int]]:
    """Sample ids ``rank`` reads at ``step``, one list per micro-batch."""
    data_rank = Mesh.of_side(side).data_rank(rank)
    mbs, d = data.micro_batch_size, side.data_ranks
    base = (step - 1) * data.global_batch_size
    return [
        [base + m * mbs * d + data_rank * mbs + j for j in range(mbs)]
        for m in range(side.num_microbatches(data))
    ]
