"""The ``bridge`` backend: Megatron-Bridge's own loop, ``megatron.bridge.training.pretrain``, captured.

Bridge drives the loop (its setup, its GTP wiring where the tree has it, its ``train`` and
``train_step``, its forward step and loss); the harness supplies the model and data providers
(:mod:`.providers`) and records at the hook points the mlm backend records at, through the same
:class:`~harness.backends.mlm.run._Hooks`, so the trace has the same schema and order:

- ``train_step`` (wrapped, a module global of ``megatron.bridge.training.train``): the step's
  begin and end, and its scalars from what ``train_step`` returns (the loss reduced by Bridge
  over its data-distribution group, grad norm, num-zeros);
- the forward step's micro-batches and loss function: sample ids and per-micro-batch losses;
- ``finalize_model_grads`` (wrapped where ``setup`` hands it to the model config):
  ``main_grad`` after the reduction;
- ``optimizer.step`` (wrapped for the step): LR applied, weights before and after, state;
- ``training_log``'s printed line (``print_rank_last``): the loss the frontend logs,
  ``loss_logged``, which the mlm backend records from Megatron-LM's line the same way.
"""

from __future__ import annotations

from harness.backends import faults
from harness.backends.bridge import compat as bridge_compat
from harness.backends.bridge import config, providers
from harness.backends.megatron import compat
from harness.backends.mlm.run import _Hooks, logged_loss
from harness.backends.patching import patch
from harness.capture.api import Capture
from harness.run.job import Job


def run(job: Job, cap: Capture) -> None:
    """Train ``job``'s side with Megatron-Bridge's ``pretrain`` on this rank."""
    bridge_compat.import_bridge()
    from megatron.bridge.training import initialize, pretrain, setup, train
    from megatron.bridge.training.utils import train_utils

    on_cpu = bridge_compat.install()
    compat.reset_gtp_state()
    hooks = _BridgeHooks(job, cap)
    try:
        patch(train, "train_step", hooks.bridge_train_step(train.train_step))
        patch(setup, "finalize_model_grads", hooks.finalize(setup.finalize_model_grads))
        patch(train_utils, "print_rank_last", logged_loss(cap, train_utils.print_rank_last))
        model = providers.model_provider(config.model_fields(job, on_cpu), hooks.after_build)
        if job.side.data == "mock":  # Bridge's mock pipeline, as the seed's Bridge run read it
            dataset = providers.mock_dataset(job.side.seed, job.model, on_cpu)
            patch(pretrain, "get_dataset_provider", providers.with_sample_ids(pretrain.get_dataset_provider))
        else:
            dataset = providers.synthetic_dataset(job.data.seed, job.model, on_cpu)
        pretrain.pretrain(config.container(job, model, dataset, on_cpu),
                          providers.forward_step(hooks.micro_batch))
    finally:
        faults.uninstall()  # the hooks' patches and the gather recorder's
        initialize.destroy_global_state()  # Bridge's and megatron-core's globals: the next side starts afresh
        compat.reset_gtp_state()


class _BridgeHooks(_Hooks):
    """The mlm backend's hooks, called from Bridge's ``train_step`` (its own signature)."""

    def bridge_train_step(self, original):
        def train_step(forward_step_func, data_iterator, model, optimizer, scheduler, global_state, *args,
                       **kwargs):
            def call(*_, iteration=None, **__):
                return original(forward_step_func, data_iterator, model, optimizer, scheduler, global_state,
                                *args, **kwargs)

            # Bridge counts its steps in train_state.step (0 before the first).
            return self.train_step(call)(forward_step_func, data_iterator, model, optimizer,
                                         iteration=global_state.train_state.step)

        return train_step
