"""The project's providers for ``megatron.training.pretrain``: model, datasets, forward step.

They play the part of Megatron-LM's ``pretrain_gpt.py`` / ``gpt_builders.py`` for the GPT the
harness builds (local layers, learned absolute positions, no bias), written for the harness:
the model provider loads the canonical weights after construction; the dataset provider
serves the harness's synthetic samples by global sample id, or Megatron-LM's mock dataset;
every item carries its global sample id so the trace can align samples across sides.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch


class IdDataset(torch.utils.data.Dataset):
    """Items of ``inner`` (a map-style dataset of dicts) with their global sample id: item
    ``idx`` is sample ``start + idx``. ``split``: megatron-core's ``Split`` it serves (the
    loader then takes the eval batch sizes for the validation split), or None."""

    def __init__(self, inner, length: int, start: int = 0, split=None):
        self.inner, self.length, self.start = inner, length, start
        if split is not None:
            self.split = split

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> dict:
        return {**self.inner[self.start + idx], "sample_id": torch.tensor(self.start + idx)}


class SyntheticDataset:
    """The harness's synthetic sample ``idx`` as Megatron-LM's GPT datasets shape an item."""

    def __init__(self, seed: int, model):
        self.seed, self.model = seed, model

    def __getitem__(self, idx: int) -> dict:
        from harness.backends.data import batch

        tokens, labels = batch(self.seed, [idx], self.model)
        return {"tokens": tokens[0], "labels": labels[0], "loss_mask": torch.ones(tokens.shape[1])}


def dataset_provider(synthetic: Callable[[], SyntheticDataset] | None):
    """``pretrain``'s train/valid/test dataset provider: synthetic samples, or (None)
    Megatron-LM's mock GPT dataset built as its ``--mock-data`` run builds it."""

    def provider(train_val_test_num_samples, vp_stage=None):
        from megatron.core.datasets.utils import Split

        n_train, n_valid = train_val_test_num_samples[0], train_val_test_num_samples[1] or 0
        if synthetic is not None:
            # The validation split: the samples after the training ones (harness.backends.evaluation).
            valid = IdDataset(synthetic(), n_valid, start=n_train, split=Split.valid) if n_valid else None
            return IdDataset(synthetic(), n_train), valid, None
        train = _mock_train(train_val_test_num_samples)
        return IdDataset(train, len(train)), None, None

    # Every rank builds its own loader (the samples are deterministic), where pretrain_gpt.py
    # builds it on TP rank 0 and broadcasts the batch over TP: the same values.
    provider.is_distributed = True
    return provider


def _mock_train(num_samples):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer

    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=None, blend_per_split=None,
        split="1,0,0", path_to_cache=None, tokenizer=get_tokenizer(), reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
            mid_level_dataset_surplus=0.005,
    )
    train, _, _ = BlendedMegatronDatasetBuilder(MockGPTDataset, num_samples, lambda: True, config).build()
    return train


def model_provider(after_build: Callable[[torch.nn.Module], None]):
    """``pretrain``'s model provider: megatron-core's GPTModel with the local layer spec from
    Megatron-LM's arguments, then ``after_build(model)`` (the canonical weights)."""

    def provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.training import get_args
        from megatron.training.arguments import core_transformer_config_from_args

        args = get_args()
        if args.transformer_impl != "local":
            raise ValueError("the harness's model provider builds the local layers: --transformer-impl local")
        config = config or core_transformer_config_from_args(args)
        model = GPTModel(
            config=config, transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm),
            vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
            pre_process=pre_process, post_process=post_process, parallel_output=True,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
            rotary_base=args.rotary_base, vp_stage=vp_stage, pg_collection=pg_collection,
        )
        after_build(model)
        return model

    return provider


def loss_func(on_loss: Callable[[float, float], None], loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Token-summed loss, token count, and the (sum, count) pair train_step (and evaluate)
    reduces and logs; ``on_loss`` is told the token mean and the count."""
    loss = torch.sum(output_tensor.float() * loss_mask)
    num_tokens = loss_mask.sum().to(torch.int)
    on_loss((loss / num_tokens).item(), float(num_tokens))
    return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.float().view(1)])}


def forward_step(on_batch: Callable[[list[int]], Callable[[float, float], None]], seq_length: int):
    """``pretrain``'s forward step: the GPT on the next micro-batch (causal mask, positions
    0..s-1); ``on_batch(sample_ids)`` is told of each micro-batch and returns its loss hook."""
    mask = torch.triu(torch.ones(1, 1, seq_length, seq_length, dtype=torch.bool), 1)
    positions = torch.arange(seq_length)[None]

    def step(data_iterator, model, return_schedule_plan=False):
        item = next(data_iterator)
        tokens, labels = item["tokens"], item["labels"]
        on_loss = on_batch(item["sample_id"].tolist())
        out = model(tokens, positions.expand(tokens.shape[0], -1), mask, labels=labels)
        return out, partial(loss_func, on_loss, item["loss_mask"].float())

    return step
