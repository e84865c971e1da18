"""The ``mlm`` backend: Megatron-LM's own training loop (``megatron.training.pretrain``)."""
