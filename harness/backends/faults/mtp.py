"""Planted faults of multi-token prediction (:data:`harness.scenario.faults.MTP_FAULTS`), and
``backport-gtp-mtp``, the baseline they are planted on with the 0.19.2 wheel: run-time wraps of
megatron-core's GTP and MTP functions, undone with the side's other patches.

``backport-gtp-mtp`` gives the wheel's GTP the rules Megatron-LM added for weights used more
than once per forward (79e6b6a7f5, its GTP guide's section 3.5; d262dbed3d), each a wrap that
decides before the wheel's own function runs:

- a use with no all-gather issued for it (no prefetch handle, none drained) is gathered on
  demand, not read from the shared buffer: the chain neighbour that would have prefetched it
  ran once, for the weight's first use;
- a weight's wgrad reduce-scatter still in flight is waited and added to ``main_grad`` before
  the weight's next one starts (a second would reuse its ticket's buffer and handle);
- the chain's deferred finalize of the next weight runs only when that weight has a
  reduce-scatter in flight (MTP's late embedding use reaches backward before layer 0's);
- the placeholder wgrad of a ``zero_out_wgrad`` weight (MTP's shared embedding: DDP adds its
  ``.grad``) is zeroed before DDP's hook reads it.
"""

from __future__ import annotations

import torch

from harness.backends.patching import patch


def _gtp():
    from megatron.core.tensor_parallel import generalized_tensor_parallelism as gtp

    return gtp


def _without(obj, attr: str, call):
    """``call()`` with ``obj.attr`` None for its duration."""
    kept = getattr(obj, attr)
    setattr(obj, attr, None)
    try:
        return call()
    finally:
        setattr(obj, attr, kept)


def _no_gather_issued(w) -> bool:
    return w._prefetch_handle is None and not getattr(w, "_already_ag_drained", False)


def _backport(ctx) -> None:
    gtp = _gtp()
    cls, config = gtp.GTPShardedParam, gtp.GTP_CONFIG
    gather, gather_bwd = cls.all_gather_and_prefetch, cls.all_gather_and_prefetch_bwd
    reduce_scatter, grad_accum = cls.wgrad_reduce_scatter, cls._handle_megatron_grad_accum

    def all_gather_and_prefetch(self, fwd=True, nvtx_label=None):
        call = lambda: gather(self, fwd=fwd, nvtx_label=nvtx_label)  # noqa: E731
        on_demand = config.weight_prefetch and self.prev_w is not None and _no_gather_issued(self)
        if on_demand and not gtp.in_fp8_activation_recompute_phase():
            return _without(self, "prev_w", call)  # the consume takes the on-demand branch
        return call()

    def all_gather_and_prefetch_bwd(self, nvtx_label=None):
        call = lambda: gather_bwd(self, nvtx_label=nvtx_label)  # noqa: E731
        if config.weight_prefetch and self.next_w is not None and _no_gather_issued(self):
            return _without(self, "next_w", call)
        return call()

    def wgrad_reduce_scatter(self, wgrad, nvtx_label=None):
        if config.async_reduction and self._wgrad_rs_handle is not None:
            self._wait_reduce_scatter(finalize_grad=True)  # this weight's previous use, accounted here
            self._already_finalized = False
        call = lambda: reduce_scatter(self, wgrad, nvtx_label=nvtx_label)  # noqa: E731
        if config.async_reduction and self.next_w is not None and self.next_w._wgrad_rs_handle is None:
            return _without(self, "next_w", call)  # nothing in flight to finalize
        return call()

    def handle_megatron_grad_accum(param):
        if getattr(param, "zero_out_wgrad", False):  # DDP's hook adds .grad: the placeholder must be 0
            gtp.get_dummy_wgrad(list(param.main_grad.shape), param.dtype, zero=True)
        return grad_accum(param)

    patch(cls, "all_gather_and_prefetch", all_gather_and_prefetch)
    patch(cls, "all_gather_and_prefetch_bwd", all_gather_and_prefetch_bwd)
    patch(cls, "wgrad_reduce_scatter", wgrad_reduce_scatter)
    patch(cls, "_handle_megatron_grad_accum", staticmethod(handle_megatron_grad_accum))


def _output_wgrad_dropped(ctx) -> None:
    # Per micro-batch the output layer's backward runs 1 + D times: the main head's first, then
    # the depths' from the last; the second call's wgrad (the last depth's use) is zeroed.
    target = dict(ctx.named_params).get("output_layer.weight")
    cls = _gtp().GTPShardedParam
    uses = 1 + (ctx.model[0].config.mtp_num_layers or 0)  # the model chunk's TransformerConfig
    original, calls = cls.wgrad_reduce_scatter, [0]

    def wgrad_reduce_scatter(self, wgrad, nvtx_label=None):
        if self is target:
            calls[0] += 1
            if calls[0] % uses == 2 % uses:
                wgrad = torch.zeros_like(wgrad)
        return original(self, wgrad, nvtx_label=nvtx_label)

    patch(cls, "wgrad_reduce_scatter", wgrad_reduce_scatter)


def _labels_not_shifted(ctx) -> None:
    # process_mtp_loss rolls the labels, then the loss mask, once per depth: its first roll is
    # depth 0's labels, which this leaves as they are.
    from megatron.core.models.gpt import gpt_model
    from megatron.core.transformer import multi_token_prediction as mtp

    process, roll = gpt_model.process_mtp_loss, mtp.roll_tensor

    def process_mtp_loss(*args, **kwargs):
        calls = [0]

        def first_roll_skipped(tensor, *a, **k):
            calls[0] += 1
            return (tensor, tensor.sum()) if calls[0] == 1 else roll(tensor, *a, **k)

        mtp.roll_tensor = first_roll_skipped
        try:
            return process(*args, **kwargs)
        finally:
            mtp.roll_tensor = roll

    patch(gpt_model, "process_mtp_loss", process_mtp_loss)


def _embedding_grads_not_reduced(ctx) -> None:
    import importlib

    # The package exports the function finalize_model_grads under the module's name: the module itself.
    module = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    patch(module, "_allreduce_word_embedding_grads", lambda *args, **kwargs: None)


MTP_INSTALLERS = {
    "mtp-stage-embedding-grads-not-reduced": _embedding_grads_not_reduced,
    "backport-gtp-mtp": _backport,
    "mtp-output-wgrad-dropped": _output_wgrad_dropped,
    "mtp-labels-not-shifted": _labels_not_shifted,
}
