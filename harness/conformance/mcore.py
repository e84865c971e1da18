"""Factory for megatron-core's ``GTPShardedParam`` (the local-module post-init slicing path).

Builds one ``torch.nn.Module`` per protocol group holding full TP-local weights, shards them
with MCore's own ``wrap_module_params_gtp`` (padding, slicing, GTP attributes), and attaches a
zero ``main_grad`` of the shard's shape the way MCore DDP does. ``GTP_CONFIG`` carries the
case: ``pad_for_alignment``, ``calculate_per_token_loss``, and ``weight_prefetch`` /
``async_reduction`` for the overlap mode. The prefetch chain links itself in the first forward
walk, exactly as in training.

On a machine without CUDA the CPU compatibility layer is installed first and MCore's
process-global GTP state is reset before every build, so cases in one process are independent.

Grouped (routed-expert) weights go through ``_coalescing_manager``, which gloo lacks, and a
``gather_along_first_dim(..., external_coalescing=True)`` call the compatibility layer does not
accept yet; on CPU those cases raise :class:`~harness.conformance.drive.Unsupported`.
"""

from __future__ import annotations

import inspect

import torch

from harness.conformance.drive import Unsupported


def _prepare():
    """Install the CPU layer (a no-op where CUDA works), reset GTP's globals, return its module."""
    from harness.backends.megatron import compat

    compat.install()
    compat.reset_gtp_state()
    from megatron.core.tensor_parallel import generalized_tensor_parallelism as gtp

    return gtp


def _grouped_supported(gtp) -> bool:
    if torch.cuda.is_available():
        return True
    params = inspect.signature(gtp.gather_along_first_dim).parameters
    return "external_coalescing" in params


def gtp_sharded_param(
    *,
    logical_weights,
    gtp_group,
    main_grad_dtype,
    pad_for_alignment,
    per_token_loss,
    overlap,
    group_size,
    **_,
) -> list:
    """Shard ``logical_weights`` into GTPShardedParams, ``group_size`` weights per module."""
    gtp = _prepare()
    if group_size > 1 and not _grouped_supported(gtp):
        raise Unsupported(
            "grouped GTP weights need coalesced collectives: gloo has no _coalescing_manager "
            "support and the CPU layer's gather_along_first_dim takes no external_coalescing"
        )
    gtp.update_gtp_config(
        pad_for_alignment=pad_for_alignment,
        calculate_per_token_loss=per_token_loss,
        weight_prefetch=overlap,
        async_reduction=overlap,
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    weights = []
    for start in range(0, len(logical_weights), group_size):
        module = torch.nn.Module()
        names = [f"weight{j}" if group_size > 1 else "weight" for j in range(group_size)]
        for name, logical in zip(names, logical_weights[start : start + group_size]):
            module.register_parameter(name, torch.nn.Parameter(logical.to(device)))
        gtp.wrap_module_params_gtp(module, names, gtp_group, is_grouped=group_size > 1)
        for name in names:
            weight = getattr(module, name)
            if group_size > 1:
                # Classify as MCore classifies a routed expert's fc1 in layer `start // group_size`
                # (classify_gtp_chains does this by name): the grouped chain, double-buffered.
                weight.chain_id = gtp._classify_param_chain(
                    f"decoder.layers.{start // group_size}.mlp.experts.linear_fc1.{name}")
            weight.main_grad = torch.zeros(weight.shape, dtype=main_grad_dtype, device=device)
            weights.append(weight)
    return weights


def _drain() -> None:
    # What finalize_model_grads does before the DP gradient sync.
    from megatron.core.tensor_parallel import generalized_tensor_parallelism as gtp

    gtp.wait_async_comms()


gtp_sharded_param.drain = _drain
