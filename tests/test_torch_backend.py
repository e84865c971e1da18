"""The torch backend's pieces, in one process: collectives on one-rank groups, the loss, the
optimizer's counting rules, the quantized all-gather of GTP shards run by threads standing in
for the ranks of a GTP group (each thread runs the backend's own code), and the distributed
training loop at world 1 against the golden loop."""

import math
import threading

import pytest
import torch
import torch.nn.functional as F

from harness.compare import bounds
from harness.capture import trace
from harness.compare.assemble import assemble_trace
from harness.run.job import Job
from harness.backends.torch import comm, fp8
from harness.backends.torch.distributed import run_distributed
from harness.backends.torch.model import GPT
from harness.backends.torch.optim import clip, counted, grad_stats, lr_at
from harness.backends.torch.parallel import shard_model
from harness.backends.torch.run import run
from harness.capture.api import Capture
from harness.backends.gpt import canonical_state, layout_of, param_specs
from harness.common.layout import gtp_pad
from harness.quant import RECIPES
from harness.scenario.schema import CapturePolicy, DataConfig, ModelConfig, Side


def test_vocab_parallel_cross_entropy_matches_torch_on_one_rank():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 3, 40, generator=gen, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 40, (6, 3), generator=gen)
    loss = comm.vocab_parallel_cross_entropy(logits, target, None)
    ref = F.cross_entropy(logits.reshape(-1, 40), target.reshape(-1), reduction="none").view(6, 3)
    # Two fp64 computations of log(sum_v exp(x_v)) - x_t: a sum of V positive terms (gamma_V
    # relative, an absolute error after the log), exp and log (libm: within 1 ulp, 2 roundings
    # each) and the shift by the max and the target (ulps of |max| and |loss|). Each side is
    # within gamma_(V+4) (1 + |max| + |loss|) of the exact loss; softmax - one-hot likewise
    # within gamma_(V+4) (probabilities <= 1).
    gamma = bounds.gamma(logits.shape[-1] + 4, torch.float64)
    atol = 2 * gamma * (1 + float(logits.detach().abs().max()) + float(ref.detach().abs().max()))
    torch.testing.assert_close(loss, ref, rtol=0, atol=atol)
    (g,) = torch.autograd.grad(loss.sum(), logits)
    (g_ref,) = torch.autograd.grad(ref.sum(), logits)
    torch.testing.assert_close(g, g_ref, rtol=0, atol=2 * gamma)
    assert logits.grad is None and not torch.isnan(loss).any()


def test_gtp_gather_strips_pad_and_backward_lands_in_main_grad():
    shard_ = torch.randn(8, 3, requires_grad=True)
    shard_.main_grad = torch.zeros(8, 3)
    full = comm.gather_gtp(shard_, None, pad=2)  # one rank: the "gather" is the shard itself
    assert full.shape == (6, 3) and torch.equal(full, shard_.detach()[:6])
    grad = torch.randn(6, 3)
    full.backward(grad)
    assert shard_.grad is None  # megatron-core's .grad of a GTP param is a dummy: main_grad only
    assert torch.equal(shard_.main_grad[:6], grad) and not shard_.main_grad[6:].any()  # pad rows get 0
    full2 = comm.gather_gtp(shard_, None, pad=2)
    full2.backward(grad)
    assert torch.equal(shard_.main_grad[:6], 2 * grad)  # micro-batches accumulate


def test_one_rank_groups_are_none_and_collectives_are_no_ops():
    groups = comm.groups_for(Side(backend="torch", world_size=1))
    assert set(vars(groups).values()) == {None}
    t = torch.arange(4.0)
    assert comm.all_reduce(t, None) is t and comm.all_reduce_avg(t, None) is t
    assert comm.all_gather_dim(t, None) is t and comm.reduce_scatter_rows(t, None) is t


def test_counted_once_for_replicated_params_always_for_shards():
    m = ModelConfig(num_layers=1, hidden_size=16, ffn_hidden_size=32, num_attention_heads=2,
                    seq_length=8, vocab_size=32)
    side = Side(world_size=4, tp=2, gtp=2)
    specs = {s.name: s for s in param_specs(m)}
    ln = specs["decoder.final_layernorm.weight"]
    fc1 = specs["decoder.layers.0.mlp.linear_fc1.weight"]
    p_ln, p_fc1 = torch.zeros(16), torch.zeros(16, 16)
    p_fc1.is_gtp_weight_remat = True
    for t in (0, 1):
        for g in (0, 1):
            c = {"tp": t, "gtp": g, "dp": 0}
            assert counted(p_fc1, layout_of(fc1, side), c)
            assert counted(p_ln, layout_of(ln, side), c) == (t == 0 and g == 0)
    # TP-sharded but not GTP-sharded (GTP off): every TP rank holds distinct rows.
    assert counted(torch.zeros(1), layout_of(fc1, Side(world_size=2, tp=2)), {"tp": 1, "gtp": 0, "dp": 0})
    # A column-parallel layer's bias: TP-sharded, replicated over GTP: counted once per GTP group.
    biased = param_specs(ModelConfig(num_layers=1, hidden_size=16, ffn_hidden_size=32, num_attention_heads=2,
                                     seq_length=8, vocab_size=32, add_bias_linear=True))
    bias = next(s for s in biased if s.name == "decoder.layers.0.mlp.linear_fc1.bias")
    for t in (0, 1):
        for g in (0, 1):
            assert counted(torch.zeros(8), layout_of(bias, side), {"tp": t, "gtp": g, "dp": 0}) == (g == 0)


def test_grad_stats_and_clip():
    side = Side(world_size=1)
    m = ModelConfig(num_layers=1, hidden_size=16, ffn_hidden_size=32, num_attention_heads=2,
                    seq_length=8, vocab_size=32)
    specs = {s.name: s for s in param_specs(m)}
    layouts = {n: layout_of(s, side) for n, s in specs.items()}
    named = []
    for name, s in specs.items():
        p = torch.zeros(s.shape)
        p.main_grad = torch.full(s.shape, 0.5)
        p.main_grad.view(-1)[0] = 0.0
        named.append((name, p))
    norm, zeros = grad_stats(named, layouts, {"tp": 0, "gtp": 0, "dp": 0}, None)
    n = sum(math.prod(s.shape) for s in specs.values())
    assert zeros == len(specs)
    # fp64 sums of n squares and a root: within gamma_(n+2) of the exact norm.
    assert math.isclose(norm, 0.5 * math.sqrt(n - len(specs)), rel_tol=bounds.gamma(n + 2, torch.float64))
    grads = [p.main_grad for _, p in named]
    clip(grads, 1.0, norm)
    clipped = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))
    # Each fp32 element scaled by the coefficient (rounded to fp32, then the product): 2 fp32
    # roundings, relative, so the norm too; plus the fp64 norm of the clipped grads.
    rel = bounds.gamma(2, torch.float32) + bounds.gamma(n + 2, torch.float64)
    assert math.isclose(clipped, norm / (norm + 1e-6), rel_tol=rel)


def test_lr_schedule_in_samples():
    side = Side(lr=3e-4, min_lr=3e-5, lr_warmup_steps=1, lr_decay_style="cosine", steps=3)
    assert [round(lr_at(side, s, 8), 10) for s in (1, 2, 3, 4)] == [0.0, 3e-4, 1.65e-4, 3e-5]


def test_one_process_parallel_path_reproduces_the_golden_logits():
    m = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=2,
                    seq_length=8, vocab_size=48)
    side = Side(backend="torch", world_size=1, precision="fp32")
    state = canonical_state(m, 3)
    golden = GPT(m)
    with torch.no_grad():
        for name, p in golden.named_parameters():
            p.copy_(state[name])
    model = GPT(m)
    shard_model(model, side, {s.name: s for s in param_specs(m)}, state,
                {"tp": 0, "gtp": 0, "dp": 0, "data": 0}, torch.float32)
    tokens = torch.randint(0, 48, (2, 8), generator=torch.Generator().manual_seed(1))
    # Bitwise by construction: at world 1 every layer runs the same torch ops on the same
    # shapes (the shard is the whole weight) in the same process.
    assert torch.equal(model(tokens), golden(tokens))
    assert all(hasattr(p, "main_grad") for p in model.parameters())


# --- the quantized all-gather of GTP shards, with threads as the ranks of a GTP group ---


class ThreadGroup:
    """An in-process stand-in for a process group: each thread is a rank."""

    def __init__(self, n: int):
        self.n, self.slots, self.barrier = n, [None] * n, threading.Barrier(n)

    def exchange(self, rank: int, t: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = t.clone()
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out

    def max_reducer(self, rank: int):
        def reduce(amax: torch.Tensor) -> None:
            amax.copy_(torch.stack(self.exchange(rank, amax)).amax(0))

        return reduce


def run_ranks(n: int, fn) -> list:
    out, errors = [None] * n, []

    def target(r):
        try:
            out[r] = fn(r)
        except BaseException as e:  # surfaced below, in the test's thread
            errors.append(e)
            group.barrier.abort()

    group = fn.group
    threads = [threading.Thread(target=target, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def gathered_copies(recipe_name: str, full: torch.Tensor, g: int, alignment: int, reduce_amax: bool = True):
    """Every rank's gathered weight copies, through fp8.prepare_gtp_weight on its padded shard."""
    recipe = RECIPES[recipe_name]()
    pad = gtp_pad(full.shape[0], g, alignment)
    padded = F.pad(full, (0, 0, 0, pad))
    group = ThreadGroup(g)

    def rank(r):
        q = recipe.make_quantizers(seed=5)
        inner = q.weight
        if reduce_amax and hasattr(inner, "amax_reduction"):
            inner.amax_reduction = group.max_reducer(r)
        q.weight = fp8.GatheredWeight(inner=inner)
        shard_ = padded.chunk(g)[r]
        fp8.prepare_gtp_weight(q, shard_, full, lambda t: group.exchange(r, t), r)
        return q.weight.copies

    rank.group = group
    return run_ranks(g, rank), recipe


def same_copy(a, b) -> bool:
    return (a.shape == b.shape and torch.equal(a.data, b.data) and torch.equal(a.scale_inv, b.scale_inv)
            and torch.equal(a.dequantize(), b.dequantize()))


@pytest.mark.parametrize("recipe_name, rows, alignment", [
    ("float8_current_scaling", 72, 16), ("delayed", 72, 16), ("mxfp8", 96, 32),
    ("float8_block_scaling", 72, 16), ("nvfp4", 80, 16),
])
def test_quantized_gather_equals_quantizing_the_full_weight(recipe_name, rows, alignment):
    full = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)) * 0.02
    full[rows - 3, 5] = 0.2  # the amax sits in the last shard, next to the pad rows
    copies, recipe = gathered_copies(recipe_name, full, g=2, alignment=alignment)
    want = recipe.make_quantizers(seed=5).weight.quantize(full, rowwise=True, columnwise=True)
    for q in copies:
        assert same_copy(q.rowwise, want.rowwise) and same_copy(q.columnwise, want.columnwise)


@pytest.mark.parametrize("recipe_name", ["float8_current_scaling", "nvfp4"])
def test_unreduced_amax_decodes_peer_shards_with_the_local_scale(recipe_name):
    full = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) * 0.02
    full[:32] *= 3.0  # shard 0's amax is about 3x shard 1's
    copies, recipe = gathered_copies(recipe_name, full, g=2, alignment=16, reduce_amax=False)
    right = recipe.make_quantizers().weight.quantize(full).rowwise.dequantize()
    w0, w1 = (q.rowwise.dequantize() for q in copies)
    assert not torch.equal(w0, w1)  # GTP peers no longer agree on the weight
    # Each peer decodes its own shard about right and the other's off by the amax ratio.
    ratio = float(full[:32].abs().max() / full[32:].abs().max())
    assert torch.allclose(w0[:32], right[:32], rtol=0.15, atol=1e-3)
    assert math.isclose(float(w0[32:].abs().max() / full[32:].abs().max()), ratio, rel_tol=0.15)
    assert math.isclose(float(full[:32].abs().max() / w1[:32].abs().max()), ratio, rel_tol=0.15)


def test_block_shards_must_align_to_the_blocks():
    full = torch.randn(96, 64) * 0.02  # G = 2, alignment 16: shards of 48 rows split MXFP8 blocks
    with pytest.raises(ValueError, match="gtp_pad_alignment"):
        gathered_copies("mxfp8", full, g=2, alignment=16)


def test_layer_quantizers_reduce_amax_over_the_right_group():
    gtp, amax = object(), object()

    def make(name, **kw):
        return fp8.layer_quantizers(RECIPES[name](), amax_group=amax, gtp_group=gtp, seed=0, **kw)

    q = make("float8_current_scaling", gtp_weight=True)
    assert q.weight.amax_reduction is not None and q.input.amax_reduction is None
    assert q.grad_output.amax_reduction is None
    q = make("float8_current_scaling", gtp_weight=False)
    assert q.weight.amax_reduction is None  # GTP off: each TP rank's own weight
    q = make("float8_current_scaling", gtp_weight=True, reduce_weight_amax=False)
    assert q.weight.amax_reduction is None
    q = make("delayed", gtp_weight=True)
    assert all(x.amax_reduction is not None for x in (q.input, q.weight, q.grad_output))
    q = make("delayed", gtp_weight=True, reduce_weight_amax=False)
    assert q.weight.amax_reduction is None and q.input.amax_reduction is not None


def test_shard_model_cuts_and_marks_gtp_shards_like_megatron_core():
    m = ModelConfig(num_layers=1, hidden_size=32, ffn_hidden_size=80, num_attention_heads=2,
                    seq_length=8, vocab_size=72)
    specs = {s.name: s for s in param_specs(m)}
    state = canonical_state(m, 1)
    side = Side(backend="torch", world_size=2, gtp=2)  # layouts only: no process group here
    model = GPT(m)
    shard_model(model, side, specs, state, {"tp": 0, "gtp": 1, "dp": 0, "data": 1}, torch.float32)
    params = dict(model.named_parameters())
    fc1 = params["decoder.layers.0.mlp.linear_fc1.weight"]
    assert fc1.shape == (48, 32) and fc1.is_gtp_weight_remat and fc1.pad_length == 16  # 80 -> 96 rows
    assert torch.equal(fc1[:32], state["decoder.layers.0.mlp.linear_fc1.weight"][48:]) and not fc1[32:].any()
    assert params["embedding.word_embeddings.weight"].pad_length == 24  # vocab 72 -> 96
    ln = params["decoder.layers.0.input_layernorm.weight"]
    assert ln.shape == (32,) and not getattr(ln, "is_gtp_weight_remat", False)
    assert all(p.main_grad.dtype == torch.float32 and not p.main_grad.any() for p in params.values())


# --- the training loops in one process (no launch) ---


def run_side(tmp_path, name, side, m, d):
    """Train ``side`` in this process (the golden loop, or the distributed one if ``name`` says)."""
    job = Job(key=name, model=m, data=d, side=side, capture=CapturePolicy(), trace_dir=str(tmp_path / name))
    cap = Capture(job.trace_dir, rank=0, world_size=1, coord={"tp": 0, "gtp": 0, "dp": 0},
                  mesh={"tp": 1, "gtp": 1, "dp": 1}, policy=job.capture)
    if name == "distributed":
        run_distributed(job, cap)
    else:
        run(job, cap)
    cap.close()
    Capture.finalize(job.trace_dir, world_size=1, coords={0: {"tp": 0, "gtp": 0, "dp": 0}}, mesh=cap.mesh)
    return trace.read(job.trace_dir)


TINY = ModelConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=2,
                   seq_length=32, vocab_size=64)


def test_micro_batched_loop_trains_like_the_golden_loop(tmp_path):
    """The distributed loop at world 1 (4 micro-batches, vocab-parallel CE, loss / tokens / M,
    main_grad accumulation, clipping) against the golden loop (one batch): same training."""
    d = DataConfig(seed=3, micro_batch_size=1, global_batch_size=4)
    side = Side(backend="torch", precision="fp64", optimizer="adam", lr=1e-2, clip_grad=0.5, steps=2)
    gold = assemble_trace(run_side(tmp_path, "golden", side, TINY, d))
    dist_ = assemble_trace(run_side(tmp_path, "distributed", side, TINY, d))
    keys = [k for k in gold.tensors if k[1] in ("main_grad", "param", "exp_avg", "exp_avg_sq") and k[0] > 0]
    assert len(keys) == 2 * 4 * 13  # steps x kinds x parameters
    for k in keys:
        torch.testing.assert_close(dist_.tensors[k], gold.tensors[k], rtol=1e-10, atol=1e-13, msg=str(k))


def test_recipe_side_runs_in_one_process(tmp_path):
    d = DataConfig(seed=3, micro_batch_size=1, global_batch_size=2)
    side = Side(backend="torch", world_size=1, precision="fp32", recipe="float8_current_scaling", steps=1)
    q = assemble_trace(run_side(tmp_path, "fp8", side, TINY, d))
    golden_side = Side(backend="torch", precision="fp64", steps=1)
    gold = assemble_trace(run_side(tmp_path, "golden", golden_side, TINY, d))
    logits_q = torch.stack([q.samples[(1, "logits", "output_layer")][i] for i in (0, 1)])
    logits_g = torch.stack([gold.samples[(1, "logits", "output_layer")][i] for i in (0, 1)])
    err = float((logits_q.double() - logits_g).abs().max())
    assert 1e-4 < err < 0.1  # FP8 error: far above fp32 rounding, far below a wrong result


def test_faults_the_backend_cannot_plant_are_refused():
    from harness.backends.torch.distributed import check_faults

    check_faults(Side(backend="torch", world_size=2, gtp=2, recipe="nvfp4", inject=("fp8-unreduced-amax",)))
    with pytest.raises(ValueError, match="not implemented by the torch backend"):
        check_faults(Side(backend="torch", world_size=2, gtp=2, inject=("gtp-rs-no-prescale",)))
    with pytest.raises(ValueError, match="per-tensor amax"):
        check_faults(Side(backend="torch", world_size=2, gtp=2, recipe="mxfp8",
                          inject=("fp8-unreduced-amax",)))
    with pytest.raises(ValueError, match="GTP > 1"):
        check_faults(Side(backend="torch", world_size=2, recipe="delayed", inject=("fp8-unreduced-amax",)))
