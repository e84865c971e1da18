"""Scenarios: what to run and compare, parsed from TOML into validated dataclasses.

A scenario is one model and data configuration, a reference side and a candidate side (the
two implementations under comparison, e.g. GTP off vs GTP 2) and a golden side (the ``torch``
backend in one process, fp64 or fp32) that both are measured against. A ``[train]`` table
holds defaults every side inherits; a side's own keys override them.

A matrix file expands a product of axes into scenarios (see :func:`expand_matrix`).

Every rule is checked before any process is launched; a violation raises
:class:`~harness.errors.BadInput` naming the file, the key and the rule.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.errors import BadInput
from harness.fault_catalog import check_name

BACKENDS = frozenset({"megatron", "torch"})
PRECISIONS = {
    "megatron": frozenset({"fp32", "bf16"}),
    "torch": frozenset({"fp64", "fp32", "bf16"}),
}
OPTIMIZERS = frozenset({"adam", "sgd"})
# "none" or a key of harness.quant.RECIPES (kept literal here: parsing needs no torch).
RECIPE_NAMES = frozenset({"none", "delayed", "float8_current_scaling", "mxfp8", "float8_block_scaling", "nvfp4"})
LR_DECAY_STYLES = frozenset({"constant", "linear", "cosine"})
CAPTURE_KINDS = frozenset(
    {"input", "activation", "logits", "loss", "param", "main_grad", "optimizer", "scalar"}
)
POLICIES = frozenset({"exact", "dtype", "noise-floor"})


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """The GPT architecture. Fixed choices (no linear bias, LayerNorm, GeLU MLP, learned
    absolute positions, dropout 0, fp32 softmax, causal mask) match the GTP seed comparison."""

    num_layers: int = 2
    """Transformer layers."""
    hidden_size: int = 128
    """Model width."""
    ffn_hidden_size: int = 256
    """MLP inner width."""
    num_attention_heads: int = 4
    """Attention heads (query groups equal heads: plain multi-head attention)."""
    seq_length: int = 64
    """Tokens per sample."""
    vocab_size: int = 128
    """Vocabulary size (not padded: TP must divide it)."""
    untie_embeddings: bool = True
    """Separate output layer weight. GTP does not support tied embeddings."""
    init_std: float = 0.02
    """Std of the normal initialization; output projections use std / sqrt(2 * num_layers)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    """Synthetic token data, generated from (seed, global sample id)."""

    seed: int = 1234
    """Seed of the token generator."""
    micro_batch_size: int = 1
    """Samples per micro-batch per data rank."""
    global_batch_size: int = 2
    """Samples per optimizer step across all data ranks and micro-batches."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Side:
    """One implementation under comparison: backend, topology, precision and training."""

    backend: str = "megatron"
    """``megatron`` (megatron-core's own GTP) or ``torch`` (the harness's plain PyTorch GPT)."""
    world_size: int = 1
    """Processes launched for this side."""
    tp: int = 1
    """Tensor-parallel size."""
    gtp: int = 1
    """GTP rematerialization degree G = num_weight_shards / TP (1 = GTP off)."""
    dp: int | None = None
    """Replicate data-parallel size; derived as world / (TP * G) when omitted."""
    precision: str = "fp32"
    """Parameter and compute precision: fp32 or bf16 (megatron); fp64, fp32 or bf16 (torch)."""
    recipe: str = "none"
    """Quantization recipe of the linear GEMMs: none, delayed, float8_current_scaling, mxfp8,
    float8_block_scaling or nvfp4 (Transformer Engine's recipes). The megatron backend needs
    Transformer Engine for any recipe; the torch backend emulates them (harness.quant)."""
    gtp_pad_alignment: int = 16
    """GTP pads dim 0 to a multiple of alignment * G (MCore's ``pad_for_alignment``)."""
    steps: int = 3
    """Optimizer steps."""
    seed: int = 1234
    """Seed of the canonical initial weights."""
    optimizer: str = "adam"
    """adam (decoupled weight decay, as megatron-core's Adam) or sgd."""
    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: float = 3e-5
    """Learning rate at the end of decay."""
    lr_warmup_steps: int = 1
    """Linear warmup steps."""
    lr_decay_steps: int | None = None
    """Steps over which the LR decays (default: steps)."""
    lr_decay_style: str = "cosine"
    """constant, linear or cosine."""
    weight_decay: float = 0.01
    """Weight decay on matrices (not on biases and norms)."""
    clip_grad: float = 1.0
    """Global grad-norm clip; 0 disables."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.0
    """SGD momentum (0: plain SGD, which exposes gradient scaling faults)."""
    inject: tuple[str, ...] = ()
    """Planted faults (names from ``gtp-parity inject --list``), for the harness's self-test."""

    @property
    def data_ranks(self) -> int:
        """Ranks that read distinct samples: GTP peers are data ranks (world / TP)."""
        return self.world_size // self.tp

    @property
    def replicate_dp(self) -> int:
        return self.world_size // (self.tp * self.gtp)

    def num_microbatches(self, data: DataConfig) -> int:
        return data.global_batch_size // (data.micro_batch_size * self.data_ranks)

    def key(self, model: ModelConfig, data: DataConfig) -> str:
        """A short hash identifying what this side computes; equal sides share one run."""
        blob = json.dumps(
            [dataclasses.asdict(self), dataclasses.asdict(model), dataclasses.asdict(data)],
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def label(self) -> str:
        gtp = f"gtp{self.gtp}" if self.gtp > 1 else "gtpoff"
        recipe = "" if self.recipe == "none" else f"-{self.recipe}"
        return f"{self.backend}-w{self.world_size}-tp{self.tp}-{gtp}-{self.precision}{recipe}"


@dataclass(frozen=True, kw_only=True, slots=True)
class CapturePolicy:
    """What each rank records into its trace."""

    kinds: tuple[str, ...] = tuple(sorted(CAPTURE_KINDS))
    """Kinds to capture: input, activation, logits, loss, param, main_grad, optimizer, scalar."""
    tensors: tuple[str, ...] = ("*",)
    """fnmatch patterns over canonical names."""
    steps: tuple[int, ...] | None = None
    """Steps to capture (1-based); None captures every step."""
    mode: str = "full"
    """``full`` stores tensors; ``fingerprint`` stores statistics, a hash and block checksums."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ComparePolicy:
    """How a candidate tensor is judged against the reference (see harness.compare)."""

    policy: str = "noise-floor"
    """exact, dtype or noise-floor."""
    k: float = 4.0
    """noise-floor: candidate error vs golden may be k x the reference's error vs golden ..."""
    floor: float = 8.0
    """... plus this absolute floor (in units of the compared dtype's eps x max|golden|)."""
    k_first_step: float | None = None
    """noise-floor: k at step 1, the one step at which both sides read the same weights and
    inputs in every precision; later steps use ``k``. None: ``k`` throughout."""

    def k_at(self, step: int) -> float:
        return self.k_first_step if step == 1 and self.k_first_step is not None else self.k


@dataclass(frozen=True, kw_only=True, slots=True)
class Scenario:
    """A reference and a candidate, measured against a golden, on one model and data."""

    name: str
    source: str
    model: ModelConfig
    data: DataConfig
    reference: Side
    candidate: Side
    golden: Side
    capture: CapturePolicy = field(default_factory=CapturePolicy)
    compare: ComparePolicy = field(default_factory=ComparePolicy)
    description: str = ""
    timeout_s: float = 600.0
    axes: dict = field(default_factory=dict)
    """Matrix axis -> value label this scenario was expanded with (empty outside a matrix)."""

    @property
    def sides(self) -> dict[str, Side]:
        return {"reference": self.reference, "candidate": self.candidate, "golden": self.golden}


# --- parsing -------------------------------------------------------------------------------

_TOP_KEYS = {
    "name", "description", "timeout_s", "model", "data", "train", "reference", "candidate",
    "golden", "capture", "compare", "axes",
}  # fmt: skip


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _build(cls, table: dict, where: str, skip: frozenset = frozenset()):
    """Instantiate ``cls`` from a TOML table, rejecting unknown keys and mistyped values."""
    if not isinstance(table, dict):
        raise BadInput(where, f"must be a table, got {type(table).__name__}")
    known = _fields(cls)
    kwargs = {}
    for key, value in table.items():
        if key in skip:
            continue
        if key not in known:
            raise BadInput(
                f"{where}.{key}", f"unknown key; known keys are {', '.join(sorted(known))}"
            )
        kwargs[key] = _coerce(value, known[key], f"{where}.{key}")
    return cls(**kwargs)


def _coerce(value: Any, f: dataclasses.Field, where: str) -> Any:
    hint = str(f.type)
    if hint.startswith("tuple"):
        if hint == "tuple[int, ...] | None" and value == "all":
            return None
        if not isinstance(value, list):
            raise BadInput(where, f"must be a list, got {value!r}")
        return tuple(value)
    if "float" in hint and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    base = {"int": int, "float": float, "str": str, "bool": bool}.get(hint.split(" ")[0])
    if value is None and "None" in hint:
        return None
    if base is not None and (not isinstance(value, base) or isinstance(value, bool) != (base is bool)):
        raise BadInput(where, f"must be {hint}, got {value!r}")
    return value


def parse_scenario(raw: dict, source: str) -> Scenario:
    """Build and validate a scenario from a TOML document (already loaded)."""
    for key in raw:
        if key not in _TOP_KEYS:
            raise BadInput(
                f"{source}: {key}", f"unknown key; known keys are {', '.join(sorted(_TOP_KEYS))}"
            )
    if "name" not in raw:
        raise BadInput(f"{source}: name", "every scenario needs a name")
    for side in ("reference", "candidate"):
        if side not in raw:
            raise BadInput(f"{source}: [{side}]", "missing table: a scenario compares two sides")
    model = _build(ModelConfig, raw.get("model", {}), f"{source}: [model]")
    data = _build(DataConfig, raw.get("data", {}), f"{source}: [data]")
    train = raw.get("train", {})
    _build(Side, train, f"{source}: [train]")  # unknown keys in defaults are errors too
    # The golden side inherits training settings but not topology, precision or faults.
    golden_defaults = {"backend": "torch", "precision": "fp64", "world_size": 1, "tp": 1, "gtp": 1,
                       "recipe": "none"}
    inherited = {k: v for k, v in train.items() if k not in {*golden_defaults, "dp", "inject"}}
    sides = {
        "reference": {**train, **raw["reference"]},
        "candidate": {**train, **raw["candidate"]},
        "golden": {**inherited, **golden_defaults, **raw.get("golden", {})},
    }
    sides = {n: _build(Side, t, f"{source}: [{n}]") for n, t in sides.items()}
    scenario = Scenario(
        name=_coerce(raw["name"], _fields(Scenario)["name"], f"{source}: name"),
        source=source,
        description=raw.get("description", ""),
        timeout_s=float(raw.get("timeout_s", 600.0)),
        axes=dict(raw.get("axes", {})),
        model=model,
        data=data,
        capture=_build(CapturePolicy, raw.get("capture", {}), f"{source}: [capture]"),
        compare=_build(ComparePolicy, raw.get("compare", {}), f"{source}: [compare]"),
        **sides,
    )
    validate(scenario)
    return scenario


def validate(s: Scenario) -> None:
    """Check every rule a scenario must satisfy before anything is launched."""
    src, m, d = s.source, s.model, s.data
    if s.timeout_s <= 0:
        raise BadInput(f"{src}: timeout_s", "must be > 0 seconds")
    for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                "seq_length", "vocab_size"):  # fmt: skip
        if getattr(m, key) < 1:
            raise BadInput(f"{src}: [model].{key}", "must be >= 1")
    if m.hidden_size % m.num_attention_heads:
        raise BadInput(f"{src}: [model].hidden_size", "must be a multiple of num_attention_heads")
    if d.micro_batch_size < 1 or d.global_batch_size < 1:
        raise BadInput(f"{src}: [data]", "micro_batch_size and global_batch_size must be >= 1")
    steps = {}
    for name, side in s.sides.items():
        where = f"{src}: [{name}]"
        if side.backend not in BACKENDS:
            raise BadInput(f"{where}.backend", f"unknown backend {side.backend!r}; one of {sorted(BACKENDS)}")
        if side.precision not in PRECISIONS[side.backend]:
            raise BadInput(
                f"{where}.precision",
                f"{side.precision!r} is not supported by the {side.backend} backend; "
                f"one of {sorted(PRECISIONS[side.backend])}",
            )
        if side.recipe not in RECIPE_NAMES:
            raise BadInput(f"{where}.recipe", f"unknown recipe {side.recipe!r}; one of {sorted(RECIPE_NAMES)}")
        if side.optimizer not in OPTIMIZERS:
            raise BadInput(f"{where}.optimizer", f"unknown optimizer {side.optimizer!r}; one of {sorted(OPTIMIZERS)}")
        if side.lr_decay_style not in LR_DECAY_STYLES:
            raise BadInput(f"{where}.lr_decay_style", f"one of {sorted(LR_DECAY_STYLES)}")
        if side.steps < 1:
            raise BadInput(f"{where}.steps", f"must be >= 1, got {side.steps}")
        decay = side.lr_decay_steps or side.steps
        if not 0 <= side.lr_warmup_steps < decay:  # megatron-core's OptimizerParamScheduler asserts it
            raise BadInput(f"{where}.lr_warmup_steps",
                           f"must be >= 0 and < lr_decay_steps (or steps) = {decay}, got {side.lr_warmup_steps}")  # fmt: skip
        for key in ("world_size", "tp", "gtp"):
            if getattr(side, key) < 1:
                raise BadInput(f"{where}.{key}", f"must be >= 1, got {getattr(side, key)}")
        if side.world_size % (side.tp * side.gtp):
            raise BadInput(
                f"{where}.world_size",
                f"world_size {side.world_size} must be a multiple of TP x G = {side.tp} x {side.gtp}",
            )
        if side.dp is not None and side.dp != side.replicate_dp:
            raise BadInput(
                f"{where}.dp",
                f"dp {side.dp} != world_size / (TP x G) = {side.replicate_dp}",
            )
        for key in ("num_attention_heads", "hidden_size", "ffn_hidden_size", "vocab_size"):
            if getattr(m, key) % side.tp:
                raise BadInput(
                    f"{where}.tp",
                    f"TP {side.tp} must divide [model].{key} = {getattr(m, key)}",
                )
        if side.gtp > 1:
            if not m.untie_embeddings:
                raise BadInput(
                    f"{src}: [model].untie_embeddings",
                    f"tied embedding/output weights are not supported with GTP ([{name}].gtp = {side.gtp})",
                )
            if side.backend == "megatron" and side.gtp_pad_alignment == 0:
                # Without padding MCore requires G to divide dim 0 of every GTP-sharded weight.
                for key, dim0 in _gtp_dim0s(m, side.tp).items():
                    if dim0 % side.gtp:
                        raise BadInput(
                            f"{where}.gtp",
                            f"G {side.gtp} must divide dim 0 of {key} ({dim0}) when gtp_pad_alignment = 0",
                        )
        if name == "golden" and (side.world_size != 1 or side.tp != 1 or side.gtp != 1):
            raise BadInput(
                f"{where}.world_size",
                "the golden side runs in a single process: world_size = tp = gtp = 1",
            )
        for fault in side.inject:
            if (problem := check_name(fault)) is not None:
                raise BadInput(f"{where}.inject", problem)
        if "fp8-unreduced-amax" in side.inject and (side.backend != "torch" or side.recipe == "none"):
            raise BadInput(f"{where}.inject", "fp8-unreduced-amax needs the torch backend with a recipe")
        if side.recipe in _RECIPE_BLOCK:
            block = _RECIPE_BLOCK[side.recipe]
            dims = {**{k: v for k, v in _gtp_dim0s(m, side.tp).items()},
                    "hidden_size": m.hidden_size, "tokens per micro-batch": m.seq_length * d.micro_batch_size}
            for key, dim in dims.items():
                if dim % block:
                    raise BadInput(f"{where}.recipe", f"{side.recipe} needs {key} ({dim}) to be a multiple of {block}")
            if side.gtp > 1 and side.gtp_pad_alignment % block:
                raise BadInput(f"{where}.gtp_pad_alignment",
                               f"{side.recipe} needs GTP shards aligned to its {block}-row blocks")
        if name == "golden" and side.inject:
            raise BadInput(f"{where}.inject", "faults are planted in the reference or candidate, not the golden")
        unit = d.micro_batch_size * side.data_ranks
        if d.global_batch_size % unit:
            raise BadInput(
                f"{src}: [data].global_batch_size",
                f"{d.global_batch_size} must be a multiple of micro_batch_size x data ranks "
                f"= {d.micro_batch_size} x {side.data_ranks} for [{name}]",
            )
        steps[name] = side.steps
    if len(set(steps.values())) != 1:
        raise BadInput(f"{src}: steps", f"every side must run the same number of steps, got {steps}")
    for kind in s.capture.kinds:
        if kind not in CAPTURE_KINDS:
            raise BadInput(f"{src}: [capture].kinds", f"unknown kind {kind!r}; one of {sorted(CAPTURE_KINDS)}")
    if s.capture.mode not in ("full", "fingerprint"):
        raise BadInput(f"{src}: [capture].mode", "full or fingerprint")
    if s.compare.policy not in POLICIES:
        raise BadInput(f"{src}: [compare].policy", f"one of {sorted(POLICIES)}")
    for key in ("k", "k_first_step", "floor"):
        value = getattr(s.compare, key)
        if value is not None and not value >= 0:
            raise BadInput(f"{src}: [compare].{key}", f"must be >= 0, got {value}")


# Block formats need whole blocks along both GEMM dims (TE pads nothing here).
_RECIPE_BLOCK = {"mxfp8": 32, "nvfp4": 16}


def _gtp_dim0s(m: ModelConfig, tp: int) -> dict[str, int]:
    """Dim 0 of each GTP-sharded weight's TP-local block."""
    return {
        "linear_qkv": 3 * m.hidden_size // tp,
        "linear_proj": m.hidden_size,
        "linear_fc1": m.ffn_hidden_size // tp,
        "linear_fc2": m.hidden_size,
        "word_embeddings": m.vocab_size // tp,
        "output_layer": m.vocab_size // tp,
    }


# --- files and matrices --------------------------------------------------------------------


def _load_toml(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise BadInput(str(path), "no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise BadInput(str(path), f"invalid TOML: {e}") from None


def load(path: str | Path) -> list[Scenario]:
    """Load a scenario file or a matrix file (one with a ``[matrix]`` table)."""
    path = Path(path)
    raw = _load_toml(path)
    if "matrix" in raw:
        return expand_matrix(raw, path)
    return [parse_scenario(raw, str(path))]


def _deep_merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _set_path(doc: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        doc = doc.setdefault(p, {})
    doc[leaf] = value


def expand_matrix(raw: dict, path: Path) -> list[Scenario]:
    """Expand ``[matrix]`` into the product of its axes.

    ``[matrix]`` keys: ``base`` (a scenario file, relative to this one; optional, the other
    top-level tables of this file are merged over it; a base's own ``[matrix]`` is not used,
    so a longer matrix can reuse a shorter one's model and policy), ``name`` (a template;
    ``{axis}`` is replaced by the axis value or label), and ``[matrix.axes]``: each key is a
    dotted path into the scenario (``train.precision``), or several joined by commas that take
    the same value (``reference.tp,candidate.tp``), or a label whose values are tables merged
    at the scenario root (each with a ``label`` key used in names).
    """
    src = str(path)
    spec = dict(raw["matrix"])
    unknown = set(spec) - {"base", "name", "axes"}
    if unknown:
        raise BadInput(f"{src}: [matrix].{sorted(unknown)[0]}", "unknown key; known: base, name, axes")
    doc = {k: v for k, v in raw.items() if k != "matrix"}
    if "base" in spec:
        base = {k: v for k, v in _load_toml(path.parent / spec["base"]).items() if k != "matrix"}
        doc = _deep_merge(base, doc)
    axes = spec.get("axes", {})
    if not axes:
        raise BadInput(f"{src}: [matrix.axes]", "a matrix needs at least one axis")
    for axis, values in axes.items():
        if not isinstance(values, list) or not values:
            raise BadInput(f"{src}: [matrix.axes].{axis}", "must be a non-empty list")
    template = spec.get("name", "-".join("{" + a + "}" for a in axes))
    scenarios, names = [], set()
    for combo in itertools.product(*axes.values()):
        scen = copy.deepcopy(doc)
        labels = {}
        for axis, value in zip(axes, combo):
            if isinstance(value, dict):
                value = dict(value)
                labels[axis] = str(value.pop("label", axis))
                scen = _deep_merge(scen, value)
            else:
                labels[axis] = "+".join(map(str, value)) if isinstance(value, list) else str(value)
                for dotted in axis.split(","):
                    _set_path(scen, dotted.strip(), value)
        unknown = set(re.findall(r"\{([^}]*)\}", template)) - set(labels)
        if unknown:
            raise BadInput(f"{src}: [matrix].name", f"template names unknown axis {sorted(unknown)[0]!r}")
        scen["axes"] = labels
        scen["name"] = re.sub(r"\{([^}]*)\}", lambda mt: labels[mt.group(1)], template)
        if scen["name"] in names:
            raise BadInput(f"{src}: [matrix].name", f"template gives duplicate name {scen['name']!r}")
        names.add(scen["name"])
        scenarios.append(parse_scenario(scen, f"{src} ({scen['name']})"))
    return scenarios
