"""GPTModel(parallel_output=False) with labels: the loss megatron-core computes from gathered logits
(gloo, CPU, no GTP, one forward and backward of megatron-core's tiny GPT, local spec).

- TP 1, fp32: the output layer's gather over one rank hands its input back as-is
  (tensor_parallel/mappings.py, _GatherFromModelParallelRegion), vocab_parallel_cross_entropy
  turns the logits into the softmax in place and saves them; the backward's ``ctx.saved_tensors``
  (cross_entropy.py l.190) raises: a custom Function's view modified in place.
- TP 2: vocab_parallel_cross_entropy runs over the TP group on the gathered logits: each rank takes
  the whole vocabulary for its partition, the softmax denominator is summed over TP: the loss is
  parallel_output=True's plus log 2.

    python repro/gpt_parallel_output_loss.py
"""

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402


def _loss(rank, world, parallel_output):
    """Per-token losses' sum of one forward, and the backward's error if it raised."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    model_parallel_cuda_manual_seed(c.SEED)
    torch.manual_seed(c.SEED)
    config = TransformerConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                               tensor_model_parallel_size=world, use_cpu_initialization=True,
                               hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
                               gradient_accumulation_fusion=False, init_method_std=0.05)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                     max_sequence_length=8, parallel_output=parallel_output)
    gen = torch.Generator().manual_seed(c.SEED)
    tokens = torch.randint(0, 64, (1, 9), generator=gen)
    pos = torch.arange(8).unsqueeze(0)
    losses = model(tokens[:, :-1], pos, None, labels=tokens[:, 1:])
    error = None
    try:
        losses.sum().backward()
    except RuntimeError as e:
        error = str(e).split(".")[0]
    ps.destroy_model_parallel()
    return {"loss": float(losses.sum()), "tokens": losses.numel(), "backward_error": error}


def _both(rank, world):
    return {str(po): _loss(rank, world, po) for po in (True, False)}


def main():
    for world in (1, 2):
        r = c.spawn(_both, world)[0]
        on, off = r["True"], r["False"]
        offset = (off["loss"] - on["loss"]) / on["tokens"]
        print(f"TP {world}: mean loss parallel_output=True {on['loss'] / on['tokens']:.6f}, "
              f"False {off['loss'] / off['tokens']:.6f} (difference {offset:.6f}; "
              f"log TP = {math.log(world):.6f}); "
              f"backward with False: {off['backward_error'] or 'ran'}")


if __name__ == "__main__":
    main()
