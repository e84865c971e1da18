"""Muon under GTP (``optimizer = "muon"``, scenarios/features.toml's ``muon-*`` entries): the golden's
Muon is megatron-core's and the library's, bit for bit where they can be compared; the sides split
the parameters between Muon and Adam as the golden does; the wheel's padded-shard divergence is
named with its factor; the unpadded control holds bitwise; the planted fault is localized; the
refusals are clear."""

from __future__ import annotations

import dataclasses
import math

import pandas as pd
import pytest
import torch

from harness import scenario
from harness.capture import trace
from harness.common.muon import MUON, is_muon_matrix
from harness.compare import expectations as ex
from harness.scenario.faults import CATALOG
from harness.session import run_scenarios
from tests.helpers import ROOT, results, summary
from tests.test_bad_inputs import BASE, _assert_one_clear_line, _run, edit

FEATURES = ROOT / "scenarios" / "features.toml"
FAULT = "muon-gtp-gather-tp-group"
SCALED = "muon-update-padded-scale"


# --- the golden's Muon --------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(48, 64), (64, 48), (32, 32)])
def test_the_goldens_newton_schulz_is_the_librarys_bit_for_bit(shape):
    """The golden's driver in fp32 (highest matmul precision: no bf16 cast) is the library's
    ``newton_schulz``: same transposes, normalization and steps, so the same bits; in fp64 it
    runs the same iteration without fp32's roundings."""
    from emerging_optimizers.orthogonalized_optimizers import muon_utils

    from harness.backends.torch.muon import newton_schulz

    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    with _matmul_precision("highest"):
        ours = newton_schulz(x, MUON["num_ns_steps"], MUON["coefficient_type"])
        theirs = muon_utils.newton_schulz(x, MUON["num_ns_steps"], MUON["coefficient_type"])
    assert torch.equal(ours, theirs)
    assert newton_schulz(x.double(), 5, "quintic").dtype == torch.float64


def test_the_goldens_update_is_megatron_cores_qkv_split_and_scale_bit_for_bit():
    """megatron-core's ``TensorParallelMuon.orthogonalize`` without process groups (one rank)
    against the golden's, in fp32: the fused QKV weight split per query group into q, k, v,
    each orthogonalized and scaled by its own shape; a plain matrix whole."""
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    from harness.backends.torch.muon import GoldenMuon

    gen = torch.Generator().manual_seed(5)
    qkv, fc1 = (torch.nn.Parameter(torch.randn(*shape, generator=gen)) for shape in ((192, 64), (80, 64)))
    qkv.is_qkv = True
    theirs = TensorParallelMuon([qkv, fc1], split_qkv=True, is_qkv_fn=lambda p: getattr(p, "is_qkv", False),
                                qkv_split_shapes=[16, 16, 16], pg_collection=None, tp_mode="duplicated",
                                **{k: MUON[k] for k in ("coefficient_type", "num_ns_steps", "scale_mode",
                                                        "extra_scale_factor")})
    ours = GoldenMuon([qkv, fc1], lr=1.0, weight_decay=0.0, qkv={id(qkv): [16, 16, 16]})
    with _matmul_precision("highest"):
        for p in (qkv, fc1):
            g = torch.randn(p.shape, generator=gen)
            assert torch.equal(ours.orthogonalize(p, g), theirs.orthogonalize(p, g)), p.shape


def test_the_goldens_blockwise_update_is_megatron_cores_on_each_tp_shard():
    """megatron-core's blockwise mode at TP 2 orthogonalizes each TP-local shard alone (the QKV
    shard split into its own query groups' q, k, v); the golden's ``blocks = 2`` on the whole
    matrix gives the two shards' results side by side, bit for bit (fp32)."""
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    from harness.backends.torch.muon import GoldenMuon

    gen = torch.Generator().manual_seed(7)
    qkv, fc2 = (torch.nn.Parameter(torch.randn(*shape, generator=gen)) for shape in ((192, 64), (64, 80)))
    kw = {k: MUON[k] for k in ("coefficient_type", "num_ns_steps", "scale_mode", "extra_scale_factor")}
    ours = GoldenMuon([qkv, fc2], lr=1.0, weight_decay=0.0, qkv={id(qkv): [16, 16, 16]}, blocks=2,
                      tp_dims={id(qkv): 0, id(fc2): 1})
    for p, dim in ((qkv, 0), (fc2, 1)):
        g = torch.randn(p.shape, generator=gen)
        shards = [torch.nn.Parameter(b.clone()) for b in p.detach().chunk(2, dim=dim)]
        for shard in shards:
            shard.is_qkv = p is qkv
        theirs = TensorParallelMuon(shards, split_qkv=True, is_qkv_fn=lambda q: getattr(q, "is_qkv", False),
                                    qkv_split_shapes=[16, 16, 16], pg_collection=None, tp_mode="blockwise",
                                    **kw)
        with _matmul_precision("highest"):
            want = torch.cat([theirs.orthogonalize(sh, b) for sh, b in zip(shards, g.chunk(2, dim=dim))],
                             dim=dim)
            assert torch.equal(ours.orthogonalize(p, g), want), p.shape


def test_muon_steps_the_matrices_megatron_core_gives_it():
    assert is_muon_matrix("embedding.position_embeddings.weight", 2)  # untagged by LanguageModule
    assert is_muon_matrix("decoder.layers.0.mlp.linear_fc1.weight", 2)
    assert not is_muon_matrix("embedding.word_embeddings.weight", 2)
    assert not is_muon_matrix("output_layer.weight", 2)
    assert not is_muon_matrix("decoder.final_layernorm.weight", 1)


class _matmul_precision:
    def __init__(self, value):
        self.value = value

    def __enter__(self):
        self.old = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(self.value)

    def __exit__(self, *exc):
        torch.set_float32_matmul_precision(self.old)


# --- what may be claimed bitwise ------------------------------------------------------------


def _cfg(**kw) -> dict:
    side = scenario.Side(**{"backend": "megatron", "world_size": 4, "tp": 2, "optimizer": "muon", **kw})
    return {**dataclasses.asdict(side), "micro_batches": 1}


@pytest.mark.parametrize(("mode", "expected"), [("duplicated", "bitwise"), ("distributed", "noise-floor"),
                                                ("blockwise", "noise-floor")])
def test_a_muon_update_is_bitwise_only_where_gtp_gathers_the_whole_matrix(mode, expected):
    # Each judged tensor's own inputs (the rule reads them per tensor): its step-1 main_grad bitwise.
    names = ("decoder.layers.0.mlp.linear_fc1.weight", "output_layer.weight")
    rows = [{"step": 0, "kind": "param", "tensor": n, "bitwise_equal": True, "policy": "exact"}
            for n in names]
    rows += [{"step": 1, "kind": "main_grad", "tensor": n, "bitwise_equal": True} for n in names]
    up = ex._Upstream(pd.DataFrame(rows))
    ref, cand = _cfg(gtp=1, muon_tp_mode=mode, clip_grad=0.0), _cfg(gtp=2, muon_tp_mode=mode, clip_grad=0.0)

    def judged(kind, tensor, shape, c=cand):
        return ex.expectation({"step": 1, "kind": kind, "tensor": tensor, "shape": shape}, ref, c, up, None)

    assert judged("param", "decoder.layers.0.mlp.linear_fc1.weight", [80, 64])[0] == expected
    # results.csv text
    assert judged("param", "decoder.layers.0.mlp.linear_fc1.weight", "(80, 64)")[0] == expected
    # The momentum buffer is an element-wise EMA; Adam's params step element-wise; GTP alike on both sides.
    assert judged("exp_avg", "decoder.layers.0.mlp.linear_fc1.weight", [80, 64])[0] == "bitwise"
    assert judged("param", "output_layer.weight", [72, 64])[0] == "bitwise"
    assert judged("param", "decoder.layers.0.mlp.linear_fc1.weight", [80, 64], c=ref)[0] == "bitwise"


# --- refusals -----------------------------------------------------------------------------


REFUSED = [
    ("muon-tp-mode-without-muon", edit("train", 'muon_tp_mode = "blockwise"'), "muon_tp_mode",
     "only with optimizer"),
    ("muon-unknown-tp-mode", edit("train", 'optimizer = "muon"\nmuon_tp_mode = "sharded"'), "muon_tp_mode",
     "one of"),
    ("muon-on-mlm", edit("train", 'optimizer = "muon"', text=BASE.replace('"megatron"', '"mlm"')),
     "optimizer",
     "mlm backend"),
    ("muon-with-experts", edit("train", 'optimizer = "muon"', text=edit("model", "num_experts = 2")),
     "optimizer",
     "routed experts"),
    ("muon-distributed-optimizer", edit("train", 'optimizer = "muon"\ndistributed_optimizer = true'),
     "distributed_optimizer", "Adam only"),
    ("muon-fault-without-muon", edit("candidate", f'inject = ["{FAULT}"]'), "inject", "never fires"),
]


@pytest.mark.parametrize(("text", "where", "rule"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_a_muon_combination_that_cannot_run_is_refused_before_launch(tmp_path, capsys, text, where, rule):
    path = tmp_path / "s.toml"
    path.write_text(text)
    code, out, err = _run(["run", str(path), "--out", str(tmp_path / "out")], capsys)
    _assert_one_clear_line(code, out, err, where, rule)
    assert not (tmp_path / "out" / "traces").exists()


# --- the shipped scenarios, on the installed wheel ------------------------------------------


@pytest.fixture(scope="module")
def muon_run(tmp_path_factory):
    """features.toml's Muon entries and, on the unpadded control, the planted faults (one more
    candidate each: the reference and the golden are the control's, reused)."""
    out = tmp_path_factory.mktemp("muon")
    mine = [s for s in scenario.load(FEATURES) if s.axes.get("feature", "").startswith("muon-")]
    control = next(s for s in mine if s.name == "muon-unpadded")
    planted = dataclasses.replace(control.candidate, inject=(FAULT,))
    faulty = dataclasses.replace(control, name="muon-fault", candidate=planted)
    scaled = dataclasses.replace(control, name="muon-fault-scaled",
                                 candidate=dataclasses.replace(control.candidate, inject=(SCALED,)))
    code = run_scenarios([*mine, faulty, scaled], out, parallel=2)
    return code, out, {s.name: s for s in mine}


# How far the fitted factor may sit from sqrt(128/80): megatron-core's Newton-Schulz runs in bf16
# (fp32_matmul_prec = "medium", harness/common/muon.py), and the two sides run it on two shapes
# (80 and 128 rows), whose GEMM kernels may round an element of the bf16 result differently, by
# up to one bf16 ULP (2^-7 relative at most). The fitted factor is a weighted mean of the
# elements' ratios, so it moves at most that much: 7.8e-3, which still tells sqrt(128/80) = 1.265
# from the neighbouring paddings' scales (sqrt(112/80) = 1.183, sqrt(144/80) = 1.342) and from 1.
NS_REL = torch.finfo(torch.bfloat16).eps


@pytest.mark.multirank
def test_padded_gtp_shards_scale_muons_update_as_recorded(muon_run):
    """0.19.2 gathers the padded shards: linear_fc1's update is sqrt(128/80) times GTP off's
    (Muon's spectral scale of 2 x 64 padded TP-local rows instead of 80), in duplicated and
    distributed mode; blockwise at TP 2 takes both shapes' scale as sqrt(64) and holds."""
    _, out, mine = muon_run
    for name in ("muon-duplicated", "muon-distributed"):
        s = summary(out, name)
        fd = s["first_divergence"]
        assert s["verdict"] == "known-divergence", (name, fd)
        assert (fd["step"], fd["kind"], fd["signature"]) == (1, "param", "update-term")
        assert (fd["tensor"].endswith("mlp.linear_fc1.weight")
                and "emerging_optimizers.py" in s["expect"]["reason"])
        assert fd["update"]["factor"] == pytest.approx(math.sqrt(128 / 80), rel=NS_REL)
    assert summary(out, "muon-blockwise")["verdict"] == "pass"


@pytest.mark.multirank
def test_the_unpadded_control_holds_bitwise_and_compares_momentum_per_parameter(muon_run):
    _, out, mine = muon_run
    assert summary(out, "muon-unpadded")["verdict"] == "pass"
    rows = results(out, "muon-unpadded")
    matrices = rows[[is_muon_matrix(t, ex._ndim(shape)) for t, shape in zip(rows["tensor"], rows["shape"])]]
    for kind in ("param", "exp_avg"):  # exp_avg: Muon's momentum buffer, per parameter, logical
        mine_rows = matrices[(matrices["kind"] == kind) & (matrices["step"] >= 1)]
        assert len(mine_rows) == 2 * 9, kind  # 2 steps x (8 linear weights + the position embedding)
        assert (mine_rows["expectation"] == "bitwise").all(), kind
        assert mine_rows["bitwise_equal"].astype(bool).all(), kind


@pytest.mark.multirank
def test_the_sides_and_the_golden_give_muon_the_same_parameters(muon_run):
    _, out, _ = muon_run
    paths = summary(out, "muon-unpadded")["traces"]
    golden = trace.read(paths["golden"], verify=False).infos[0]["stepped_by"]
    linear = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")
    expected = {n for n in golden if n.endswith(linear)} | {"embedding.position_embeddings.weight"}
    assert {n for n, k in golden.items() if k == "muon"} == expected
    assert set(golden.values()) == {"muon", "adamw"}
    for role in ("reference", "candidate"):  # megatron-core's own split, on every rank
        for rank, info in trace.read(paths[role], verify=False).infos.items():
            assert info["stepped_by"] == golden, (role, rank)


@pytest.mark.multirank
def test_the_planted_muon_fault_is_localized(muon_run):
    code, out, _ = muon_run
    assert code == 1  # the planted fault fails; the known divergences do not
    s, expect = summary(out, "muon-fault"), CATALOG[FAULT].expect
    fd = s["first_divergence"]
    assert s["verdict"] == "fail"
    assert (fd["step"], fd["phase"], fd["kind"]) == (expect["step"], expect["phase"], expect["kind"]), fd
    assert fd["tensor"].startswith("decoder.layers.") and fd["signature"] == expect["signature"], fd


@pytest.mark.multirank
def test_a_muon_update_scaled_as_if_padded_fails_at_its_step(muon_run):
    """One weight's Muon update scaled by sqrt(96/80), 9.5 % (GTP's alignment rows counted in the
    spectral scale) fails at step 1: on unpadded shards in duplicated mode that weight's main_grad,
    value and momentum going in are bitwise GTP off's, so its new value must be bitwise too. The
    fitted factor: both sides run Newton-Schulz on the same bits in one shape, so only fp32
    roundings of the update move it, well inside the bf16 bound above."""
    _, out, _ = muon_run
    s, expect = summary(out, "muon-fault-scaled"), CATALOG[SCALED].expect
    fd = s["first_divergence"]
    assert s["verdict"] == "fail"
    assert (fd["step"], fd["kind"], fd["tensor"], fd["signature"]) == (
        1, "param", expect["tensor"], expect["signature"]), fd
    assert fd["update"]["factor"] == pytest.approx(math.sqrt(96 / 80), rel=NS_REL)
