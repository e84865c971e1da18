"""Shrinking and clusters (harness/fuzz/shrink.py, cluster.py) against stand-in judges: delta
debugging keeps what a failure needs and the way it fails, sizes shrink, a race is shrunk with
eager collectives, a bug of one side needs no axis, clusters match recorded divergences."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from harness.compare.summary import FirstDivergence
from harness.fuzz.cluster import Cluster, known_as, needs_of, recorded_divergences, tensor_pattern
from harness.fuzz.shrink import EAGER, shrink
from harness.fuzz.space import Axis, Draw, load_space
from harness.scenario import load

ROOT = Path(__file__).resolve().parents[1]
SPACE = ROOT / "scenarios" / "fuzz" / "space.toml"


def _fd(signature="mismatch", kind="main_grad", step=2, tensor="decoder.layers.1.mlp.linear_fc1.weight"):
    return FirstDivergence(step=step, phase="backward", kind=kind, tensor=tensor, signature=signature)


def test_shrinking_keeps_exactly_what_the_failure_needs():
    space = load_space(str(SPACE))
    settings = (("model", "activation", "swiglu"), ("model", "normalization", "RMSNorm"),
                ("train", "optimizer", "sgd"), ("train", "precision", "bf16"),
                    ("model", "add_bias_linear", True))
    draw = Draw(settings=tuple(sorted(settings)), world_size=4, axis=Axis("gtp", 1, 2))
    batches = []

    def judge(draws):  # fails (the same way) where swiglu and bf16 are both set, whatever else is
        batches.append(len(draws))
        return [_fd() if {("model", "activation", "swiglu"),
                          ("train", "precision", "bf16")} <= set(d.settings)
                else None for d in draws]

    out = shrink(draw, _fd(), space, judge, deadline=float("inf"))
    assert set(out.draw.settings) == {("model", "activation", "swiglu"), ("train", "precision", "bf16")}
    assert out.complete and out.runs == sum(batches) and len(batches) < out.runs  # batches, not one by one
    cuts = dict(((s, k), v) for s, k, v in out.draw.reductions)
    assert cuts[("model", "num_layers")] == 1 and out.draw.world_size == 2  # sizes cut too


def test_a_setting_needed_only_at_the_drawn_size_is_dropped_once_sizes_shrink():
    """At world 4 the failure needs global batch 8 (one micro-batch a rank otherwise); at world 2
    it does not: the setting is left out once the world is cut."""
    space = load_space(str(SPACE))
    draw = Draw(settings=(("data", "global_batch_size", 8), ("model", "num_query_groups", 1)), world_size=4,
                axis=Axis("gtp", 1, 2))

    def judge(draws):
        return [_fd() if ("model", "num_query_groups", 1) in d.settings and d.axis.candidate == 2
                and (d.world_size == 2 or ("data", "global_batch_size", 8) in d.settings) else None
                for d in draws]

    out = shrink(draw, _fd(), space, judge, deadline=float("inf"))
    assert out.draw.world_size == 2 and out.draw.settings == (("model", "num_query_groups", 1),)


def test_shrinking_keeps_the_way_it_fails():
    space = load_space(str(SPACE))
    draw = Draw(settings=(("train", "precision", "bf16"),), world_size=2, axis=Axis("tp", 1, 2))
    # without bf16 it still fails, but another way: not the same finding
    out = shrink(draw, _fd(), space, lambda ds: [_fd() if d.settings else _fd(kind="param") for d in ds],
                 deadline=float("inf"))
    assert out.draw.settings == draw.settings


def test_a_race_is_shrunk_with_eager_collectives_which_are_not_a_need():
    """A buffer race shows on some async runs only: ddmin over it would keep settings by chance. With
    eager collectives it fails on every run (here at step 1, as materialized weights at step 2
    async): that draw is shrunk, eager kept throughout, and eager is no need of the cluster."""
    space = load_space(str(SPACE))
    race = _fd(signature="not-bitwise", kind="materialized")
    draw = Draw(settings=(("model", "hidden_size", 96), ("model", "normalization", "RMSNorm")), world_size=2,
                axis=Axis("gtp_weight_prefetch", True, False))
    seen = []

    def judge(draws):  # eager: fails wherever hidden is 96 (and prefetch differs); async: only with RMSNorm
        seen.extend(draws)
        return [(_fd(signature="not-bitwise", kind="activation", step=1) if EAGER in d.settings else race)
                if ("model", "hidden_size", 96) in d.settings and d.axis.reference != d.axis.candidate
                and (EAGER in d.settings or ("model", "normalization", "RMSNorm") in d.settings) else None
                for d in draws]

    out = shrink(draw, race, space, judge, deadline=float("inf"))
    assert out.eager and set(out.draw.settings) == {("model", "hidden_size", 96), EAGER}
    assert all(EAGER in d.settings for d in seen)  # every run after the first check is deterministic
    assert (out.first.kind, out.first.step) == ("activation", 1)
    assert needs_of(out.draw, eager=out.eager) == ["axis:gtp_weight_prefetch=true->false",
                                                   "model.hidden_size=96"]
    # drawn eager: kept (no async subset) and no need either
    drawn = dataclasses.replace(draw, settings=tuple(sorted((*draw.settings, EAGER))))
    again = shrink(drawn, out.first, space, judge, deadline=float("inf"))
    assert again.eager and again.draw.settings == out.draw.settings
    # a finding that is no race, or one eager does not show, is shrunk as found
    assert not shrink(draw, _fd(), space, lambda ds: [_fd() for _ in ds], deadline=float("inf")).eager
    assert not shrink(draw, race, space, lambda ds: [None if EAGER in d.settings else race for d in ds],
                      deadline=float("inf")).eager


def test_tensor_patterns_and_recorded_divergences():
    pattern = tensor_pattern(_fd(tensor="decoder.layers.12.mlp.experts.3.weight"))
    assert pattern == "decoder.layers.*.mlp.experts.*.weight"
    recorded = [(s.source, s) for s in load(ROOT / "scenarios" / "architectures.toml")
                if s.expect is not None]
    gqa = next(s for _, s in recorded if s.model.num_query_groups)
    c = Cluster(id="C1", fingerprint=(gqa.expect.signature or "mismatch", "materialized"), pattern="",
                needs=sorted(["axis:gtp=1->2", f"model.num_query_groups={gqa.model.num_query_groups}"]),
                minimal={})
    assert known_as(c, recorded) is not None
    c.needs.append("train.optimizer=muon")  # a need no recorded scenario holds
    assert known_as(c, recorded) is None
    # a checkpoint's need is the saving run's: the fuzz-found distributed optimizer's load
    ckpt = [(src, s) for src, s in recorded_divergences(ROOT / "scenarios") if s.saver is not None]
    c = Cluster(id="C2", fingerprint=("raised", "KeyError", "x"), pattern="",
                needs=["checkpoint.save_step=1", "train.distributed_optimizer=true"], minimal={})
    assert known_as(c, ckpt).endswith("scenarios/fuzz_found_checkpoint.toml")


def test_a_bug_of_one_side_needs_no_axis():
    space = load_space(str(SPACE))
    draw = Draw(settings=(("train", "process_groups", "collection-permuted"),), world_size=4,
                axis=Axis("per_token_loss", "none", "transformer-config"))

    def per_side(draws):  # the candidate's own replicas drift wherever its groups are permuted
        return [_fd("replica-drift", "materialized") if d.settings else None for d in draws]

    out = shrink(draw, _fd("replica-drift", "materialized"), space, per_side, deadline=float("inf"))
    assert needs_of(out.draw) == ["train.process_groups=collection-permuted"]

    def between_sides(draws):  # a difference only the axis makes
        return [_fd() if d.axis.reference != d.axis.candidate else None for d in draws]

    out = shrink(draw, _fd(), space, between_sides, deadline=float("inf"))
    assert needs_of(out.draw) == ["axis:per_token_loss=none->transformer-config"]
