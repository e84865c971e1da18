"""The architecture switches of [model] (issue 37) on megatron-core's real code, one run of two
files: ``scenarios/architectures.toml`` (each switch at GTP 2 against GTP off, both against the
fp64 golden; verdicts as recorded) and ``tests/assets/architectures_golden.toml`` (megatron-core
GTP off against the golden model in fp32, TP 1). For each switch, the model megatron-core built
has the parameters and shapes the switch implies (read off the megatron side's trace: the harness
loads canonical weights into exactly what megatron-core built, and records each shard's layout
as megatron-core's attributes give it), and the golden matches megatron-core to the noise floor."""

from __future__ import annotations


import pytest
import torch

from harness import scenario
from harness.capture import trace
from tests.arch_expect import aux_loss, expected_linear, expert_cut, params_at
from tests.helpers import ASSETS, ROOT, results, run, summary

MATRIX = scenario.load(ROOT / "scenarios" / "architectures.toml")
GOLDEN = scenario.load(ASSETS / "architectures_golden.toml")
BY_NAME = {s.name: s for s in MATRIX + GOLDEN}

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def arch_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("arch")
    code, doc = run(MATRIX + GOLDEN, out, parallel=2)
    return code, {s["scenario"]: s for s in doc["scenarios"]}, out


def test_every_verdict_is_the_recorded_one(arch_run):
    code, by_name, _ = arch_run
    assert code == 0, {n: (s["verdict"], s.get("first_divergence")) for n, s in by_name.items()}
    for s in MATRIX + GOLDEN:
        want = "known-divergence" if s.expect is not None else "pass"
        assert by_name[s.name]["verdict"] == want, (s.name, by_name[s.name].get("first_divergence"))


BUILT = [s.name for s in MATRIX if not s.model.num_experts and (
    s.candidate.tp > 1 or s.model.normalization != "LayerNorm"
    or s.model.position_embedding_type != "learned_absolute" or s.model.num_query_groups
    or s.model.qk_layernorm or s.model.softmax_type != "vanilla")]
# (at parity: a recorded divergence elsewhere in the model reaches fc1 by step 2)
GATED_TP = [s.name for s in MATRIX if s.model.activation in ("swiglu", "geglu") and s.candidate.tp > 1
            and s.expect is None and not s.model.num_experts]  # the dense MLP's fc1 (experts: MOE_TP)


@pytest.mark.parametrize("name", BUILT + [s.name for s in GOLDEN])
def test_megatron_core_built_what_the_switch_implies(arch_run, name):
    _, by_name, _ = arch_run
    s = BY_NAME[name]
    got = params_at(by_name[name]["traces"]["reference"])  # megatron-core, GTP off
    want = expected_linear(s.model, s.reference.tp, s.reference.etp)
    layer0 = {n: v for n, v in got.items() if n.startswith("decoder.layers.0.")}
    assert layer0 == want
    final = {n for n in got if n.startswith("decoder.final_layernorm.")}
    bias = {"decoder.final_layernorm.bias"} if s.model.normalization == "LayerNorm" else set()
    assert final == {"decoder.final_layernorm.weight"} | bias
    # Only learned absolute positions have a table (RoPE's frequencies are no parameter).
    h, learned = s.model.hidden_size, s.model.position_embedding_type == "learned_absolute"
    embedding = {n: v for n, v in got.items() if n.startswith("embedding.position")}
    table = {"embedding.position_embeddings.weight": ((s.model.seq_length, h), {})}
    assert embedding == (table if learned else {})
    # Tied: megatron-core's output layer holds no weight of its own (the word embedding's serves).
    assert ("output_layer.weight" in got) == s.model.untie_embeddings


# (not where the candidate raises, recorded with [expect] raises: a tied output layer under GTP)
@pytest.mark.parametrize("name", [s.name for s in MATRIX if (s.model.add_bias_linear or s.model.add_qkv_bias)
                                  and not (s.expect and s.expect.raises)])
def test_biases_are_replicated_over_the_gtp_group(arch_run, name):
    """Beside a GTP-sharded weight its bias stays whole over the GTP peers: megatron-core's
    attributes say no GTP placement, and the peers hold the same bias after every step."""
    _, by_name, out = arch_run
    got = params_at(by_name[name]["traces"]["candidate"])
    biases = {n: v for n, v in got.items() if n.endswith(".bias") and "layernorm" not in n}
    assert biases and all("gtp" not in placements for _, placements in biases.values())
    weights = {n: v for n, v in got.items() if n.endswith("linear_qkv.weight")}
    assert weights and all(placements.get("gtp") == "S(0)" for _, placements in weights.values())
    df = results(out, name)
    compared = df[df["tensor"].isin(list(biases)) & (df["kind"] == "main_grad")]
    assert len(compared) == 2 * len(biases)  # both steps, every layer's
    assert summary(out, name)["invariants"]["replica"] == []


ATTENTION_TP = [s.name for s in MATRIX if s.candidate.tp > 1
                and (s.model.qk_layernorm or s.model.softmax_type == "learnable")]


@pytest.mark.parametrize("name", ATTENTION_TP)
def test_the_attention_parameters_are_whole_or_cut_by_heads_over_tp_and_whole_over_gtp(arch_run, name):
    """TP 2 x GTP 2: the query and key norms are whole on every rank (each TP rank's heads give a part
    of their grad, summed over TP by finalize_model_grads); the learnable softmax's 4 offsets are cut
    over TP with the heads, 2 a rank (megatron-core tags them with no TP attribute: the harness reads
    the cut off their shape), and neither is GTP-sharded. Their grads were compared at both steps and
    the replicas (TP for the norms, GTP for both) agree."""
    _, by_name, out = arch_run
    m = BY_NAME[name].model
    got = params_at(by_name[name]["traces"]["candidate"])
    attn = {n: v for n, v in got.items() if ".q_layernorm." in n or ".k_layernorm." in n
            or n.endswith(".softmax_offset")}
    head = m.hidden_size // m.num_attention_heads
    want = {}
    for i in range(m.num_layers):
        p = f"decoder.layers.{i}.self_attention."
        for n in ("q_layernorm", "k_layernorm") if m.qk_layernorm else ():
            want[p + n + ".weight"] = ((head,), {})
            if m.normalization == "LayerNorm":
                want[p + n + ".bias"] = ((head,), {})
        if m.softmax_type == "learnable":
            want[p + "core_attention.softmax_offset"] = ((2,), {"tp": "S(0)"})
    assert attn == want
    df = results(out, name)
    grads = df[df["tensor"].isin(list(attn)) & (df["kind"] == "main_grad")]
    assert len(grads) == 2 * len(attn) and grads["passed"].astype(bool).all()
    assert summary(out, name)["invariants"]["replica"] == []


@pytest.mark.parametrize("name", [s.name for s in GOLDEN])
def test_the_golden_matches_megatron_core_to_the_noise_floor(arch_run, name):
    _, by_name, out = arch_run
    assert by_name[name]["verdict"] == "pass", by_name[name].get("first_divergence")
    df = results(out, name)
    tensors = df[df["kind"] != "scalar"]
    assert tensors["passed"].astype(bool).all()
    names = set(tensors[tensors["kind"] == "main_grad"]["tensor"])
    assert set(expected_linear(BY_NAME[name].model, 1)) <= names
    # Copies, not computations: the same canonical weights and token ids on both sides.
    copies = tensors[(tensors["step"] == 0) | (tensors["kind"] == "input")]
    assert len(copies) and copies["bitwise_equal"].astype(bool).all()
    # The verdict bounds the golden's error by megatron-core's: a golden that computed another
    # model passes it alike (both torch sides share its math). The same rule the other way round:
    # megatron-core's error against the fp64 golden within k x the fp32 golden's, plus the floor
    # (the bound less its k x reference term).
    judged = tensors[(tensors["policy"] == "noise-floor") & ~tensors["bitwise_equal"].astype(bool)
                     & tensors["ref_err_golden"].notna() & (tensors["step"] >= 1)]
    k = judged["step"].map(BY_NAME[name].compare.k_at)  # the k each row was judged with
    floor = judged["bound"] - k * judged["ref_err_golden"]
    far = judged[judged["ref_err_golden"] > k * judged["cand_err_golden"] + floor]
    assert len(judged) and far.empty, far[["step", "kind", "tensor", "ref_err_golden", "cand_err_golden"]]


@pytest.mark.parametrize("name", GATED_TP)
def test_a_gated_fc1_is_cut_by_halves_over_tp_and_padded_whole_by_gtp(arch_run, name):
    """TP 2 x GTP 2, FFN 80: rank (t, g) holds rows [48 g, 48 g + 48) of TP block t = [gate_t; up_t]
    (80 rows padded to 96, alignment 16 x 2): GTP rank 0's shard crosses from the gate into the up
    half. megatron-core's attributes say so (the harness checks its own layout against them before
    loading), and the assembled logical fc1 passed at every step."""
    _, by_name, out = arch_run
    t = trace.read(by_name[name]["traces"]["candidate"])
    fc1 = [e for e in t.entries if e.kind == "param" and e.name.endswith("mlp.linear_fc1.weight")]
    f, h = BY_NAME[name].model.ffn_hidden_size, BY_NAME[name].model.hidden_size
    for e in fc1:
        doc = e.layout.to_json()
        assert doc["strides"] == {"tp": 2} and doc["pads"] == {"gtp": 96 - f}
        assert tuple(e.local_shape) == (48, h)
    df = results(out, name)
    rows = df[df["tensor"].str.endswith("mlp.linear_fc1.weight")]
    assert set(rows["kind"]) >= {"param", "main_grad", "materialized"} and rows["passed"].astype(bool).all()


@pytest.mark.parametrize("name", ["mqa-tp1-gtp2-fp32", "gqa-tp2-gtp2-fp32"])
def test_a_qkv_shaped_like_the_padded_embedding_shares_its_gather_buffer(arch_run, name):
    """The recorded GQA divergence is what its reason says: the embedding's forward lookup read layer
    0's QKV weight (the gather recorder's evidence), and the same model with prefetch off is at parity."""
    _, by_name, _ = arch_run
    first = by_name[name]["first_divergence"]
    assert by_name[name]["verdict"] == "known-divergence" and first["step"] == 1
    pairs = {(c["param"], c["consumed"]) for c in first["consumed"]}
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert pairs == {("embedding.word_embeddings.weight", qkv)}
    assert by_name["gqa-tp2-gtp2-prefetch-off-fp32"]["verdict"] == "pass"


# A padded vocabulary: 71 tokens, make_vocab_size_divisible_by 4. Written out here, not read from the
# harness: 71 padded to a multiple of 4 x TP is 72 rows at TP 1 and at TP 2, one padded row; its
# TP-local rows (TP, G) -> 72 at TP 1, 36 at TP 2; GTP 2 pads 72 to 96 (48 a shard) and 36 to 64 (32).
PADDED_ROWS = {(1, 1): 72, (2, 1): 36, (1, 2): 48, (2, 2): 32}
VOCAB = [s.name for s in MATRIX + GOLDEN if s.model.make_vocab_size_divisible_by != 1]


@pytest.mark.parametrize("name", VOCAB)
def test_megatron_core_built_the_padded_vocabulary(arch_run, name):
    """megatron-core's word embedding and output layer hold the padded rows (the harness loads its
    canonical weights into exactly what megatron-core built), the trace describes the padded row."""
    _, by_name, _ = arch_run
    s = BY_NAME[name]
    assert (s.model.vocab_size, s.model.make_vocab_size_divisible_by, s.model.hidden_size) == (71, 4, 64)
    roles = [r for r in ("reference", "candidate") if s.sides[r].backend == "megatron"]
    for role in roles:
        side = s.sides[role]
        got = params_at(by_name[name]["traces"][role])
        t = trace.read(by_name[name]["traces"][role])
        for table in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert got[table][0] == (PADDED_ROWS[(side.tp, side.gtp)], 64), (role, table)
            layout = next(e.layout for e in t.entries if e.name == table and e.kind == "param")
            assert (layout.logical_shape, layout.vocab_padding) == ((72, 64), 1)


def test_the_padded_row_takes_part_in_the_softmax_and_no_token_reaches_it(arch_run):
    """In megatron-core (GTP off, TP 1) the output layer's padded row gets a gradient, its share of
    the softmax denominator; the word embedding's padded row none, exactly: no token looks it up.
    The golden holds the same (the case passes against it)."""
    from harness.compare.assemble import assemble_trace

    _, by_name, _ = arch_run
    name = "golden-vocab-pad"
    for role in ("reference", "candidate"):  # megatron-core, the golden model
        tensors = assemble_trace(trace.read(by_name[name]["traces"][role])).tensors
        embedding = tensors[(1, "main_grad", "embedding.word_embeddings.weight")]
        output = tensors[(1, "main_grad", "output_layer.weight")]
        assert bool(embedding[:71].ne(0).any()) and bool(embedding[71].eq(0).all()), role
        assert bool(output[71].ne(0).all()), role
    assert by_name[name]["verdict"] == "pass"
MOE = [s.name for s in MATRIX if s.model.num_experts and s.candidate.tp == 1]
MOE_TP = [s.name for s in MATRIX if s.model.num_experts and s.candidate.tp > 1]
GROUPED = [s.name for s in MATRIX + GOLDEN if s.model.moe_router_group_topk]


@pytest.mark.parametrize("name", MOE)
def test_the_moe_layer_megatron_core_built_under_ep_and_expert_gtp(arch_run, name):
    """Rank 0 of the candidate (dense GTP 2, expert GTP 2): the router whole; the routed experts of its
    EP coordinate only (EP 2: experts 0 and 1 of 4), each weight padded and cut in two by expert GTP on
    the expert grid: a gated fc1 [gate; up] of FFN 72 is 144 rows padded to 160, rank 0's 80 rows the 72
    gate rows and 8 up rows; the shared experts' MLP padded and cut by the dense GTP group (40 x 2 rows
    padded to 96). Read off megatron-core's own attributes (``is_gtp_weight_remat``, ``pad_length``)."""
    _, by_name, _ = arch_run
    s = BY_NAME[name]
    m, p = s.model, "decoder.layers.0.mlp."
    h, f, k = m.hidden_size, m.ffn_hidden_size, 2 if m.activation in ("swiglu", "geglu") else 1
    t = trace.read(by_name[name]["traces"]["candidate"])
    got = {e.name: (tuple(e.local_shape), *(e.layout.to_json().get(key) for key in
                                           ("logical_shape", "placements", "pads", "fixed")))
           for e in t.entries if e.kind == "param" and e.step == 0 and e.rank == 0 and e.name.startswith(p)}
    want = {p + "router.weight": ((m.num_experts, h), [m.num_experts, h], {}, {}, None)}
    for e in range(m.num_experts // s.candidate.ep):
        want[f"{p}experts.local_experts.{e}.linear_fc1.weight"] = (*expert_cut(k * f, h, 0, 1, 2), {"ep": 0})
        want[f"{p}experts.local_experts.{e}.linear_fc2.weight"] = (*expert_cut(h, f, 1, 1, 2), {"ep": 0})
    if shared := m.moe_shared_expert_intermediate_size:
        want[p + "shared_experts.linear_fc1.weight"] = (*expert_cut(k * shared, h, 0, 1, 2), None)
        want[p + "shared_experts.linear_fc2.weight"] = (*expert_cut(h, shared, 1, 1, 2), None)
    assert got == want


@pytest.mark.parametrize("name", MOE_TP)
def test_the_moe_layer_megatron_core_built_at_tp_2(arch_run, name):
    """Rank 0 of the candidate (TP 2, sequence parallelism): the router whole; each routed expert cut by
    the expert TP group (expert TP 2: fc1 [gate_0; up_0] of 36 + 36 rows, partition_stride 2, fc2 36
    columns; expert TP 1: whole) and, under expert GTP 2, that block padded (72 -> 96, 144 -> 160 rows)
    and halved, on the expert grid. Read off megatron-core's own attributes. At step 0 each logical
    weight the harness assembles from these shards is bitwise the reference's (TP 1, or GTP off)."""
    _, by_name, out = arch_run
    s = BY_NAME[name]
    m, side, p = s.model, s.candidate, "decoder.layers.0.mlp."
    h, f, k = m.hidden_size, m.ffn_hidden_size, 2 if m.activation in ("swiglu", "geglu") else 1
    etp, eg = side.etp, side.expert_gtp
    t = trace.read(by_name[name]["traces"]["candidate"])
    got = {e.name: (tuple(e.local_shape), *(e.layout.to_json().get(key) for key in
                                           ("logical_shape", "placements", "pads", "fixed", "strides")))
           for e in t.entries if e.kind == "param" and e.step == 0 and e.rank == 0 and e.name.startswith(p)}
    on_grid = {"ep": 0} if etp != side.tp or eg > 1 else None  # the dense mesh is the expert grid otherwise
    want = {p + "router.weight": ((m.num_experts, h), [m.num_experts, h], {}, {}, None, None)}
    for e in range(m.num_experts):
        stride = {"tp": 2} if etp > 1 and k == 2 else None
        q = f"{p}experts.local_experts.{e}."
        want[q + "linear_fc1.weight"] = (*expert_cut(k * f, h, 0, etp, eg), on_grid, stride)
        want[q + "linear_fc2.weight"] = (*expert_cut(h, f, 1, etp, eg), on_grid, None)
    assert got == want
    df = results(out, name)
    mlp = df[df["tensor"].str.contains(r"\.mlp\.(?:router|experts)\.") & (df["step"] == 0)]
    assert len(mlp) == m.num_layers * (1 + 2 * m.num_experts) and mlp["bitwise_equal"].astype(bool).all()
    if s.expect is not None:
        return  # a recorded divergence (its reason says where): the layout above is megatron-core's
    # The router's logits are each TP rank's sequence chunk, assembled whole: the same experts for every
    # token (2 layers x 2 quantities x 2 steps).
    routing = df[df["tensor"].str.endswith((".routing_map", ".tokens_per_expert"))]
    assert len(routing) == 2 * 2 * 2 and routing["bitwise_equal"].astype(bool).all()
    assert df["passed"].astype(bool).all() and summary(out, name)["invariants"]["replica"] == []


@pytest.mark.parametrize("name", GROUPED)
def test_group_limited_routing_reached_megatron_core(arch_run, name):
    """Every token megatron-core routed went to experts of exactly moe_router_group_topk groups (of
    consecutive expert indices), where the plain top-k of the same logits crosses more groups for some
    token: the group limit took effect."""
    _, by_name, _ = arch_run
    m = BY_NAME[name].model
    t = trace.read(by_name[name]["traces"]["reference"])
    size = m.num_experts // m.moe_router_num_groups
    by_kind = {what: [t.tensor(e) for e in t.entries if e.kind == "activation"
                      and e.name.endswith(f"mlp.router.{what}")] for what in ("routing_map", "logits")}
    assert by_kind["routing_map"] and len(by_kind["routing_map"]) == len(by_kind["logits"])
    crossed = 0
    for chosen, logits in zip(by_kind["routing_map"], by_kind["logits"]):
        chosen, logits = chosen.reshape(-1, m.num_experts), logits.reshape(-1, m.num_experts)
        assert (chosen.sum(-1) == m.moe_topk).all()
        groups = chosen.reshape(-1, m.moe_router_num_groups, size).amax(-1).sum(-1)
        assert (groups == m.moe_router_group_topk).all()
        plain = torch.zeros_like(logits, dtype=torch.bool).scatter(1, logits.topk(m.moe_topk, dim=1)[1], True)
        crossed += int((plain.reshape(-1, m.moe_router_num_groups, size).any(-1).sum(-1)
                        > m.moe_router_group_topk).sum())
    assert crossed > 0


@pytest.mark.parametrize("name", [s.name for s in GOLDEN if s.model.num_experts])
def test_megatron_core_routes_every_token_as_the_golden_model(arch_run, name):
    """Routing is exact: every token to the same experts as the golden model (its errors against the
    fp64 golden are bounded both ways by test_the_golden_matches_megatron_core_to_the_noise_floor)."""
    _, _, out = arch_run
    df = results(out, name)
    routing = df[df["tensor"].str.endswith((".routing_map", ".tokens_per_expert"))]
    assert len(routing) and (routing["ref_err_golden"] == 0).all()


def test_the_router_padding_mask_reached_megatron_core(arch_run):
    """megatron-core's recorded load-balancing loss of each micro-batch (one sample) is the written-out
    formula over the tokens the loss mask keeps with moe_router_padding_mask, over all tokens without it;
    the two differ where the mask drops tokens. Bound: fp32 sums of the t <= 16 scores and E products and the
    softmax's rounding, (t + 2 E + 8) eps_fp32 of the value (the fp64 recomputation adds nothing seen)."""
    from harness.backends import data as data_mod

    _, by_name, _ = arch_run
    eps, dropped = torch.finfo(torch.float32).eps, 0
    for name, padding in (("golden-moe-padding-mask", True), ("golden-moe-variable-mask", False)):
        s = BY_NAME[name]
        m, t = s.model, trace.read(by_name[name]["traces"]["reference"])
        entries = [e for e in t.entries
                   if e.kind == "activation" and e.step == 1 and ".mlp.router." in e.name]
        logits = {(e.name.split(".mlp.")[0], e.sample_ids): t.tensor(e)
                  for e in entries if e.name.endswith("logits")}
        aux = [e for e in entries if e.name.endswith("aux_loss")]
        assert aux and len(aux) == len(logits)
        for e in aux:
            mask = data_mod.loss_mask(s.data, list(e.sample_ids), m.seq_length).reshape(-1).bool()
            lg = logits[(e.name.split(".mlp.")[0], e.sample_ids)].reshape(-1, m.num_experts)
            kept, every = aux_loss(m, lg, mask), aux_loss(m, lg, torch.ones_like(mask))
            got = t.tensor(e).double().reshape(-1)[0]
            bound = (m.seq_length + 2 * m.num_experts + 8) * eps * got.abs()
            assert (got - (kept if padding else every)).abs() <= bound, (name, e.name, e.sample_ids)
            if padding and not mask.all():
                dropped += 1
                assert (got - every).abs() > bound, (name, e.name, e.sample_ids)
    assert dropped > 0
