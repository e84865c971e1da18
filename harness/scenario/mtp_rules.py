"""The rules of multi-token prediction (MTP) scenarios, checked before anything is launched.
Each is megatron-core 0.19.2's own constraint or a limit of what the harness covers, said as
such."""

from __future__ import annotations


from harness.common.errors import BadInput
from harness.scenario.faults import MTP_FAULTS
from harness.scenario.schema import ModelConfig, Scenario, Side


def validate_mtp_model(s: Scenario) -> None:
    m, src = s.model, s.source
    if not m.mtp_num_layers:
        if m.mtp_use_repeated_layer:
            raise BadInput(f"{src}: [model].mtp_use_repeated_layer",
                           "takes effect only with mtp_num_layers > 0")
        return
    if not m.untie_embeddings:
        # The MTP heads would read the word embedding as their output layer: not recorded here.
        raise BadInput(f"{src}: [model].untie_embeddings", "MTP scenarios run with untied embeddings")
    if s.data.loss_mask != "none" and s.data.micro_batch_size > 1:
        # Under the per-token loss a variable mask needs, process_mtp_loss weights each micro-batch's
        # depth token mean by its share of the unrolled tokens (original_num_tokens / num_tokens):
        # the golden weighs samples, which are micro-batches at micro_batch_size 1 on every topology.
        raise BadInput(f"{src}: [data].micro_batch_size", "MTP with a variable loss mask is covered with "
                       "micro_batch_size = 1 (the golden weighs each depth per sample) only, not yet beyond")
    if m.mtp_num_layers >= m.seq_length:
        # Depth d predicts the token d + 1 places ahead: past the sequence nothing is left to predict.
        raise BadInput(f"{src}: [model].mtp_num_layers",
                       f"must be < seq_length = {m.seq_length} (depth d masks the last d + 1 tokens)")


def validate_mtp_side(s: Scenario, name: str, side: Side, where: str) -> None:
    m = s.model
    if not m.mtp_num_layers:
        if planted := [f for f in side.inject if f in MTP_FAULTS]:
            raise BadInput(f"{where}.inject",
                           f"{planted[0]!r} never fires without MTP ([model].mtp_num_layers = 0)")
        return
    if side.backend == "mlm" or (side.backend == "torch" and name != "golden"):
        raise BadInput(f"{where}.backend",
                       "MTP runs on the megatron backend, and on the torch backend as the golden only")
    if side.virtual_pipeline is not None:
        # Under pipelining megatron-core builds the MTP block on the last stage with a copy of the
        # embeddings (recorded as the first stage's replica); which model chunk holds it when
        # interleaved (mtp_on_this_rank(vp_stage=)) is not recorded by this harness.
        raise BadInput(f"{where}.virtual_pipeline",
                       "MTP with an interleaved pipeline (virtual_pipeline) is not covered yet")


def mtp_parameter_count(m: ModelConfig) -> int:
    """Parameters the MTP block adds: per layer built, three LayerNorms, eh_proj and a
    transformer layer (its MoE experts included)."""
    if not m.mtp_num_layers:
        return 0
    h, f = m.hidden_size, m.ffn_hidden_size
    layer = 4 * h * h + 2 * h * f + 4 * h
    if m.num_experts:
        layer += m.num_experts * h + (m.num_experts - 1) * 2 * h * f
    built = 1 if m.mtp_use_repeated_layer else m.mtp_num_layers
    return built * (6 * h + 2 * h * h + layer)
