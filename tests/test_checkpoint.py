"""Checkpoint topology: a TP1 x GTP2 run saves a torch_dist checkpoint with megatron-core's
distributed checkpointing, other topologies load it, are bitwise equal to the uninterrupted run
right after loading and pass after continuing; a shard saved with its pad rows counted as data
is localized at the load (``tests/assets/checkpoint_fast.toml``)."""

from __future__ import annotations

import io
import os
import pickle

import pandas as pd
import pytest
import torch

from harness.scenario import checkpoint as checkpointing
from harness import scenario
from harness.backends.megatron import checkpoint
from harness.common.errors import BadInput
from harness.scenario.faults import CATALOG
from harness.backends.gpt import param_specs
from harness.compare.signatures import inserted_zero_rows
from harness.scenario.matrix import read_toml
from harness.scenario.rules import validate
from harness.scenario.parse import parse_scenario
from helpers import ASSETS, results, run, summary

FAST = ASSETS / "checkpoint_fast.toml"
CLEAN = ("ckpt-tp1-gtpoff", "ckpt-tp2-gtpoff")


# --- the scenario kind ---------------------------------------------------------------------


def test_each_topology_loaded_into_is_a_scenario_resuming_from_the_saved_run():
    scenarios = scenario.load(FAST)
    assert [s.name for s in scenarios] == [*CLEAN, "ckpt-fault-pad-rows-as-data"]
    for s in scenarios:
        assert s.saver.save_step == 1 and s.candidate.load_step == 1
        assert s.candidate.resume_from == s.saver.key(s.model, s.data)
        assert s.compare.exact_steps == (1,)  # the load step is judged bitwise
        assert s.reference == scenario.load(FAST)[0].reference  # one uninterrupted run for all
    tp2 = scenarios[1]
    assert tp2.description == "checkpoint: TP1xGTP2 -> TP2xGTP-off load at step 1"
    assert (tp2.candidate.tp, tp2.candidate.gtp, tp2.candidate.world_size) == (2, 1, 2)
    # The save fault rides on the candidate and is planted where the checkpoint is saved.
    fault = scenarios[-1]
    assert fault.candidate.inject == ("ckpt-pad-rows-as-data",) and scenarios[0].candidate.inject == ()


def _doc(**checkpoint) -> dict:
    raw = read_toml(FAST)
    return {**raw, "checkpoint": {**raw["checkpoint"], **checkpoint}}


@pytest.mark.parametrize("edit, where", [
    ({"save_step": 2}, "save_step"),  # no step left to continue
    ({"save_step": 0}, "save_step"),
    ({"load_into": []}, "load_into"),
    ({"load_into": [{"label": "x", "optimizer": "sgd"}]}, "load_into"),  # not the same training
    ({"load_into": [{"label": "x", "save_step": 1}]}, "load_into[0].save_step"),
    ({"load_into": [{"label": "a"}, {"label": "a"}]}, "label"),
    ({"keep": 1}, "keep"),
])
def test_bad_checkpoint_tables_are_refused(edit, where):
    with pytest.raises(BadInput) as e:
        checkpointing.expand(_doc(**edit), "bad.toml", parse_scenario, validate)
    assert where in str(e.value)


def test_checkpoint_keys_are_set_by_the_checkpoint_table_only():
    raw = {k: v for k, v in read_toml(FAST).items() if k != "checkpoint"}
    with pytest.raises(BadInput, match="set by a \\[checkpoint\\] table"):
        parse_scenario({**raw, "candidate": {"load_step": 1}}, "x.toml")
    with pytest.raises(BadInput, match="acts where a \\[checkpoint\\] scenario saves|never fires"):
        parse_scenario({**raw, "candidate": {"gtp": 1, "inject": ["ckpt-pad-rows-as-data"]}}, "x.toml")


# --- nothing pickled is loaded -------------------------------------------------------------


class _Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_metadata_is_read_through_the_allow_list(tmp_path):
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, TensorProperties,
                                                       TensorStorageMetadata)

    good = Metadata({"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4, 2]),
                                                [ChunkStorageMetadata(torch.Size([0, 0]),
                                                                      torch.Size([4, 2]))])})
    (tmp_path / "good").write_bytes(pickle.dumps(good))
    assert checkpoint.read_metadata(tmp_path / "good").state_dict_metadata["w"].size == torch.Size([4, 2])
    (tmp_path / "evil").write_bytes(pickle.dumps(_Payload()))
    with pytest.raises(checkpoint.UnsafePickle, match="posix.system|os.system"):
        checkpoint.read_metadata(tmp_path / "evil")


def test_byte_items_are_loaded_weights_only():
    from torch.distributed.checkpoint import default_planner

    class Planner:
        flatten_state_dict, state_dict = False, {}

    class Item:
        class dest_index:
            fqn = "common_state"

    evil, good = io.BytesIO(), io.BytesIO()
    torch.save([_Payload()], evil)
    torch.save([{"lr": 1e-3, "step": torch.tensor(1)}], good)
    with checkpoint.allow_listed_reads():
        default_planner.DefaultLoadPlanner.load_bytes(Planner(), Item(), io.BytesIO(good.getvalue()))
        with pytest.raises(pickle.UnpicklingError):
            default_planner.DefaultLoadPlanner.load_bytes(Planner(), Item(), io.BytesIO(evil.getvalue()))
    assert Planner.state_dict["common_state"][0]["lr"] == 1e-3
    # Outside a load, torch's own loaders are back.
    assert default_planner.DefaultLoadPlanner.load_bytes.__module__ == default_planner.__name__


def test_a_legacy_common_pt_is_refused(tmp_path):
    checkpoint.refuse_legacy_common(tmp_path)  # the torch_dist format has none
    (tmp_path / "common.pt").write_bytes(b"")
    with pytest.raises(checkpoint.UnsafePickle, match="common.pt"):
        checkpoint.refuse_legacy_common(tmp_path)


def test_inserted_zero_rows_signature():
    ref = torch.arange(1.0, 25.0).view(8, 3)
    cand = torch.cat([ref[:3], torch.zeros(2, 3), ref[3:6]])
    assert inserted_zero_rows(ref, cand) == {"row": 3, "count": 2}
    assert inserted_zero_rows(ref, ref.flip(0)) is None
    assert inserted_zero_rows(ref, ref * 2) is None


# --- round trips on megatron-core ----------------------------------------------------------


@pytest.fixture(scope="module")
def fast(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt")
    code, doc = run(FAST, out, parallel=2)
    return code, doc, out


@pytest.mark.multirank
@pytest.mark.parametrize("name", CLEAN)
def test_round_trip_is_bitwise_at_load_and_passes_after_continuing(fast, name):
    _, _, out = fast
    doc = summary(out, name)
    assert doc["verdict"] == "pass", doc.get("first_divergence")
    assert doc["checkpoint"]["bitwise_at_load"] and doc["checkpoint"]["from"] == "TP1xGTP2"
    df = results(out, name)
    load = df[(df["step"] == 1) & (df["kind"] != "scalar")]
    names = {p.name for p in param_specs(scenario.load(FAST)[0].model)}
    # Every weight and both Adam moments of every parameter, bit for bit (exact policy).
    for kind in ("param", "exp_avg", "exp_avg_sq"):
        assert set(load[load["kind"] == kind]["tensor"]) == names, kind
    assert (load["policy"] == "exact").all() and load["bitwise_equal"].astype(bool).all()
    after = df[(df["step"] == 2) & df["kind"].isin(["param", "main_grad", "loss", "activation"])]
    assert not after.empty and after["passed"].astype(bool).all()


@pytest.mark.multirank
def test_pad_rows_saved_as_data_are_localized_at_load(fast):
    code, _, out = fast
    assert code == 1  # the fault fails its scenario, and only it
    s = summary(out, "ckpt-fault-pad-rows-as-data")
    fd, expect = s["first_divergence"], CATALOG["ckpt-pad-rows-as-data"].expect
    assert s["verdict"] == "fail" and not s["checkpoint"]["bitwise_at_load"] and fd["phase"] == "load"
    assert (fd["step"], fd["kind"], fd["tensor"], fd["signature"]) == (1, expect["kind"], expect["tensor"],
                                                                       expect["signature"])
    # G = 2 shards of 64 rows, each saved with 16 zero pad rows: the second shard lands 16 rows late.
    assert fd["inserted_rows"] == {"row": 64, "count": 16}


@pytest.mark.multirank
def test_the_checkpoint_is_megatron_cores_torch_dist_format(fast):
    _, _, out = fast
    saved = list(out.glob("traces/*/checkpoint"))
    assert len(saved) == 2  # the clean saver, shared by two scenarios, and the faulty one
    for ckpt in saved:
        assert (ckpt / ".metadata").is_file() and list(ckpt.glob("*.distcp"))
        assert not (ckpt / "common.pt").exists()  # common state is inside the distcp files
        assert '"sharded_backend": "torch_dist"' in (ckpt / "metadata.json").read_text()
    df = pd.concat(results(out, n).assign(scenario=n) for n in CLEAN)
    assert (df[df["step"] == 0].empty)  # a resumed side records no initial weights
