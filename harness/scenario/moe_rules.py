"""The rules of MoE scenarios (routed experts, expert parallelism, expert GTP), checked before
anything is launched. Each is megatron-core 0.19.2's own constraint (file and check named) or a
limit of what the harness covers, said as such.
"""

from __future__ import annotations

from harness.common.errors import BadInput
from harness.scenario.faults import MOE_FAULTS
from harness.scenario.schema import ModelConfig, Scenario, Side


def validate_moe_model(s: Scenario) -> None:
    m, src = s.model, s.source
    if not m.num_experts:
        return
    if not 1 <= m.moe_topk <= m.num_experts:
        # TopKRouter: torch.topk(k) over num_moe_experts scores
        raise BadInput(f"{src}: [model].moe_topk",
                       f"must be in 1..num_experts = {m.num_experts}, got {m.moe_topk}")


def validate_moe_side(s: Scenario, name: str, side: Side, where: str) -> None:
    m = s.model
    if not m.num_experts and (planted := [f for f in side.inject if f in MOE_FAULTS]):
        raise BadInput(f"{where}.inject",
                       f"{planted[0]!r} never fires on a dense model ([model].num_experts = 0)")
    if side.ep * side.expert_gtp == 1 and not m.num_experts:
        return
    if not m.num_experts:
        raise BadInput(f"{where}.ep", "expert parallelism and expert GTP need [model].num_experts > 0")
    if side.backend == "mlm" or (side.backend == "torch" and name != "golden"):
        raise BadInput(f"{where}.backend",
                       "MoE runs on the megatron backend, and on the torch backend as the golden only")
    if name == "golden" and side.ep * side.expert_gtp != 1:
        raise BadInput(f"{where}.ep", "the golden side runs in a single process: ep = expert_gtp = 1")
    if side.tp != 1:
        raise BadInput(f"{where}.tp",
                       "MoE scenarios run at TP 1: expert tensor parallelism is not covered yet")
    if m.num_experts % side.ep:
        # MoELayer: num_moe_experts % expert_model_parallel_size == 0 (moe_layer.py, BaseMoELayer)
        raise BadInput(f"{where}.ep", f"EP {side.ep} must divide [model].num_experts = {m.num_experts}")
    expert_grid = side.tp * side.ep * side.expert_gtp
    if side.world_size % expert_grid:
        # initialize_model_parallel: world % (ETP x EP x PP x EGTP) (parallel_state.py)
        raise BadInput(f"{where}.world_size",
                       f"world_size {side.world_size} must be a multiple of expert TP x EP x EGTP = "
                       f"{expert_grid}")
    if side.expert_gtp > 1 and side.gtp_pad_alignment == 0:
        for key, dim0 in {"linear_fc1": m.ffn_hidden_size, "linear_fc2": m.hidden_size}.items():
            if dim0 % side.expert_gtp:  # _gtp_slice_one_param's no-pad assertion
                raise BadInput(f"{where}.expert_gtp",
                               f"EGTP {side.expert_gtp} must divide dim 0 of the experts' {key} ({dim0}) "
                               f"when gtp_pad_alignment = 0")
    if side.expert_gtp > 1 and not m.untie_embeddings:
        raise BadInput(f"{s.source}: [model].untie_embeddings",
                       "tied embedding/output weights are not supported with GTP")
    if side.ep * side.expert_gtp > 1 and side.distributed_optimizer:
        raise BadInput(f"{where}.distributed_optimizer",
                       "not covered with expert parallelism or expert GTP yet")


def moe_parameter_count(m: ModelConfig) -> int:
    """Parameters an MoE layer adds over the dense MLP it replaces (router and E experts)."""
    if not m.num_experts:
        return 0
    h, f = m.hidden_size, m.ffn_hidden_size
    return m.num_layers * (m.num_experts * h + (m.num_experts - 1) * 2 * h * f)
