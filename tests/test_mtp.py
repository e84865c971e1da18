"""Multi-token prediction, without launching: megatron-core's parameter names and sizes, the
refusals (exit 2, before anything launches), the shift each depth applies (megatron-core's own
``roll_tensor``), the golden's repeated layer, the causal order and expectations of MTP rows, a
known failure to run (``[expect] raises``) and the launch of its own it gets, and the CPU
layer's TE placeholder wgrad."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest
import torch

from harness import scenario
from harness.backends import mtp as depths
from harness.backends.gpt import canonical_state, param_specs
from harness.common import mtp as names
from harness.compare import expectations as ex
from harness.compare import localize
from harness.compare.outcome import failure_outcome
from harness.compare.summary import Verdict
from harness.run.job import Job
from harness.run.plan import launches
from harness.scenario import Role
from harness.scenario.mtp_rules import mtp_parameter_count
from harness.scenario.schema import ModelConfig, Side
from tests.helpers import ROOT
from tests.test_bad_inputs import BASE, _assert_one_clear_line, _run, edit

TINY = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=80, seq_length=16, vocab_size=72)


def test_mtp_parameters_are_megatron_cores_names_and_sizes():
    plain = {s.name: s for s in param_specs(TINY)}
    for depth, repeated in ((2, False), (2, True), (1, False)):
        m = dataclasses.replace(TINY, mtp_num_layers=depth, mtp_use_repeated_layer=repeated)
        specs = param_specs(m)
        added = [s for s in specs if s.name not in plain]
        layers = {s.name.split(".")[2] for s in added}
        assert layers == ({"0"} if repeated else {str(k) for k in range(depth)})
        # megatron-core registers the MTP block after the decoder, before the output layer.
        assert (specs[-1].name == "output_layer.weight"
                and specs[-len(added) - 1].name.startswith("mtp.layers."))
        assert sum(torch.Size(s.shape).numel() for s in added) == mtp_parameter_count(m)
        eh = next(s for s in added if s.name.endswith("eh_proj.weight"))
        assert eh.shape == (64, 128) and eh.tp_dim == 0 and eh.gtp  # column-parallel over [embedding, hidden]


MTP_CASES = [
    ("mtp-vpp", 'mtp_num_layers = 1', "reference", "pipeline_parallel = 2\nvirtual_pipeline = 2",
     "[reference].virtual_pipeline", "not covered yet"),
    ("mtp-variable-mask-micro-batches", 'mtp_num_layers = 1', "data",
     'loss_mask = "variable"\nmicro_batch_size = 2',
     "[data].micro_batch_size", "micro_batch_size = 1"),
    ("mtp-torch-side", 'mtp_num_layers = 1', "candidate", 'backend = "torch"', "[candidate].backend",
     "golden only"),
    ("mtp-mlm-side", 'mtp_num_layers = 1', "candidate", 'backend = "mlm"', "[candidate].backend",
     "golden only"),
    ("mtp-tied", 'mtp_num_layers = 1\nuntie_embeddings = false', None, "", "[model].untie_embeddings",
     "untied"),
    ("mtp-too-deep", 'mtp_num_layers = 8', None, "", "[model].mtp_num_layers", "seq_length"),
    ("mtp-repeated-alone", 'mtp_use_repeated_layer = true', None, "", "[model].mtp_use_repeated_layer",
     "mtp_num_layers > 0"),
    ("mtp-fault-without-mtp", "", "candidate", 'inject = ["mtp-labels-not-shifted"]', "[candidate].inject",
     "without MTP"),
    ("mtp-fault-on-the-wheel", 'mtp_num_layers = 1', "candidate", 'inject = ["mtp-output-wgrad-dropped"]',
     "[candidate].inject", "backport-gtp-mtp"),
    ("mtp-backport-on-a-tree", 'mtp_num_layers = 1', "candidate",
     'inject = ["backport-gtp-mtp"]\nmegatron_core = "git:megatron-lm@main"', "[candidate].inject",
         "installed 0.19.2 wheel"),
    ("expect-raises-with-signature", 'mtp_num_layers = 1', "expect",
     'raises = "KeyError"\nsignature = "mismatch"\nreason = "x"', "[expect].raises", "no signature"),
]


@pytest.mark.parametrize(("model", "section", "line", "where", "rule"), [c[1:] for c in MTP_CASES],
                         ids=[c[0] for c in MTP_CASES])
def test_bad_mtp_scenario_exits_2_before_launching(tmp_path, capsys, model, section, line, where, rule):
    text = edit("model", model) if model else BASE
    if section is not None:
        text = edit(section, line, text=text)
    path = tmp_path / "s.toml"
    path.write_text(text)
    code, out, err = _run(["run", str(path), "--out", str(tmp_path / "out")], capsys)
    _assert_one_clear_line(code, out, err, where, rule)
    assert not (tmp_path / "out" / "traces").exists()


def test_each_depth_shifts_as_megatron_cores_roll_tensor():
    from megatron.core.transformer.multi_token_prediction import roll_tensor

    t = torch.arange(1, 17, dtype=torch.float32).view(2, 8)
    rolled = t
    for depth in range(4):  # process_mtp_loss rolls once more per depth
        rolled, total = roll_tensor(rolled, shifts=-1, dims=-1)
        assert torch.equal(depths.shifted(t, depth), rolled) and float(total) == float(rolled.sum())
    mask, losses = torch.ones(2, 8), torch.arange(16, dtype=torch.float64).view(2, 8)
    kept = depths.shifted(mask, 1)  # depth 1 predicts 2 places ahead: the last 2 positions are masked
    assert kept.sum(1).tolist() == [6.0, 6.0]
    assert depths.per_sample(losses, kept).tolist() == [2.5, 10.5]


def test_the_golden_repeated_layer_is_one_layer_at_every_depth():
    from harness.backends.torch.model import GPT

    m = dataclasses.replace(TINY, mtp_num_layers=2, mtp_use_repeated_layer=True)
    state = canonical_state(m, 3)
    two, one = GPT(dataclasses.replace(m, mtp_use_repeated_layer=False)).double(), GPT(m).double()
    for model in (one, two):
        for n, p in model.named_parameters():
            p.data.copy_(state[n.replace("mtp.layers.1.", "mtp.layers.0.")])
    tokens = torch.randint(0, 72, (2, 16))
    assert torch.equal(two(tokens), one(tokens))
    assert all(torch.equal(a, b) for a, b in zip(two.mtp_logits, one.mtp_logits)) and len(one.mtp_logits) == 2


def test_mtp_rows_sit_between_the_decoder_and_the_main_head_in_causal_order():
    order = ["decoder.layers.1.mlp", "decoder.final_layernorm", names.depth_name(0, "embedding"),
             names.depth_name(0, "enorm"), names.depth_name(0, "mtp_model_layer.self_attention"),
             names.depth_name(0), names.logits_name(0), names.loss_name(0), names.depth_name(1, "embedding"),
             "output_layer"]
    positions = [localize._layer_position(n) for n in order]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)
    assert localize.phase_of(names.LOSS_KIND, names.loss_name(0)) == "loss"


def _cfg(**kw) -> dict:
    side = Side(**{"backend": "megatron", "world_size": 2, **kw})
    return {**dataclasses.asdict(side), "micro_batches": 1, "mtp_num_layers": 2,
            "mtp_use_repeated_layer": True}


def test_a_weight_used_per_depth_expects_the_noise_floor_under_gtp_only():
    rows = [{"step": 0, "kind": "param", "tensor": "w", "passed": True, "policy": "exact",
             "bitwise_equal": True}]
    rows += [{"step": 1, "kind": "main_grad", "tensor": t, "passed": True, "policy": "noise-floor",
              "bitwise_equal": False, "nonfinite_mismatch": 0}
             for t in ("output_layer.weight", "mtp.layers.0.eh_proj.weight",
                       "decoder.layers.0.mlp.linear_fc1.weight",
                       "embedding.position_embeddings.weight")]
    policy = type("P", (), {"policy": "noise-floor"})()

    def judged(ref, cand):
        traces = {r: type("T", (), {"manifest": {"config": c}})()
                  for r, c in (("reference", ref), ("candidate", cand))}
        return ex.judge_rows(pd.DataFrame(rows), traces, policy).set_index("tensor")

    gtp = judged(_cfg(gtp=1), _cfg(gtp=2))
    for shared in ("output_layer.weight", "mtp.layers.0.eh_proj.weight"):
        assert (gtp.at[shared, "expectation"] == "noise-floor"
                and "per forward" in gtp.at[shared, "expectation_reason"])
        assert gtp.at[shared, "passed"]
    assert "1 + 2 times" in gtp.at["output_layer.weight", "expectation_reason"]
    assert "2 times" in gtp.at["mtp.layers.0.eh_proj.weight", "expectation_reason"]
    # A weight used once, or one GTP does not shard, keeps its rule (two terms: bitwise).
    for once in ("decoder.layers.0.mlp.linear_fc1.weight", "embedding.position_embeddings.weight"):
        assert gtp.at[once, "expectation"] == "bitwise" and not gtp.at[once, "passed"]
    off = judged(_cfg(gtp=1), _cfg(gtp=1))
    assert off.at["output_layer.weight", "expectation"] == "bitwise"


def _jobs(s: scenario.Scenario, provenance: dict) -> dict:
    return {role: Job(key=f"{s.name}-{role}", model=s.model, data=s.data, side=side, capture=s.capture,
                      trace_dir=f"/t/{s.name}-{role}", provenance=provenance)
            for role, side in s.sides.items()}


def test_a_known_failure_to_run_is_known_only_as_recorded_and_where_the_fix_is_absent():
    s = next(s for s in scenario.load(ROOT / "scenarios" / "features.toml") if s.name == "mtp1")
    assert s.expect.raises == "KeyError: None"
    raised = "side megatron-w2-tp1-gtp2-fp32: rank 0 raised at step 1: KeyError: None"
    wheel = _jobs(s, {"versions": {"megatron-core": "0.19.2"}})
    assert failure_outcome(s, {Role.CANDIDATE: raised}, wheel).verdict == Verdict.KNOWN_DIVERGENCE
    for failed in ({Role.CANDIDATE: "rank 0 raised at step 1: IndexError: 3"},  # another error
                   {Role.CANDIDATE: raised, Role.REFERENCE: raised}):  # the reference failed too
        assert failure_outcome(s, failed, wheel).verdict == Verdict.ERROR
    plain = dataclasses.replace(s, expect=None)
    assert failure_outcome(plain, {Role.CANDIDATE: raised}, wheel).verdict == Verdict.ERROR


def test_a_candidate_expected_to_raise_gets_a_launch_of_its_own():
    loaded = [s for s in scenario.load(ROOT / "scenarios" / "features.toml") if s.model.mtp_num_layers][:2]
    by_scenario = {s.name: _jobs(s, {}) for s in loaded}
    pending = {j.key: j for roles in by_scenario.values() for j in roles.values()}
    out = launches(by_scenario, loaded, pending)
    alone = [b for b in out if "-alone" in b.name]
    assert sorted(j.key for b in alone for j in b.jobs) == sorted(by_scenario[s.name]["candidate"].key
                                                                  for s in loaded)
    assert all(len(b.jobs) == 1 for b in alone)
    shared = [b for b in out if "-alone" not in b.name and b.world == 2]
    assert {j.side.gtp for b in shared for j in b.jobs} == {1}


def test_the_cpu_placeholder_wgrad_is_tes_one_reused_buffer():
    from harness.backends.megatron import compat

    compat._DUMMY_WGRADS.clear()
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # as every worker runs
    try:
        first = compat.get_dummy_wgrad([4, 3], torch.float32)
        assert torch.isnan(first).all()  # undefined content, filled as deterministic mode fills torch.empty
        again = compat.get_dummy_wgrad([4, 3], torch.float32)
        assert again.data_ptr() == first.data_ptr()  # one buffer per shape and dtype
        assert torch.equal(compat.get_dummy_wgrad([4, 3], torch.float32, zero=True), torch.zeros(4, 3))
        assert torch.equal(first, torch.zeros(4, 3))  # zeroing on request zeroes the shared buffer
        assert compat.get_dummy_wgrad([4, 3], torch.bfloat16).data_ptr() != first.data_ptr()
    finally:
        torch.use_deterministic_algorithms(deterministic)
        compat._DUMMY_WGRADS.clear()


def test_mtp_under_pipelining_holds_the_embeddings_on_the_last_stage_too():
    from types import SimpleNamespace

    from harness.backends.megatron.pipeline import owned, replica_stages, with_replica_stages
    from harness.common.layout import replicated

    names_ = ["embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
              "decoder.layers.0.x", "decoder.layers.1.x", "mtp.layers.0.eh_proj.weight",
              "output_layer.weight"]
    assert owned(names_, 2, 2, 1) == set(names_[3:])
    assert owned(names_, 2, 2, 1, mtp=True) == owned(names_, 2, 2, 1) | set(names_[:2])
    assert owned(names_, 2, 2, 0, mtp=True) == set(names_[:3])
    job = lambda d, p: SimpleNamespace(model=SimpleNamespace(mtp_num_layers=d),  # noqa: E731
                                       side=SimpleNamespace(pipeline_parallel=p))
    assert replica_stages(job(1, 3)) == (0, 2)
    assert replica_stages(job(1, 1)) == () == replica_stages(job(0, 2))
    layouts = {n: replicated((2, 3)) for n in names_}
    marked = with_replica_stages(layouts, job(1, 2))
    assert {n for n, lay in marked.items() if lay.replica_stages == (0, 1)} == set(names_[:2])
    assert marked[names_[0]].to_json()["replica_stages"] == [0, 1]
    assert "replica_stages" not in layouts[names_[0]].to_json()
    assert with_replica_stages(layouts, job(0, 2)) is layouts


def _two_stage_trace(path, drift: float):
    """Stage 0 (rank 0) and stage 1 (rank 1) each record a copy of one weight, declared replicas."""
    from harness.capture.api import Capture
    from harness.common.layout import replicated

    def layout(name, p):
        return dataclasses.replace(replicated(tuple(p.shape)), replica_stages=(0, 1))

    coords = {r: {"tp": 0, "gtp": 0, "dp": 0, "pp": r} for r in (0, 1)}
    for rank in (0, 1):
        cap = Capture(path, rank=rank, world_size=2, coord=coords[rank], mesh={"pp": 2})
        cap.begin_step(1)
        w = torch.nn.Parameter(torch.arange(6.0).view(2, 3) + rank * drift)
        cap.params("param", [("embedding.word_embeddings.weight", w)], layout)
        cap.end_step()
        cap.close()
    Capture.finalize(path, world_size=2, coords=coords, mesh={"pp": 2})


@pytest.mark.parametrize("drift", [0.0, 0.5])
def test_a_copy_on_another_stage_assembles_from_the_first_and_drift_is_a_replica_violation(tmp_path, drift):
    from harness.capture import trace
    from harness.compare.assemble import assemble_trace

    _two_stage_trace(tmp_path / "t", drift)
    logical = assemble_trace(trace.read(tmp_path / "t"))
    first = logical.tensors[(1, "param", "embedding.word_embeddings.weight")]
    assert torch.equal(first, torch.arange(6.0).view(2, 3))
    got = [(v["axis"], v["ranks"], v["max_abs"]) for v in logical.replica_violations]
    assert got == ([("pp", [0, 1], drift)] if drift else [])


def test_the_mtp_stage_names_its_first_embedding_call_depth_0():
    class Cap:
        def __init__(self):
            self.names = []

        def output(self, kind, name, output, sp=False):
            self.names.append(name)

    depth_calls = ["mtp.layers.0.embedding", "mtp.layers.1.embedding"]
    for decoder_embeds, expected in ((True, ["embedding", *depth_calls]), (False, depth_calls)):
        cap = Cap()
        state = depths.DepthCapture(cap, 2, decoder_embeds=decoder_embeds)
        for _ in expected:
            state.embedding_hook(None, (), torch.zeros(1))
        assert cap.names == expected


def test_the_golden_weighs_each_depth_as_process_mtp_loss_does_under_a_per_token_loss():
    """megatron-core's own process_mtp_loss, one micro-batch of one sample at a time, its gradient
    (MTPLossAutoScaler at the per-token loss's scale 1) divided by the global token count as
    finalize divides it, against the golden's objective in fp64: equal; the mean loss's global
    token mean is another objective under a variable mask."""
    from types import SimpleNamespace

    import torch.nn.functional as F
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, process_mtp_loss

    torch.manual_seed(0)
    D, s, h, V = 2, 16, 8, 11
    cfg = SimpleNamespace(mtp_num_layers=D, mtp_detach_heads=False, mtp_loss_scaling_factor=0.1,
                          calculate_per_token_loss=True)
    lengths = [16, 5, 9, 12]
    mask = torch.stack([(torch.arange(s) < n).double() for n in lengths])  # [b, s]
    labels = torch.randint(0, V, (len(lengths), s))
    hidden = torch.randn((1 + D) * s, len(lengths), h, dtype=torch.float64)  # [(1 + D) s, b, h]
    w = torch.randn(V, h, dtype=torch.float64, requires_grad=True)

    def output_layer(x, weight=None, runtime_gather_output=None):
        return x @ w.t(), None

    def lm_loss(lab, logits):  # [b, s] per-token cross entropy of logits [s, b, V]
        return F.cross_entropy(logits.transpose(0, 1).reshape(-1, V), lab.reshape(-1),
                               reduction="none").view(lab.shape)

    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0, dtype=torch.float64))
    for i in range(len(lengths)):
        out = process_mtp_loss(hidden[:, i:i + 1], labels[i:i + 1], mask[i:i + 1], output_layer, None, None,
                               False, lm_loss, cfg)
        (out.sum() * 0).backward()
    theirs = w.grad / mask.sum()
    ours = {}
    for variable in (True, False):
        w.grad = None
        total = sum(depths.depth_objective(lm_loss(depths.shifted(labels, d), output_layer(chunk)[0]),
                                           depths.shifted(mask, d), mask, variable)
                    for d, chunk in enumerate(hidden.chunk(1 + D)[1:]))
        (total * cfg.mtp_loss_scaling_factor / D).backward()
        ours[variable] = w.grad.clone()
    # fp64, the same (1 + D) s b products summed in another order: far within 1e-12 (4500 eps)
    assert torch.allclose(ours[True], theirs, rtol=1e-12, atol=0)
    assert not torch.allclose(ours[False], theirs, rtol=1e-3, atol=0)
