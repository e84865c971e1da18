"""Shared plumbing of the GTP reproducers: spawn gloo ranks, build megatron-core's tiny GPT,
run one training step, and record which weight every GEMM actually consumed.

Everything numeric is megatron-core's own code (local layer spec, GTPShardedParam, DDP,
``finalize_model_grads``, the no-pipelining schedule); the CPU compatibility layer of the
harness swaps only CUDA/TE plumbing. The recorder only reads tensors (clones them) around the
calls it wraps; the two controls that do change behaviour are explicit sides of a run
(``sync_gathers``, ``te_recompute_phase``).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from harness.backends.megatron import compat  # noqa: E402

SEED = 1234
GTP_WEIGHTS = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight",
               "linear_fc2.weight", "word_embeddings.weight", "output_layer.weight")


@dataclass(frozen=True)
class Model:
    """A tiny GPT whose consecutive GTP weights all differ in padded shape (as a dense layer's)."""

    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 256
    num_attention_heads: int = 4
    vocab_size: int = 96
    seq_length: int = 16
    micro_batch_size: int = 2


@dataclass(frozen=True)
class Run:
    """One side of a comparison: parallel layout and the GTP/megatron-core switches under test."""

    label: str
    tp: int = 1
    gtp: int = 1
    weight_prefetch: bool = True
    recompute: bool = False  # full, uniform, 1 layer per checkpoint
    sequence_parallel: bool = False
    per_token_loss: bool = False  # on TransformerConfig (what megatron-core's schedule reads)
    per_token_loss_gtp: bool = False  # through configure_gtp_remat_from_recipe (GTP_CONFIG)
    sync_gathers: bool = False  # every GTP all-gather complete before it returns
    te_recompute_phase: bool = False  # answer TE's in_fp8_activation_recompute_phase() True
    # while autograd runs the recompute (what te_checkpoint does under FP8; the BF16/FP32
    # path, tensor_parallel.checkpoint, leaves it False on a GPU too)
    iterations: int = 1  # forward/backward passes (no optimizer step: same weights each time);
    # the second pass is the first to use links and chains built lazily by the first
    bf16: bool = False  # bf16 params and activations (Float16Module, as training wraps them);
    # main_grad stays fp32 (DDP grad_reduce_in_fp32)
    mtp_num_layers: int = 0  # multi-token prediction depths (the local spec's MTP block)
    tied: bool = False  # the output layer computes with the word embedding's weight
    model: Model = field(default_factory=Model)


# --- process spawning: a file store, so no port is bound ---------------------------------


def spawn(fn, world: int, *args) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return each rank's JSON result."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="gtp-repro-") as tmp:
        mp.spawn(_rank_main, args=(world, tmp, fn, args), nprocs=world, join=True)
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]


def _rank_main(rank, world, tmp, fn, args):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    store = dist.FileStore(str(Path(tmp, "store")), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    compat.install()
    try:
        result = fn(rank, world, *args)
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


# --- building ----------------------------------------------------------------------------


def _norm_without_sp_assert():
    """megatron-core's torch LayerNorm under sequence parallel: the compat layer's stand-in."""
    from harness.backends.patching import undo_all

    compat.layer_norm_for_sequence_parallel()
    return undo_all


def build(run: Run, collection=None):
    """megatron-core's GPTModel (local spec) wrapped in MCore DDP, GTP configured as ``run`` says.
    ``collection``: makes the ProcessGroupCollection passed to both, once parallel_state is up."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import generalized_tensor_parallelism as gtp
    from megatron.core.tensor_parallel import gtp_api
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    compat.reset_gtp_state()
    ps.initialize_model_parallel(tensor_model_parallel_size=run.tp, gtp_remat_size=run.gtp)
    groups = {} if collection is None else {"pg_collection": collection()}
    model_parallel_cuda_manual_seed(SEED)
    torch.manual_seed(SEED)  # CPU init: every rank draws the same full TP-local weights
    if run.gtp > 1:
        gtp_api.configure_gtp_remat_from_recipe(calculate_per_token_loss=run.per_token_loss_gtp)
        gtp.update_gtp_config(weight_prefetch=run.weight_prefetch)
    m = run.model
    dtype = torch.bfloat16 if run.bf16 else torch.float32
    recompute = dict(recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=1) if run.recompute else {}
    config = TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads, tensor_model_parallel_size=run.tp,
        tensor_parallel_num_weight_shards=run.tp * run.gtp, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
        gradient_accumulation_fusion=False, attention_softmax_in_fp32=True,
        bf16=run.bf16, params_dtype=dtype, pipeline_dtype=dtype, init_method_std=0.05,
        deterministic_mode=True, sequence_parallel=run.sequence_parallel,
        calculate_per_token_loss=run.per_token_loss, mtp_num_layers=run.mtp_num_layers or None, **recompute,
    )
    undo = _norm_without_sp_assert()
    spec = get_gpt_layer_local_spec()
    try:
        model = GPTModel(
            config=config, transformer_layer_spec=spec,
            vocab_size=m.vocab_size, max_sequence_length=m.seq_length,
            share_embeddings_and_output_weights=run.tied, position_embedding_type="learned_absolute",
            **groups,
            mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
                if run.mtp_num_layers else None,
        )
    finally:
        undo()
    if run.bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model,
                                  **groups)
    if run.gtp > 1:
        gtp_api.classify_gtp_remat_chains(ddp)
    return config, ddp


def unwrapped_name(name: str) -> str:
    """A parameter's name without the DDP / Float16Module wrappers' ``module.`` prefixes."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def names_of(ddp) -> dict[int, str]:
    return {id(p): unwrapped_name(n) for n, p in ddp.named_parameters()}


# --- logical (TP-local, unpadded) views of GTP shards ------------------------------------


def logical(param, value: torch.Tensor) -> torch.Tensor:
    """All-gather a GTP shard-shaped tensor over the GTP group and strip the pad rows."""
    if not getattr(param, "is_gtp_weight_remat", False):
        return value.detach().clone()
    group = param.group
    out = value.new_empty((value.shape[0] * group.size(), *value.shape[1:]))
    dist.all_gather_into_tensor(out, value.detach().contiguous(), group=group)
    return out[: out.shape[0] - param.pad_length] if param.pad_length else out


def logical_weights(ddp) -> dict[str, torch.Tensor]:
    return {n: logical(p, p.data) for n, p in _named(ddp)}


def logical_grads(ddp) -> dict[str, torch.Tensor]:
    return {n: logical(p, p.main_grad) for n, p in _named(ddp)}


def _named(ddp):
    return [(unwrapped_name(n), p) for n, p in ddp.named_parameters()]


def grad_norm(ddp, grads: dict[str, torch.Tensor]) -> float:
    """L2 norm of the logical gradient: TP-split params summed over TP, replicated ones once."""
    from megatron.core import parallel_state as ps

    total = torch.zeros((), dtype=torch.float64)
    tp_rank = ps.get_tensor_model_parallel_rank()
    for n, p in _named(ddp):
        if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
            total += grads[n].double().pow(2).sum()
    dist.all_reduce(total, group=ps.get_tensor_model_parallel_group())
    return float(total.sqrt())


# --- one training step through megatron-core's schedule ----------------------------------


def token_sum_loss(totals: list):
    """megatron-core's schedule's ``loss_func``: returns (sum of the per-token losses, tokens),
    which the schedule divides by the tokens unless ``calculate_per_token_loss``; appends
    ``[sum, tokens]`` of each micro-batch to ``totals`` (the caller's token mean over ranks)."""

    def loss_func(output_tensor):
        loss = output_tensor.float().sum()
        n = torch.tensor(output_tensor.numel(), dtype=torch.int)
        totals.append(torch.stack([loss.detach(), n.float()]))
        return loss, n, {"lm loss": totals[-1]}

    return loss_func


def step(config, ddp, run: Run) -> float:
    """Forward + backward + finalize_model_grads on this rank's micro-batch; returns the
    token-mean loss over the data-distribution group (GTP peers are distinct data ranks)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    m = run.model
    data_rank, data_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    gen = torch.Generator().manual_seed(SEED + 7)
    tokens = torch.randint(0, m.vocab_size, (data_size, m.micro_batch_size, m.seq_length + 1), generator=gen)
    tokens = tokens[data_rank]
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    mask = torch.triu(torch.ones(1, 1, m.seq_length, m.seq_length, dtype=torch.bool), 1)
    positions = torch.arange(m.seq_length)[None].expand(m.micro_batch_size, -1)
    totals = []
    loss_func = token_sum_loss(totals)

    def forward_step(data_iterator, model):
        return model(inputs, positions, mask, labels=labels), loss_func

    config.finalize_model_grads_func = finalize_model_grads
    ddp.zero_grad_buffer()
    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([None]), model=[ddp],
        num_microbatches=1, seq_length=m.seq_length, micro_batch_size=m.micro_batch_size,
        forward_only=False,
    )
    total = totals[0].clone()
    dist.all_reduce(total, group=ps.get_data_parallel_group())
    return float(total[0] / total[1])


# --- which weight did each GEMM consume ---------------------------------------------------


@dataclass
class Use:
    """One materialization of a GTP weight and the GEMM that read it."""

    param: str
    phase: str  # forward | recompute | backward (dgrad)
    handed: torch.Tensor  # the tensor GTP returned (a view of its gather buffer)
    at_return: torch.Tensor  # its value when GTP returned it
    read: torch.Tensor | None = None  # its value when the GEMM (or embedding lookup) started
    after: torch.Tensor | None = None  # its value when that GEMM returned
    ticket: int | None = None
    buffer: int | None = None  # data_ptr of the gather buffer


class Recorder:
    """Wraps GTPShardedParam's materialization calls and the GEMMs of megatron-core's local
    linears / embedding to record the weight each GEMM consumed. Read-only: clones only."""

    def __init__(self, ddp):
        from megatron.core.tensor_parallel import generalized_tensor_parallelism as gtp

        self.gtp, self.names, self.uses, self._undo = gtp, names_of(ddp), [], []
        self._pending: list[Use] = []
        cls = gtp.GTPShardedParam
        self._wrap(cls, "all_gather_and_prefetch", self._on_fwd)
        self._wrap(cls, "all_gather_and_prefetch_bwd", self._on_bwd)
        self._wrap(cls, "_all_gather_weight", self._on_gather)
        self.gathers: list[dict] = []  # every all-gather issued into a GTP buffer, in program order
        self._wrap(torch, "matmul", self._gemm(lambda a, b: b.t()))
        self._wrap(torch.Tensor, "matmul", self._gemm(lambda a, b: b))
        # The embedding lookup (deterministic_mode indexes the weight: ``weight[ids]``).
        self._wrap(torch.Tensor, "__getitem__", self._gemm(lambda a, b: a))

    def _wrap(self, owner, name, make):
        original = getattr(owner, name)
        setattr(owner, name, make(original))
        self._undo.append(lambda: setattr(owner, name, original))

    def close(self):
        while self._undo:
            self._undo.pop()()

    def _record(self, param, out, phase, ticket):
        use = Use(self.names.get(id(param), "?"), phase, out, out.detach().clone(),
                  ticket=ticket, buffer=out.data_ptr())
        self.uses.append(use)
        # A buffer handed out again supersedes an earlier hand-out no GEMM has read yet.
        self._pending = [u for u in self._pending if u.buffer != use.buffer] + [use]

    def _on_fwd(self, original):
        def wrapper(param, fwd=True, nvtx_label=None):
            out = original(param, fwd=fwd, nvtx_label=nvtx_label)
            phase = "recompute" if torch._C._current_graph_task_id() != -1 else "forward"
            self._record(param, out, phase, param._ag_ticket_fwd)
            return out

        return wrapper

    def _on_gather(self, original):
        def wrapper(param, async_op, fwd, nvtx_label=None, **kw):
            # main adds recompute= / recompute_prev= (the recompute chain's own buffers)
            out, handle = original(param, async_op, fwd, nvtx_label, **kw)
            self.gathers.append({
                "index": len(self.gathers), "after_use": len(self.uses) - 1,
                "param": self.names.get(id(param), "?"),
                "into": "recompute" if kw.get("recompute") else "fwd" if fwd else "bwd",
                "async": bool(async_op), "buffer": out.data_ptr(),
                "in_backward": torch._C._current_graph_task_id() != -1,
            })
            return out, handle

        return wrapper

    def _on_bwd(self, original):
        def wrapper(param, nvtx_label=None):
            out = original(param, nvtx_label=nvtx_label)
            self._record(param, out, "backward", param._ag_ticket_bwd)
            return out

        return wrapper

    def _gemm(self, weight_operand):
        def make(original):
            def wrapper(a, b, *args, **kwargs):
                use = None
                if self._pending and torch.is_tensor(a) and torch.is_tensor(b):
                    use = self._match(weight_operand(a, b))
                if use is not None:
                    use.read = use.handed.detach().clone()
                result = original(a, b, *args, **kwargs)
                if use is not None:
                    use.after = use.handed.detach().clone()
                return result

            return wrapper

        return make

    def _match(self, operand):
        for use in self._pending:
            if operand.data_ptr() == use.handed.data_ptr() and operand.shape == use.handed.shape:
                self._pending.remove(use)
                return use
        return None


def identify(consumed: torch.Tensor, expected: str, weights: dict[str, torch.Tensor], gtp: int) -> str:
    """Name the weight a GEMM consumed: its own, another parameter's, or per GTP row block
    which parameter's rows it holds (a stale or partially gathered buffer)."""
    if torch.equal(consumed, weights[expected]):
        return "ok"
    same = [n for n, w in weights.items() if w.shape == consumed.shape]
    whole = [n for n in same if torch.equal(consumed, weights[n])]
    if whole:
        return f"consumed {whole[0]}'s weight instead of {expected}'s"
    rows = -(-consumed.shape[0] // gtp)
    parts = []
    for b in range(gtp):
        cut = slice(b * rows, (b + 1) * rows)
        owner = [n for n in same if torch.equal(consumed[cut], weights[n][cut])]
        parts.append(owner[0] if owner else "unknown")
    return f"stale/partially gathered buffer for {expected}: row blocks hold {parts}"


def gemm_report(recorder: Recorder, weights: dict[str, torch.Tensor], gtp: int) -> list[dict]:
    """One row per GEMM that consumed a GTP weight: what it read vs the logical weight."""
    rows = []
    for i, use in enumerate(recorder.uses):
        read = use.read if use.read is not None else use.at_return
        verdict = identify(read, use.param, weights, gtp)
        raced = use.read is not None and not torch.equal(use.at_return, use.read)
        clobbered = use.after is not None and use.read is not None and not torch.equal(use.read, use.after)
        rows.append({
            "call": i, "param": use.param, "phase": use.phase, "verdict": verdict,
            "changed_before_gemm": raced, "changed_during_gemm": clobbered,
            "ticket": use.ticket, "buffer": use.buffer,
        })
    return rows


def chain_links(ddp) -> dict[str, dict]:
    """The forward/backward and recompute prefetch links and the gather-buffer key per GTP weight."""
    names = names_of(ddp)
    out = {}
    for n, p in _named(ddp):
        if not getattr(p, "is_gtp_weight_remat", False):
            continue
        nm = lambda q: names.get(id(q)) if q is not None else None  # noqa: E731
        out[n] = {"next_w": nm(p.next_w), "prev_w": nm(p.prev_w),
                  "recompute_next": nm(p._recompute_next), "recompute_prev": nm(p._recompute_prev),
                  "buffer_key": str(p._get_cache_key(p.dtype, True, False))}
    return out


# --- one side, end to end ----------------------------------------------------------------


def run_side(run: Run, instrument: bool = True) -> dict:
    """Build, step once, and return loss, grad norm, logical grads and the GEMM report."""
    from megatron.core import parallel_state as ps

    config, ddp = build(run)
    weights = logical_weights(ddp)
    recorder = Recorder(ddp) if instrument and run.gtp > 1 else None
    undo = [_force_sync_gathers()] if run.sync_gathers else []
    if run.te_recompute_phase:
        undo.append(_flag_recompute_phase())
    try:
        for _ in range(run.iterations):
            if recorder is not None:
                recorder.uses, recorder.gathers, recorder._pending = [], [], []
            loss = step(config, ddp, run)
    finally:
        if recorder is not None:
            recorder.close()
        for u in undo:
            u()
    grads = logical_grads(ddp)
    result = {
        "label": run.label, "loss": loss, "grad_norm": grad_norm(ddp, grads),
        "grads": grads, "weights": weights,
        "gemms": gemm_report(recorder, weights, run.gtp) if recorder else [],
        "links": chain_links(ddp) if run.gtp > 1 else {},
        "gathers": recorder.gathers if recorder else [],
    }
    ps.destroy_model_parallel()
    compat.reset_gtp_state()
    return result


def _flag_recompute_phase():
    """TE's recompute phase on while autograd runs (the recompute), under both of the names
    GTP calls it by (main calls ``in_activation_recompute_phase``, an alias bound at import)."""
    from megatron.core.tensor_parallel import generalized_tensor_parallelism as gtp

    names = [n for n in ("in_fp8_activation_recompute_phase", "in_activation_recompute_phase")
             if hasattr(gtp, n)]
    originals = {n: getattr(gtp, n) for n in names}
    for n in names:
        setattr(gtp, n, lambda: torch._C._current_graph_task_id() != -1)
    return lambda: [setattr(gtp, n, f) for n, f in originals.items()]


def _force_sync_gathers():
    """Every GTP all-gather completes before the call returns (handle already done): rules out
    any overlap of a gather with the GEMM that reads the buffer."""
    from megatron.core.tensor_parallel import generalized_tensor_parallelism as gtp

    original = gtp.gather_along_first_dim

    def gather(inp, group, async_op=False, **kw):
        out, handle = original(inp, group, async_op=async_op, **kw)
        if handle is not None:
            handle.wait()
        return out, (compat._Done() if async_op else None)

    gtp.gather_along_first_dim = gather
    return lambda: setattr(gtp, "gather_along_first_dim", original)


# --- comparing sides ---------------------------------------------------------------------


def first_grad_difference(a: dict, b: dict) -> dict | None:
    """The first parameter (model order) whose logical gradient differs, with its max |diff|."""
    for name, ga in a["grads"].items():
        gb = b["grads"][name]
        if not torch.equal(ga, gb):
            return {"param": name, "max_abs_diff": float((ga - gb).abs().max())}
    return None


def summarize(sides: list[dict]) -> dict:
    """Plain-data summary of one rank's sides: scalars, grad differences vs the first side
    (the GTP-off baseline) and the GEMMs that read a weight other than their own."""
    base = sides[0]
    out = {}
    for s in sides:
        bad = [g for g in s["gemms"] if g["verdict"] != "ok"]
        out[s["label"]] = {
            "loss": s["loss"], "grad_norm": s["grad_norm"],
            "first_grad_diff_vs_" + base["label"]: first_grad_difference(base, s),
            "gemms": len(s["gemms"]), "wrong_gemms": bad,
            "raced_gemms": [g for g in s["gemms"] if g["changed_before_gemm"] or g["changed_during_gemm"]],
            "links": s["links"], "gathers": s["gathers"],
        }
    return out


def print_summary(title: str, summary: dict, rank: int = 0) -> None:
    print(f"== {title} (rank {rank}) ==")
    for label, s in summary.items():
        diff = next(v for k, v in s.items() if k.startswith("first_grad_diff"))
        where = "grads bitwise equal to baseline"
        if diff:
            where = f"first grad diff: {diff['param']} (max |diff| {diff['max_abs_diff']:.3e})"
        print(f"{label:>28}: loss {s['loss']:.6f}  grad norm {s['grad_norm']:.6f}  {where}")
        for g in s["wrong_gemms"][:6]:
            print(f"{'':>30}{g['phase']:>9} GEMM #{g['call']} of {g['param']}: {g['verdict']}")
        if len(s["wrong_gemms"]) > 6:
            print(f"{'':>30}... {len(s['wrong_gemms']) - 6} more wrong GEMMs")
        for g in s["raced_gemms"][:3]:
            print(f"{'':>30}buffer of {g['param']} ({g['phase']}) changed while handed out")


# --- command line shared by the reproducers ----------------------------------------------


def _on_rank(rank, world, sides, extend):
    results = [run_side(run) for run in sides]
    summary = summarize(results)
    if extend is not None:
        extend(sides, results, summary)
    return summary


def use_megatron_tree(spec: str) -> str:
    """Put the megatron-core tree ``spec`` names first on the import path, of this process and
    of the ranks it spawns: a folder holding ``megatron/`` (a Megatron-LM checkout, a ``git
    archive`` of one) or ``git:<repo>@<rev>`` (materialized once, as the harness's
    ``--megatron-core``). Must run before anything imports ``megatron``. Returns the folder."""
    from harness.run import trees

    if "megatron" in sys.modules:
        raise RuntimeError("megatron is imported already: choose the tree before importing it")
    root = trees.resolve(spec, "--megatron").root
    if not root:  # "installed"
        return ""
    sys.path.insert(0, root)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, str(ROOT), os.environ.get("PYTHONPATH")]))
    return root


def megatron_banner() -> str:
    """Which megatron-core this process imports: version and folder."""
    import megatron.core
    from megatron.core import package_info

    return f"megatron-core {package_info.__version__} ({Path(megatron.core.__file__).parent.parent.parent})"


def parse_args(doc: str, labels, argv=None, flag: str = "--sides",
               what: str = "labels to run (the first is the baseline)"):
    """The reproducers' command line: ``--json OUT``, ``flag`` (comma-separated, out of
    ``labels``; an unknown one exits 2) and ``--megatron TREE`` (:func:`use_megatron_tree`,
    applied here). Returns the namespace, with the chosen labels as ``chosen``."""
    import argparse

    labels = list(labels)
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write every rank's summary here")
    ap.add_argument(flag, dest="chosen", help=f"comma-separated {what}; default all: {','.join(labels)}")
    ap.add_argument("--megatron", metavar="TREE",
                    help="run this megatron-core instead of the installed one: a folder holding "
                    "megatron/, or git:<repo>@<rev>")
    args = ap.parse_args(argv)
    args.chosen = args.chosen.split(",") if args.chosen else labels
    unknown = [x for x in args.chosen if x not in labels]
    if unknown:
        ap.error(f"{flag}: unknown label(s) {unknown}; known: {labels}")
    if args.megatron:
        from harness.common.errors import BadInput

        try:
            use_megatron_tree(args.megatron)
        except BadInput as e:
            ap.error(str(e))
    return args


def cli(doc: str, title: str, sides: tuple, world: int, argv=None, extend=None) -> list[dict]:
    """Parse the command line (:func:`parse_args`), run the chosen sides on ``world`` ranks, print
    rank 0's summary, return every rank's. ``extend(runs, results, summary)`` may add per-side fields."""
    by_label = {s.label: s for s in sides}
    args = parse_args(doc, by_label, argv)
    chosen = tuple(by_label[x] for x in args.chosen)
    results = spawn(_on_rank, world, chosen, extend)
    print_summary(title, results[0])
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return results
