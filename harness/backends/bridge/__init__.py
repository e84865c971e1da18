"""The ``bridge`` backend: Megatron-Bridge's own training loop (``megatron.bridge.training.pretrain``)."""
