"""The ``torch`` backend: the harness's own GPT, golden in one process, TP x GTP x DP with
emulated FP8 / FP4 recipes on torch.distributed (entry point: ``run.run``)."""
