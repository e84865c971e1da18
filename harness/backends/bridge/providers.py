"""The project's providers for Megatron-Bridge's ``pretrain``: model, datasets, forward step.

- The model: Bridge's own ``GPTModelProvider`` with the harness's GPT (:mod:`.config`), its
  ``provide`` followed by the canonical weights (:func:`model_provider`), as the mlm backend's
  model provider loads them after construction.
- The data: a Bridge ``DatasetProvider`` serving the harness's synthetic samples by global
  sample id (the mlm backend's :class:`~harness.backends.mlm.providers.SyntheticDataset`), or
  Bridge's own mock data; every item carries its id, which Bridge's ``get_batch`` drops and the
  forward step reads.
- The forward step: Bridge's own ``gpt_step.forward_step`` and its loss function
  (``masked_next_token_loss``), unchanged, with the data iterator tapped for each
  micro-batch's sample ids and the loss function for its loss.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from harness.backends.mlm.providers import IdDataset, SyntheticDataset


def model_provider(fields: dict, after_build: Callable[[torch.nn.Module], None]):
    """A ``GPTModelProvider`` with ``fields``, the local layer spec, and ``after_build`` called
    on each GPTModel it provides (before Bridge wraps it in Float16Module and DDP)."""
    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    @dataclasses.dataclass
    class HarnessGPTProvider(GPTModelProvider):
        def provide(self, pre_process=None, post_process=None, vp_stage=None):
            model = super().provide(pre_process, post_process, vp_stage)
            after_build(model)
            return model

    def spec(config):  # with qk_layernorm its q_layernorm / k_layernorm, as the megatron backend's
        return get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm)

    return HarnessGPTProvider(transformer_layer_spec=spec, **fields)


def synthetic_dataset(seed: int, model, on_cpu: bool):
    """Bridge's ``DatasetProvider`` of the harness's synthetic samples (built on every rank)."""
    from megatron.bridge.data.base import DatasetProvider

    @dataclasses.dataclass(kw_only=True)
    class SyntheticSamples(DatasetProvider):
        seq_length: int = model.seq_length

        def build_datasets(self, context):
            return IdDataset(_WithPositions(SyntheticDataset(seed, model)), context.train_samples), None, None

    return SyntheticSamples(dataloader_type="single", num_workers=0, pin_memory=not on_cpu,
                            persistent_workers=False)


def mock_dataset(seed: int, model, on_cpu: bool):
    """Bridge's own mock data (``MockGPTDatasetConfig``, as the PR's GTP test configures it),
    built by Bridge's dataset provider; :func:`with_sample_ids` adds each item's id."""
    from megatron.bridge.training.config import MockGPTDatasetConfig

    return MockGPTDatasetConfig(
        random_seed=seed, seq_length=model.seq_length, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, dataloader_type="single", num_workers=0, pin_memory=not on_cpu,
            persistent_workers=False,
    )


def with_sample_ids(get_dataset_provider):
    """Bridge's ``get_dataset_provider``, its train dataset's items given their global sample id."""

    def get(config):
        provider = get_dataset_provider(config)

        @functools.wraps(provider)  # Bridge reads the provider's signature
        def provide(*args, **kwargs):
            train, valid, test = provider(*args, **kwargs)
            return (IdDataset(train, len(train)) if train is not None else None), valid, test

        return provide

    return get


class _WithPositions:
    """A synthetic item with the ``position_ids`` Bridge's ``get_batch`` reads (0..s-1)."""

    def __init__(self, inner: SyntheticDataset):
        self.inner = inner

    def __getitem__(self, idx: int) -> dict:
        item = self.inner[idx]
        return {**item, "position_ids": torch.arange(item["tokens"].shape[0])}


class _Tap:
    """The data iterator, telling ``on_batch`` each item's sample ids as Bridge draws it."""

    def __init__(self, inner, on_batch: Callable[[list[int]], Callable[[float, float], None]]):
        self.inner, self.on_batch, self.on_loss = inner, on_batch, None

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self.inner)
        self.on_loss = self.on_batch(item["sample_id"].reshape(-1).tolist())
        return item


def forward_step(on_batch: Callable[[list[int]], Callable[[float, float], None]]):
    """Bridge's ``gpt_step.forward_step``, its micro-batches' sample ids and losses recorded."""
    from megatron.bridge.training.gpt_step import forward_step as bridge_forward_step

    def step(state, data_iterator, model, return_schedule_plan: bool = False):
        tap = _Tap(data_iterator, on_batch)
        output, loss_function = bridge_forward_step(state, tap, model, return_schedule_plan)
        on_loss = tap.on_loss

        def loss_func(output_tensor, *args, **kwargs):
            out = loss_function(output_tensor, *args, **kwargs)
            on_loss((out[0] / out[1]).item(), float(out[1]))  # token-summed loss / token count, the count
            return out

        return output, loss_func

    return step
