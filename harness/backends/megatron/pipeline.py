"""Pipeline parallelism on the ``megatron`` backend: stages of megatron-core's GPTModel.

With ``pipeline_parallel = P`` each rank builds its stage of the model (``pre_process`` on
the first stage: the embeddings; ``post_process`` on the last: final LayerNorm, output layer
and loss) and megatron-core's schedule (1F1B, ``forward_backward_pipelining_without_interleaving``)
moves activations and their gradients between stages with its own p2p calls over gloo. With
``virtual_pipeline = V`` each rank builds V model chunks (``vp_stage``), run by the
interleaved schedule (``forward_backward_pipelining_with_interleaving``), each chunk reading
every micro-batch from its own iterator.

What this module adds to the backend, and why:

- names: megatron-core numbers a stage's layers from 0; the trace names them by their global
  layer number (``layer.layer_number - 1``), so every tensor lines up by name with the golden
  and with unpipelined sides;
- the split: which canonical parameters a stage owns, derived from the scenario alone, so a
  stage megatron-core built differently is refused rather than compared;
- capture: a stage records the modules it computes, under their global names;
- the logged loss exists on the last stage only: it is broadcast over the pipeline group, so
  every rank records the value Megatron-LM logs (rank 0 is read, on the first stage).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import torch
import torch.distributed as dist

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")


def parallel_state_kwargs(side) -> dict:
    """``initialize_model_parallel``'s pipeline arguments."""
    if side.pipeline_parallel == 1:
        return {}
    return {"pipeline_model_parallel_size": side.pipeline_parallel,
            "virtual_pipeline_model_parallel_size": side.virtual_pipeline}


def config_kwargs(side) -> dict:
    """TransformerConfig's pipeline fields, with Megatron-LM's p2p defaults: 1F1B batches its
    sends and receives (``batch_isend_irecv``, megatron-core's default); interleaved overlaps
    them with compute (``--overlap-p2p-communication``, on by default, which turns batching
    off: ``argument_utils.py``). Both run on gloo as they are."""
    if side.pipeline_parallel == 1:
        return {}
    interleaved = side.virtual_pipeline is not None
    return {"pipeline_model_parallel_size": side.pipeline_parallel,
            "virtual_pipeline_model_parallel_size": side.virtual_pipeline,
            "overlap_p2p_comm": interleaved, "batch_p2p_comm": not interleaved}


def chunk_ids(side) -> list[int | None]:
    """The virtual pipeline stage of each model chunk this rank builds (None: not interleaved)."""
    return list(range(side.virtual_pipeline)) if side.virtual_pipeline else [None]


def one_or_list(items: list):
    """What megatron-core's schedules take: the item itself for one model chunk, else the list."""
    return items[0] if len(items) == 1 else items


def stage_flags(vp: int | None = None) -> dict:
    """GPTModel's ``pre_process`` / ``post_process`` (and ``vp_stage``) for this rank's stage,
    or for its model chunk ``vp`` when interleaved."""
    from megatron.core import parallel_state as ps

    if vp is None:
        return {"pre_process": ps.is_pipeline_first_stage(), "post_process": ps.is_pipeline_last_stage()}
    return {"pre_process": ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            "post_process": ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            "vp_stage": vp}


def stage_layers(num_layers: int, stages: int, stage: int, chunks: int = 1, chunk: int = 0) -> range:
    """Global layer numbers (0-based) model chunk ``chunk`` of stage ``stage`` holds: an even
    split, chunk-major when interleaved (chunk c of stage s is virtual stage c * stages + s)."""
    per = num_layers // (stages * chunks)
    first = (chunk * stages + stage) * per
    return range(first, first + per)


def owned(names: list[str], num_layers: int, stages: int, stage: int,
          chunks: int = 1, chunk: int = 0, mtp: bool = False) -> set[str]:
    """The canonical parameters of ``names`` that model chunk ``chunk`` of stage ``stage`` holds
    (``mtp``: the MTP block on the last stage, with its own copy of the embeddings)."""
    layers = stage_layers(num_layers, stages, stage, chunks, chunk)
    last = stage == stages - 1 and chunk == chunks - 1
    out = set()
    for name in names:
        m = _LAYER.match(name)
        if m:
            keep = int(m[1]) in layers
        elif name.startswith("embedding."):
            keep = (stage == 0 and chunk == 0) or (mtp and last)
        else:  # final LayerNorm, output layer, the MTP block
            keep = last
        if keep:
            out.add(name)
    return out


def replica_stages(job) -> tuple[int, ...]:
    """The stages holding a copy of the embeddings: with MTP under pipelining megatron-core builds
    the MTP block on the last stage with its own ``LanguageModelEmbedding``
    (``GPTModel.__init__``: ``pre_process or mtp_process``); the word embedding's copies start
    from the first stage's (``setup_embeddings_and_output_layer``: zeroed, then all-reduced over
    the embedding group) and their grads are all-reduced over that group
    (``finalize_model_grads._allreduce_word_embedding_grads``). Empty: one copy."""
    p = job.side.pipeline_parallel
    return (0, p - 1) if job.model.mtp_num_layers and p > 1 else ()


def with_replica_stages(layouts: dict, job) -> dict:
    """``layouts`` with the embeddings' copies on several stages declared (:func:`replica_stages`):
    the first stage's is the logical tensor, the last stage's its replica, checked bitwise."""
    stages = replica_stages(job)
    if not stages:
        return layouts
    return {n: dataclasses.replace(lay, replica_stages=stages) if n.startswith("embedding.") else lay
            for n, lay in layouts.items()}


def global_name(name: str, offsets: dict[int, int]) -> str:
    """``name`` with its stage-local layer index replaced by the global one (``offsets``:
    local index -> global layer number)."""
    m = _LAYER.match(name)
    if not m:
        return name
    return f"decoder.layers.{offsets[int(m[1])]}." + name[m.end():]


def layer_numbers(model) -> dict[int, int]:
    """Local layer index -> global layer number (0-based), read off megatron-core's layers."""
    return {j: layer.layer_number - 1 for j, layer in enumerate(model.decoder.layers)}


def canonical_names(model, strip: Callable[[str], str]) -> dict[str, str]:
    """Each parameter name of ``model`` (wrapped or not) -> its canonical, global name."""
    inner = model
    while hasattr(inner, "module"):
        inner = inner.module
    offsets = layer_numbers(inner)
    return {n: global_name(strip(n), offsets) for n, _ in model.named_parameters()}


def stage_modules(model) -> dict[str, torch.nn.Module]:
    """The modules this stage computes, by global name (as :func:`harness.backends.gpt.captured_modules`
    names them on a whole model)."""
    modules = {}
    if getattr(model, "pre_process", True):
        modules["embedding"] = model.embedding
    if getattr(model, "post_process", True):
        modules["output_layer"] = model.output_layer
        modules["decoder.final_layernorm"] = model.decoder.final_layernorm
    for j, number in layer_numbers(model).items():
        layer = model.decoder.layers[j]
        modules[f"decoder.layers.{number}"] = layer
        for sub in ("input_layernorm", "self_attention", "pre_mlp_layernorm", "mlp"):
            modules[f"decoder.layers.{number}.{sub}"] = getattr(layer, sub)
    return modules


def loss_totals(losses: list[dict]) -> torch.Tensor:
    """(loss sum, token count) of this rank's micro-batches: zeros where no loss is computed
    (stages before the last)."""
    if not losses:
        return torch.zeros(2)
    return torch.stack([x["lm loss"] for x in losses]).sum(0)


def from_last_stage(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the last pipeline stage holds it, on every stage (in place)."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() > 1:
        group = ps.get_pipeline_model_parallel_group()
        dist.broadcast(t, src=ps.get_pipeline_model_parallel_last_rank(), group=group)
    return t
