"""A caller-supplied process-group collection (``Side.process_groups``): the same groups passed
explicitly train the same model bit for bit; GTP peers paired across replicate DP are megatron-core
0.19.2's known divergence (its layers gather over parallel_state's GTP group); a collection whose
model-parallel group leaves the GTP peers out is localized at the grad norm
(``scenarios/features.toml``, ``harness/backends/megatron/groups.py``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from harness import scenario
from harness.common.errors import BadInput
from harness.common.mesh import PERMUTED, Mesh
from harness.scenario.faults import CATALOG
from harness.scenario.planting import plant
from harness.scenario.rules import validate
from harness.session import run_scenarios
from tests.helpers import MAIN_TREE, ROOT, needs_repositories, results, summary

FEATURES = ROOT / "scenarios" / "features.toml"
FAULT = "pgc-grad-norm-without-gtp"


def _pg_scenarios():
    return [s for s in scenario.load(FEATURES) if s.name.startswith("pg-")]


def test_the_permuted_pairing_swaps_gtp_peers_with_replicate_dp():
    usual, permuted = Mesh.of_world(8, tp=2, gtp=2), Mesh.of_world(8, tp=2, gtp=2, order=PERMUTED)
    assert usual.groups("gtp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert permuted.groups("gtp") == [[0, 4], [1, 5], [2, 6], [3, 7]] == usual.groups("dp")
    assert permuted.groups("dp") == usual.groups("gtp") and permuted.groups("tp") == usual.groups("tp")
    assert sorted(permuted.groups("gtp", "dp")) == sorted(usual.groups("gtp", "dp"))
    for rank in range(8):  # the same samples per rank on either pairing; coordinates round-trip
        assert permuted.data_rank(rank) == usual.data_rank(rank)
        assert permuted.rank(permuted.coord(rank)) == rank
    assert permuted.coord(2) == {"tp": 0, "gtp": 0, "dp": 1} and usual.coord(2) == {"tp": 0, "gtp": 1,
        "dp": 0}


@pytest.mark.parametrize("change,problem", [
    ({"gtp": 1, "world_size": 2}, "needs G > 1 and DP > 1"),
    ({"world_size": 2}, "needs G > 1 and DP > 1"),
    ({"pipeline_parallel": 2, "world_size": 8}, "not with pipeline stages"),
])
def test_a_permuted_collection_it_cannot_build_is_refused(change, problem):
    (s,) = [s for s in _pg_scenarios() if s.name == "pg-collection-permuted"]
    bad = dataclasses.replace(s, candidate=dataclasses.replace(s.candidate, **change))
    with pytest.raises(BadInput, match=problem):
        validate(bad, limits=False)


@pytest.fixture(scope="module")
def pg_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("process-groups")
    shipped = _pg_scenarios()
    (same,) = [s for s in shipped if s.name == "pg-collection"]
    (faulty,) = plant([dataclasses.replace(same, name=f"pg-collection-{FAULT}")], [FAULT])
    # Found by gtp-parity fuzz: at TP 2 x DP 2 parallel_state's expert DP group spans the DP axis;
    # on parallel_state's own pairing a collection was refused for it (a group it need not build).
    tp2 = {"tp": 2, "gtp": 1, "overlap_grad_reduce": True}
    dp2 = dataclasses.replace(same, name="pg-collection-tp2-dp2",
                              reference=dataclasses.replace(same.reference, process_groups="parallel-state",
                                                            **tp2),
                              candidate=dataclasses.replace(same.candidate, **tp2))
    validate(dp2)
    run_scenarios([*shipped, faulty, dp2], out, parallel=1)
    return out


@pytest.mark.multirank
def test_the_same_groups_passed_explicitly_train_the_same_model_bit_for_bit(pg_run):
    assert summary(pg_run, "pg-collection")["verdict"] == "pass"
    df = results(pg_run, "pg-collection")
    placed = df[df["kind"] != "scalar"]
    assert len(placed) > 100 and placed["bitwise_equal"].astype(bool).all()


@pytest.mark.multirank
def test_a_collection_at_tp2_x_dp2_trains_the_same_model_bit_for_bit(pg_run):
    assert summary(pg_run, "pg-collection-tp2-dp2")["verdict"] == "pass"
    placed = results(pg_run, "pg-collection-tp2-dp2")
    placed = placed[placed["kind"] != "scalar"]
    assert len(placed) > 100 and placed["bitwise_equal"].astype(bool).all()


@pytest.mark.multirank
def test_gtp_peers_paired_across_dp_are_the_wheels_known_divergence(pg_run):
    s = summary(pg_run, "pg-collection-permuted")
    fd = s["first_divergence"]
    assert s["verdict"] == "known-divergence", fd
    assert (fd["step"], fd["kind"], fd["signature"]) == (1, "materialized", "replica-drift"), fd
    # The candidate's shards sit where the collection pairs them: rank 1 is GTP rank 0 of DP slot 1.
    trace = next(p for p in (pg_run / "traces").iterdir()
                 if _coords(p).get(1) == {"tp": 0, "gtp": 0, "dp": 1})
    assert _coords(trace)[2] == {"tp": 0, "gtp": 1, "dp": 0}
    # 0.19.2 gathers every GTP weight over parallel_state's pairing: each one is wrong.
    df = results(pg_run, "pg-collection-permuted")
    gathered = df[(df["step"] == 1) & (df["kind"] == "materialized")]
    assert len(gathered) == 10 and not gathered["bitwise_equal"].astype(bool).any()


def _coords(trace: Path) -> dict:
    manifest = trace / "manifest.json"
    coords = json.loads(manifest.read_text())["coords"] if manifest.exists() else {}
    return {int(r): {a: c[a] for a in ("tp", "gtp", "dp")} for r, c in coords.items()}


@pytest.mark.multirank
def test_a_model_parallel_group_without_the_gtp_peers_is_caught_at_the_grad_norm(pg_run):
    name = f"pg-collection-{FAULT}"
    s, expect = summary(pg_run, name), CATALOG[FAULT].expect
    fd = s["first_divergence"]
    assert s["verdict"] == "fail"
    assert (fd["step"], fd["kind"], fd["tensor"], fd["signature"]) == (
        expect["step"], expect["kind"], expect["tensor"], expect["signature"]), fd
    df = results(pg_run, name)  # the gradients themselves are untouched
    grads = df[(df["step"] == 1) & (df["kind"] == "main_grad")]
    assert len(grads) and grads["bitwise_equal"].astype(bool).all()


# Megatron-LM main, where the decoder follows the collection and two reads of parallel_state's GTP
# group remain (repro/FINDINGS.md J). A git:REPO@REV spec; CI has no checkout.


@pytest.mark.multirank
@pytest.mark.slow
def test_on_main_the_embedding_and_output_layer_remain_and_the_proposed_fix_holds(tmp_path):
    needs_repositories(MAIN_TREE)
    (s,) = [s for s in _pg_scenarios() if s.name == "pg-collection-permuted"]
    on_main = {r: dataclasses.replace(side, megatron_core=MAIN_TREE) for r, side in
               (("reference", s.reference), ("candidate", s.candidate))}
    s = dataclasses.replace(s, **on_main, expect=None)
    (mended,) = plant([dataclasses.replace(s, name="pg-permuted-mended")], ["patch-pgc-gtp-reads"])
    run_scenarios([s, mended], tmp_path, parallel=1)
    df = results(tmp_path, s.name)
    differs = (df["step"] == 1) & (df["kind"] == "materialized") & ~df["bitwise_equal"].astype(bool)
    wrong = set(df[differs]["tensor"])
    assert wrong == {"embedding.word_embeddings.weight", "output_layer.weight"}
    assert summary(tmp_path, "pg-permuted-mended")["verdict"] == "pass"
