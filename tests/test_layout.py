"""Layouts: shard then assemble is the identity; MCore attributes read as the right layout."""

import random

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from harness.common.layout import (MESH_AXES, Layout, assemble, from_mcore_param, gtp_pad, parse_placement,
                                   placement_str, shard)


def random_layout(rng: random.Random) -> tuple[Layout, torch.Tensor]:
    ndim = rng.choice([1, 2, 3])
    mesh = {"tp": rng.choice([1, 2, 4]), "gtp": rng.choice([1, 2, 4]), "dp": rng.choice([1, 2])}
    placements, pads = {}, {}
    shape = [rng.randint(1, 5) for _ in range(ndim)]
    tp_dim = rng.choice([None, *range(ndim)])
    if tp_dim is not None:
        placements["tp"] = Shard(tp_dim)
        shape[tp_dim] *= mesh["tp"]
    if rng.random() < 0.7:
        placements["gtp"] = Shard(0)
        local0 = shape[0] // (mesh["tp"] if tp_dim == 0 else 1)
        pads["gtp"] = gtp_pad(local0, mesh["gtp"], rng.choice([0, 1, 2, 16]))
        if (local0 + pads["gtp"]) % mesh["gtp"]:
            pads["gtp"] = (-local0) % mesh["gtp"]
    return Layout(tuple(shape), mesh, placements, pads), torch.randn(shape, dtype=torch.float64)


def coords(mesh):
    for t in range(mesh["tp"]):
        for g in range(mesh["gtp"]):
            for d in range(mesh["dp"]):
                yield {"tp": t, "gtp": g, "dp": d}


@pytest.mark.parametrize("seed", range(200))
def test_shard_then_assemble_is_identity(seed):
    layout, full = random_layout(random.Random(seed))
    shards = {tuple(c.values()): shard(full, layout, c) for c in coords(layout.mesh)}
    for s in shards.values():
        assert tuple(s.shape) == layout.local_shape()
    rebuilt = assemble(layout, lambda c: shards[(c.get("tp", 0), c.get("gtp", 0), c.get("dp", 0))])
    assert torch.equal(rebuilt, full)


def test_gtp_pad_rows_are_zero_and_at_the_tail():
    layout = Layout((5, 3), {"tp": 1, "gtp": 2, "dp": 1}, {"gtp": Shard(0)}, {"gtp": gtp_pad(5, 2, 2)})
    assert layout.pads["gtp"] == 3  # 5 rows padded to a multiple of 2 x 2 = 4 -> 8
    full = torch.arange(15.0).view(5, 3) + 1
    s0, s1 = shard(full, layout, {"gtp": 0}), shard(full, layout, {"gtp": 1})
    assert torch.equal(s0, full[:4]) and torch.equal(s1[0], full[4]) and not s1[1:].any()


def test_tp_outer_gtp_inner_for_column_parallel():
    # Rank (t, g) holds rows [g*S, (g+1)*S) of TP block t (megatron-core's GTP layout).
    layout = Layout((8, 2), {"tp": 2, "gtp": 2}, {"tp": Shard(0), "gtp": Shard(0)})
    full = torch.arange(16.0).view(8, 2)
    assert torch.equal(shard(full, layout, {"tp": 1, "gtp": 0}), full[4:6])
    assert torch.equal(shard(full, layout, {"tp": 0, "gtp": 1}), full[2:4])


def test_row_parallel_tp_dim1_gtp_dim0():
    layout = Layout((4, 6), {"tp": 2, "gtp": 2}, {"tp": Shard(1), "gtp": Shard(0)})
    full = torch.arange(24.0).view(4, 6)
    assert torch.equal(shard(full, layout, {"tp": 1, "gtp": 1}), full[2:, 3:])


def test_partial_assembles_by_reduction():
    layout = Layout((3,), {"tp": 2}, {"tp": Partial("sum")})
    parts = {0: torch.ones(3), 1: 2 * torch.ones(3)}
    assert torch.equal(assemble(layout, lambda c: parts[c["tp"]]), 3 * torch.ones(3))


def test_placement_strings_round_trip():
    for p in (Replicate(), Shard(0), Shard(1), Partial("sum"), Partial("avg")):
        assert placement_str(parse_placement(placement_str(p))) == placement_str(p)
    with pytest.raises(ValueError):
        parse_placement("X(1)")


def test_layout_json_round_trip():
    layout = Layout((72, 64), {"tp": 2, "gtp": 2, "dp": 1}, {"tp": Shard(0), "gtp": Shard(0)}, {"gtp": 28})
    assert Layout.from_json(layout.to_json()).to_json() == layout.to_json()
    assert layout.local_shape() == (32, 64)


def test_from_mcore_param_attributes():
    p = torch.nn.Parameter(torch.zeros(32, 64))
    p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, 0, 1
    p.is_gtp_weight_remat, p.pad_length = True, 28
    layout = from_mcore_param(p, {"tp": 2, "gtp": 2, "dp": 1})
    assert layout.logical_shape == (72, 64)
    assert placement_str(layout.placement("tp")) == "S(0)" and layout.pads == {"gtp": 28}
    q = torch.nn.Parameter(torch.zeros(64))
    assert from_mcore_param(q, {"tp": 2, "gtp": 2}).placements == {}
    assert all(axis in ("tp", "gtp", "dp") for axis in MESH_AXES)


def test_a_strided_tp_cut_holds_each_block_s_piece_and_gtp_cuts_the_tp_local_block():
    # A gated fc1 [gate; up] (2 x 10 rows) at TP 2 x GTP 2, alignment 2: TP rank t holds [gate_t; up_t]
    # (megatron-core's partition_stride 2), 10 rows padded to 12; GTP rank 0 holds gate_t and up_t's
    # first row.
    full = torch.arange(20.0 * 3).view(20, 3)
    layout = Layout((20, 3), {"tp": 2, "gtp": 2, "dp": 1}, {"tp": Shard(0), "gtp": Shard(0)},
                    {"gtp": gtp_pad(10, 2, 2)}, strides={"tp": 2})
    assert layout.pads == {"gtp": 2} and layout.local_shape() == (6, 3)
    block = torch.cat([shard(full, layout, {"tp": 1, "gtp": g}) for g in (0, 1)])[:10]
    assert torch.equal(block, torch.cat([full[5:10], full[15:20]]))  # [gate_1; up_1]
    shards = {(c["tp"], c["gtp"]): shard(full, layout, c) for c in coords(layout.mesh)}
    assert torch.equal(assemble(layout, lambda c: shards[(c.get("tp", 0), c.get("gtp", 0))]), full)
    assert Layout.from_json(layout.to_json()) == layout and layout.to_json()["strides"] == {"tp": 2}
    p = torch.nn.Parameter(torch.zeros(6, 3))
    p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, 0, 2
    p.is_gtp_weight_remat, p.pad_length = True, 2
    assert from_mcore_param(p, {"tp": 2, "gtp": 2, "dp": 1}) == layout
    # Without the stride, rank 1 would hold the up half whole: another cut.
    plain = Layout((20, 3), {"tp": 2}, {"tp": Shard(0)})
    assert torch.equal(shard(full, plain, {"tp": 1}), full[10:])


@pytest.mark.parametrize("tp,gtp", [(2, 1), (2, 2)])
def test_a_gated_fc1_s_materialized_layout_keeps_its_tp_stride(tp, gtp):
    # The weight a gated fc1's GEMM reads on TP rank t is its TP-local block [gate_t; up_t] (GTP's
    # gather gives that block back, pad stripped): the materialized capture's layout must put the
    # blocks' pieces back block by block, as the param's own layout does; without the stride it reads
    # [gate_0; up_0; gate_1; up_1] as the logical weight: half its rows swapped (TP 1 vs TP 2 differs).
    from harness.backends.gpt import layout_of, param_specs
    from harness.backends.recording import gathered
    from harness.scenario.schema import ModelConfig, Side

    m = ModelConfig(num_layers=1, hidden_size=16, ffn_hidden_size=20, num_attention_heads=2, seq_length=8,
                    vocab_size=32, activation="swiglu")
    spec = next(s for s in param_specs(m) if s.name.endswith("mlp.linear_fc1.weight"))
    side = Side(world_size=tp * gtp, tp=tp, gtp=gtp)
    full = torch.arange(40.0 * 16).view(40, 16)
    param, mat = layout_of(spec, side), gathered(layout_of(spec, side))
    assert mat.strides == {"tp": 2} and "gtp" not in mat.placements

    def block(t):  # the TP-local block GTP's all-gather hands the GEMM, pad stripped
        pieces = [shard(full, param, {"tp": t, "gtp": g, "dp": 0}) for g in range(gtp)]
        return torch.cat(pieces)[:20]

    for t in range(tp):
        assert torch.equal(block(t), shard(full, mat, {"tp": t, "gtp": 0, "dp": 0}))
        assert torch.equal(block(t), torch.cat([full[10 * t:10 * t + 10], full[20 + 10 * t:30 + 10 * t]]))
    assert torch.equal(assemble(mat, lambda c: block(c.get("tp", 0))), full)
