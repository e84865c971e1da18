"""TP x GTP x DP for the torch GPT: shard the model, run its GEMMs and lookups distributed.

:func:`shard_model` cuts the canonical weights into this rank's shards with the same layouts
megatron-core uses (``harness.backends.gpt.layout_of``: TP outer, GTP inner on dim 0 of the TP-local
block, pad rows at the tail), gives every parameter an fp32 ``main_grad`` (fp64 for fp64
params) and marks GTP shards as megatron-core does (``is_gtp_weight_remat``,
``pad_length``). The returned :class:`Parallel` context is attached to the linear layers and
the word embedding:

- column-parallel (``linear_qkv``, ``linear_fc1``, ``output_layer``): input copied to the TP
  region; row-parallel (``linear_proj``, ``linear_fc2``): output SUM all-reduced over TP;
- GTP weights all-gathered over the GTP group just before their GEMM (pad stripped), the
  weight gradient reduce-scattered back (``comm.gather_gtp``);
- vocab-parallel embedding: masked lookup in the TP-local (gathered) table, SUM over TP;
- with a recipe, every GEMM of a layer TE would own (qkv, proj, fc1, fc2; not the output
  layer, which megatron-core keeps in high precision) goes through
  ``harness.quant.quantized_linear`` (see ``fp8``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from harness.backends.gpt import ParamSpec, layout_of
from harness.common.layout import Layout, shard
from harness.quant import LinearQuantizers, quantized_linear
from harness.scenario.schema import Side

from . import comm, fp8
from .model import GPT, Linear, WordEmbedding


@dataclass
class LayerState:
    """What the context keeps per linear layer or embedding."""

    name: str
    """Canonical name of the weight."""
    layout: Layout
    pad: int
    """GTP pad rows of the shard's TP-local block (0 with GTP off)."""
    quantizers: Optional[LinearQuantizers] = None


@dataclass
class Parallel:
    """The rank's place in the mesh, its groups, and the per-layer state of its GEMMs."""

    side: Side
    coord: dict
    groups: comm.Groups
    recipe: object = None
    """A ``harness.quant`` recipe, or None for high-precision GEMMs."""
    layers: dict[int, LayerState] = field(default_factory=dict)
    on_gather: Optional[Callable[[str, torch.Tensor], None]] = None
    """Called with (name, gathered weight) after each GTP all-gather (materialized capture)."""

    @property
    def gtp_on(self) -> bool:
        return self.side.gtp > 1

    # --- layers ---

    def weight(self, module) -> torch.Tensor:
        """The TP-local weight the layer computes with: the gathered GTP weight, or the param.

        This high-precision gathered weight is what ``on_gather`` records (``materialized``),
        as megatron-core's BF16 GTP gathers it; with a recipe, its FP8 copies are made shard by
        shard and gathered separately (``fp8.prepare_gtp_weight``)."""
        st = self.layers[id(module)]
        if not self.gtp_on or "gtp" not in st.layout.placements:
            return module.weight
        full = comm.gather_gtp(module.weight, self.groups.gtp, st.pad)
        if self.on_gather is not None:
            self.on_gather(st.name, full)
        return full

    def linear(self, module: Linear, x: torch.Tensor) -> torch.Tensor:
        st = self.layers[id(module)]
        if module.kind == "column":
            x = comm.copy_to_tp(x, self.groups.tp)
        w = self.weight(module)
        if st.quantizers is None:  # no recipe, or a layer TE does not own (the output layer)
            y = torch.nn.functional.linear(x, w)
        else:
            if w is not module.weight:
                gather = fp8.group_gather(self.groups.gtp)
                fp8.prepare_gtp_weight(st.quantizers, module.weight, w, gather, self.coord["gtp"])
            y = quantized_linear(x, w, self.recipe, st.quantizers)
            if w is not module.weight:
                fp8.update_weight_scale(st.quantizers)
        if module.kind == "row":
            y = comm.reduce_from_tp(y, self.groups.tp)
        return y

    def embed(self, module: WordEmbedding, tokens: torch.Tensor) -> torch.Tensor:
        """megatron-core's VocabParallelEmbedding (deterministic mode: an indexed lookup)."""
        tp = comm.size(self.groups.tp)
        w = self.weight(module)
        if tp > 1:
            part = w.shape[0]
            start = self.coord["tp"] * part
            mask = (tokens < start) | (tokens >= start + part)
            local = tokens.clone() - start
            local[mask] = 0
        else:
            local = tokens
        out = w[local]
        if tp > 1:
            out[mask, :] = 0.0
        return comm.reduce_from_tp(out, self.groups.tp)


def shard_model(model: GPT, side: Side, specs: dict[str, ParamSpec], state: dict[str, torch.Tensor],
                coord: dict, dtype: torch.dtype, recipe=None, reduce_weight_amax: bool = True) -> Parallel:
    """Replace every parameter by this rank's shard and attach a :class:`Parallel` context.

    ``reduce_weight_amax=False`` quantizes GTP weight shards with their own per-tensor amax
    (the planted fault ``fp8-unreduced-amax``).
    """
    groups = comm.groups_for(side)
    par = Parallel(side=side, coord=coord, groups=groups, recipe=recipe)
    layouts = {n: layout_of(s, side) for n, s in specs.items()}
    for name, p in model.named_parameters():
        lay = layouts[name]
        with torch.no_grad():
            p.data = shard(state[name], lay, coord).to(dtype)
        p.main_grad = torch.zeros_like(p, dtype=torch.float32 if dtype != torch.float64 else dtype)
        if "gtp" in lay.placements:
            p.is_gtp_weight_remat = True
            p.pad_length = lay.pads.get("gtp", 0)
    modules = dict(model.named_modules())
    for mname, module in modules.items():
        if not isinstance(module, (Linear, WordEmbedding)):
            continue
        name = next(n for n, q in model.named_parameters() if q is module.weight)  # a tied one's first name
        lay = layouts[name]
        st = LayerState(name=name, layout=lay, pad=lay.pads.get("gtp", 0) if "gtp" in lay.placements else 0)
        # megatron-core's output layer is a plain ColumnParallelLinear even in the TE layer spec:
        # TE's recipes never quantize it, so it stays in high precision here too.
        if recipe is not None and isinstance(module, Linear) and mname != "output_layer":
            st.quantizers = fp8.layer_quantizers(
                recipe, amax_group=groups.amax, gtp_group=groups.gtp, gtp_weight="gtp" in lay.placements,
                reduce_weight_amax=reduce_weight_amax,
                seed=fp8.layer_seed(side.seed, name, coord["tp"], coord["data"]),
            )
            if "gtp" in lay.placements:
                st.quantizers.weight = fp8.GatheredWeight(inner=st.quantizers.weight)
        par.layers[id(module)] = st
        module.parallel = par
    _check_tp_local_shapes(model, layouts, side)
    return par


def _check_tp_local_shapes(model: GPT, layouts: dict[str, Layout], side: Side) -> None:
    """Every shard has the shape its layout says (a wrong cut fails here, not in a GEMM)."""
    for name, p in model.named_parameters():
        want = layouts[name].local_shape()
        if tuple(p.shape) != tuple(want):
            raise RuntimeError(f"{name}: shard is {tuple(p.shape)}, layout says {want} on {side.label()}")
