"""The mesh: rank order and groups, checked against megatron-core's own ``RankGenerator``."""

from __future__ import annotations

import pytest
from megatron.core.parallel_state import RankGenerator, _inject_gtp_remat_axis

from harness.common.mesh import AXES, Mesh

# megatron-core's names of our axes, for RankGenerator.get_ranks.
MCORE_AXIS = {"tp": "tp", "gtp": "gtp_remat", "dp": "dp", "pp": "pp"}
# The groups the backends build: process-group name -> axes it spans.
SPANS = [("tp",), ("gtp",), ("dp",), ("gtp", "dp"), ("tp", "gtp"), ("tp", "gtp", "dp"), ("pp",)]
MESHES = [Mesh(1, 1, 1), Mesh(2, 2, 2), Mesh(2, 4, 1), Mesh(1, 2, 3), Mesh(4, 2, 2), Mesh(3, 1, 2),
          Mesh(1, 2, 1, 2), Mesh(2, 2, 1, 2), Mesh(1, 1, 2, 2), Mesh(1, 2, 2, 3)]


def mcore_generator(mesh: Mesh) -> RankGenerator:
    # The dense decoder's generator as initialize_model_parallel builds it (CP = EP = 1).
    order = _inject_gtp_remat_axis("tp-cp-ep-dp-pp", after="tp")
    return RankGenerator(tp=mesh.tp, ep=1, dp=mesh.dp, pp=mesh.pp, cp=1, order=order, gtp_remat=mesh.gtp)


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("axes", SPANS, ids="-".join)
def test_groups_are_megatron_cores(mesh, axes):
    token = "-".join(MCORE_AXIS[a] for a in AXES if a in axes)
    assert mesh.groups(*axes) == mcore_generator(mesh).get_ranks(token)


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_coord_and_rank_are_inverse_and_match_the_groups(mesh):
    coords = [mesh.coord(r) for r in range(mesh.world_size)]
    assert [mesh.rank(c) for c in coords] == list(range(mesh.world_size))
    assert len({tuple(c.values()) for c in coords}) == mesh.world_size
    for axis in mesh.sizes():  # pp is named only in a pipelined mesh
        for group in mesh.groups(axis):
            # Along one axis's group only that coordinate moves, through 0..size-1 in order.
            assert [coords[r][axis] for r in group] == list(range(mesh.size(axis)))
            others = {tuple(v for a, v in coords[r].items() if a != axis) for r in group}
            assert len(others) == 1
        for rank in range(mesh.world_size):
            assert rank in mesh.group(rank, axis)


def test_data_rank_counts_gtp_peers_and_not_tp_peers():
    mesh = Mesh(tp=2, gtp=2, dp=2)
    data = [mesh.data_rank(r) for r in range(mesh.world_size)]
    for group in mesh.groups("tp"):
        assert len({data[r] for r in group}) == 1
    for group in mesh.groups("gtp", "dp"):
        assert sorted(data[r] for r in group) == list(range(mesh.gtp * mesh.dp))


def test_pipeline_stages_read_the_same_samples_and_are_named_only_when_pipelined():
    mesh = Mesh(tp=2, gtp=2, dp=1, pp=2)
    for group in mesh.groups("pp"):
        assert len({mesh.data_rank(r) for r in group}) == 1
    assert sorted({mesh.data_rank(r) for r in range(mesh.world_size)}) == [0, 1]
    assert "pp" in mesh.sizes() and "pp" in mesh.coord(7) and mesh.coord(7)["pp"] == 1
    assert "pp" not in Mesh(2, 2, 2).sizes() and "pp" not in Mesh(2, 2, 2).coord(0)
    assert mesh.stage_sizes() == {"tp": 2, "gtp": 2, "dp": 1}


def test_bad_shapes_and_coordinates_say_what():
    with pytest.raises(ValueError, match="not a multiple of TP x G = 4"):
        Mesh.of_world(6, tp=2, gtp=2)
    with pytest.raises(ValueError, match="gtp coordinate 2 is outside 0..1"):
        Mesh(2, 2, 1).rank({"tp": 0, "gtp": 2})
    with pytest.raises(ValueError, match="rank 4 is outside"):
        Mesh(2, 2, 1).coord(4)
