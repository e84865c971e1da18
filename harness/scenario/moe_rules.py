"""The rules of MoE scenarios (routed experts, expert parallelism, expert GTP), checked before
anything is launched. Each is megatron-core 0.19.2's own constraint (file and check named) or a
limit of what the harness covers, said as such.
"""

from __future__ import annotations

from harness.common.errors import BadInput
from harness.scenario.faults import MOE_FAULTS, model_reach
from harness.scenario.schema import GATED, ModelConfig, Scenario, Side


# The MoE keys that take effect only with routed experts, by their defaults.
_WITH_EXPERTS = {"moe_shared_expert_intermediate_size": None, "moe_router_score_function": "softmax",
                 "moe_router_num_groups": None, "moe_router_group_topk": None,
                 "moe_router_padding_mask": False}


def validate_moe_model(s: Scenario) -> None:
    m, src = s.model, s.source
    if not m.num_experts:
        for key, default in _WITH_EXPERTS.items():
            if getattr(m, key) != default:
                raise BadInput(f"{src}: [model].{key}", "takes effect only with [model].num_experts > 0")
        return
    if not 1 <= m.moe_topk <= m.num_experts:
        # TopKRouter: torch.topk(k) over num_moe_experts scores
        raise BadInput(f"{src}: [model].moe_topk",
                       f"must be in 1..num_experts = {m.num_experts}, got {m.moe_topk}")
    if m.moe_topk == 1 and m.moe_router_score_function == "softmax":
        # TransformerConfig.__post_init__ (softmax over one logit has no gradient); pre-softmax is not a key
        raise BadInput(f"{src}: [model].moe_topk",
                       "megatron-core: \"Please use --moe-router-pre-softmax when topk is 1\" (the softmax "
                       "over one top logit has a zero gradient); the pre-softmax router is not covered yet")
    _validate_group_topk(s)
    _validate_padding_mask(s)


def _validate_padding_mask(s: Scenario) -> None:
    """The router's padding mask is the tokens the loss mask drops; megatron-core reads it in the
    load-balancing loss and the z-loss only (router.py routing, moe_utils.py): else it changes nothing."""
    m, src = s.model, s.source
    if not m.moe_router_padding_mask:
        return
    if s.data.loss_mask == "none":
        raise BadInput(f"{src}: [model].moe_router_padding_mask",
                       "the padding mask is the tokens [data].loss_mask drops: with loss_mask = \"none\" it "
                       "masks none (set loss_mask = \"variable\")")
    if m.moe_aux_loss_coeff == 0:
        raise BadInput(f"{src}: [model].moe_router_padding_mask",
                       "megatron-core's router reads the padding mask in the load-balancing loss (and the "
                       "z-loss, not a key) only: with moe_aux_loss_coeff = 0 it changes nothing")
    if m.mtp_num_layers:
        raise BadInput(f"{src}: [model].moe_router_padding_mask", "with MTP is not covered yet")


def _validate_group_topk(s: Scenario) -> None:
    """Group-limited routing (megatron-core's ``group_limited_topk``): E experts in G groups, each
    token's groups chosen by the sum of their top (k / group_topk) scores, its k experts from those."""
    m, src = s.model, s.source
    groups, chosen = m.moe_router_num_groups, m.moe_router_group_topk
    if chosen is None:
        if groups is not None:
            raise BadInput(f"{src}: [model].moe_router_num_groups",
                           "takes effect only with moe_router_group_topk (group-limited routing)")
        return
    if groups is None:  # TransformerConfig.__post_init__
        raise BadInput(f"{src}: [model].moe_router_group_topk",
                       "megatron-core: when using group limited routing, moe_router_num_groups must be "
                       "specified")
    if m.num_experts % groups:  # TransformerConfig.__post_init__'s assertion
        raise BadInput(f"{src}: [model].moe_router_num_groups",
                       f"must divide num_experts = {m.num_experts}, got {groups}")
    if chosen > groups:  # TransformerConfig.__post_init__'s assertion
        raise BadInput(f"{src}: [model].moe_router_group_topk",
                       f"must be <= moe_router_num_groups = {groups}, got {chosen}")
    per_group = m.num_experts // groups
    if not 1 <= m.moe_topk // chosen <= per_group:
        # group_limited_topk: topk(k // group_topk) within each group of E / G experts
        raise BadInput(f"{src}: [model].moe_topk",
                       f"moe_topk // moe_router_group_topk = {m.moe_topk} // {chosen} must be in "
                       f"1..{per_group} (the experts of a group its score sums)")
    if m.moe_topk > chosen * per_group:
        raise BadInput(f"{src}: [model].moe_topk",
                       f"must be <= the experts of the chosen groups ({chosen} x {per_group}), "
                       f"got {m.moe_topk}")


def validate_moe_side(s: Scenario, name: str, side: Side, where: str) -> None:
    m = s.model
    for fault in side.inject:
        if fault in MOE_FAULTS and (problem := model_reach(fault, side, m)) is not None:
            raise BadInput(f"{where}.inject", problem)
    if side.ep * side.expert_gtp == 1 and side.expert_tp is None and not m.num_experts:
        return
    if not m.num_experts:
        key = "ep" if side.ep * side.expert_gtp > 1 else "expert_tp"
        raise BadInput(f"{where}.{key}",
                       "expert parallelism, expert TP and expert GTP need [model].num_experts > 0")
    # The torch backend's golden model (one process, fp32 or fp64, no recipe) holds MoE layers; its
    # sharded model does not: a compared torch side is that golden model (megatron-core against it).
    golden_model = side.world_size == 1 and side.recipe == "none" and side.precision in ("fp32", "fp64")
    if side.backend == "mlm" or (side.backend == "torch" and name != "golden" and not golden_model):
        raise BadInput(f"{where}.backend", "MoE runs on the megatron backend, and on the torch backend as "
                       "the golden model only (world_size 1, fp32 or fp64, no recipe)")
    if (name == "golden" or side.backend == "torch") and side.ep * side.expert_gtp != 1:
        raise BadInput(f"{where}.ep", "the golden model runs in a single process: ep = expert_gtp = 1")
    _validate_expert_tp(s, side, where)
    if m.num_experts % side.ep:
        # MoELayer: num_moe_experts % expert_model_parallel_size == 0 (moe_layer.py, BaseMoELayer)
        raise BadInput(f"{where}.ep", f"EP {side.ep} must divide [model].num_experts = {m.num_experts}")
    expert_grid = side.etp * side.ep * side.pipeline_parallel * side.expert_gtp
    if side.world_size % expert_grid:
        # initialize_model_parallel: world % (ETP x EP x PP x EGTP) (parallel_state.py l.873-884)
        raise BadInput(f"{where}.world_size",
                       f"world_size {side.world_size} must be a multiple of expert TP x EP x PP x EGTP = "
                       f"{expert_grid}")
    k = 2 if m.activation in GATED else 1  # a gated fc1 holds [gate; up]
    if side.expert_gtp > 1 and side.gtp_pad_alignment == 0:  # dim 0 of the expert-TP-local block
        rows = {"linear_fc1": k * m.ffn_hidden_size // side.etp, "linear_fc2": m.hidden_size}
        for key, dim0 in rows.items():
            if dim0 % side.expert_gtp:  # _gtp_slice_one_param's no-pad assertion
                raise BadInput(f"{where}.expert_gtp",
                               f"EGTP {side.expert_gtp} must divide dim 0 of the experts' {key} ({dim0}) "
                               f"when gtp_pad_alignment = 0")
    shared = m.moe_shared_expert_intermediate_size
    if shared and side.tp > 1 and shared % side.tp:  # SharedExpertMLP's fc1 is column-parallel over TP
        raise BadInput(f"{s.source}: [model].moe_shared_expert_intermediate_size",
                       f"TP {side.tp} must divide it, got {shared}")
    if shared and side.gtp > 1 and side.gtp_pad_alignment == 0 and (k * shared // side.tp) % side.gtp:
        raise BadInput(f"{where}.gtp", f"G {side.gtp} must divide dim 0 of the shared experts' TP-local "
                       f"linear_fc1 ({k * shared // side.tp}) when gtp_pad_alignment = 0")
    if side.expert_gtp > 1 and not m.untie_embeddings:
        raise BadInput(f"{s.source}: [model].untie_embeddings",
                       "tied embedding/output weights are not supported with GTP")
    if side.ep * side.expert_gtp > 1 and side.distributed_optimizer:
        raise BadInput(f"{where}.distributed_optimizer",
                       "not covered with expert parallelism or expert GTP yet")


def _validate_expert_tp(s: Scenario, side: Side, where: str) -> None:
    """The experts' tensor parallelism: ETP 1 or TP, sequence parallelism at TP > 1."""
    etp = side.etp
    if etp not in (1, side.tp):
        # megatron-core takes any ETP whose expert grid fits the world (initialize_model_parallel);
        # the harness lays experts out at ETP 1 (whole on every rank of their EP coordinate) or TP.
        raise BadInput(f"{where}.expert_tp",
                       f"must be 1 or TP = {side.tp}, got {etp}: other expert TP sizes are not covered yet")
    if side.tp > 1 and not side.sequence_parallel:
        # MoELayer.forward raises in training (transformer/moe/moe_layer.py, 0.19.2 l.629-633): "During
        # training, performance may degrade if MoE and tensor parallelism are enabled without also
        # enabling sequence parallelism." (a ValueError, not a warning)
        raise BadInput(f"{where}.sequence_parallel",
                       f"megatron-core refuses to train MoE at TP {side.tp} without sequence parallelism "
                       "(MoELayer.forward: \"performance may degrade if MoE and tensor parallelism are "
                       "enabled without also enabling sequence parallelism\"): set sequence_parallel = true")
    if side.tp > 1 and side.ep > 1:
        # At expert TP > 1 the alltoall dispatcher gathers each rank's routed tokens over the expert TP
        # group in uneven parts (token_dispatcher.py dispatch_postprocess l.739: all_gather of a list of
        # output_split_sizes), which gloo's all_gather refuses; expert TP 1 with EP is not run either.
        raise BadInput(f"{where}.ep", f"expert parallelism at TP {side.tp} is not covered yet (the alltoall "
                       "dispatcher's uneven all-gather over the expert TP group does not run on CPU)")
    if side.tp > 1 and (side.save_step or side.load_step or side.resume_from):
        raise BadInput(f"{where}.tp", f"MoE checkpoints at TP {side.tp} are not covered yet")
    if etp > 1 and s.model.ffn_hidden_size % etp:  # the experts' fc1 is column-parallel over ETP
        raise BadInput(f"{where}.expert_tp",
                       f"expert TP {etp} must divide [model].ffn_hidden_size = {s.model.ffn_hidden_size}")


def moe_parameter_count(m: ModelConfig) -> int:
    """Parameters an MoE layer adds over the dense MLP it replaces (router, E experts, shared experts)."""
    if not m.num_experts:
        return 0
    h, f, s = m.hidden_size, m.ffn_hidden_size, m.moe_shared_expert_intermediate_size or 0
    k = 2 if m.activation in GATED else 1  # arch_parameter_count counts the dense MLP's gate
    return m.num_layers * (m.num_experts * h + ((m.num_experts - 1) * f + s) * (k + 1) * h)
