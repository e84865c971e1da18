"""Faults and a proposed fix on the path of a caller-supplied process-group collection
(``Side.process_groups``).

- ``pgc-grad-norm-without-gtp`` (reduction over the wrong group): the collection's model-parallel
  group ``mp`` is the TP group alone, as a collection built before GTP would hold it; the
  optimizer reduces the grad norm (and the zero count) over ``mp``, so the squares of the other
  GTP peers' shards are left out.
- ``patch-pgc-gtp-reads`` (no fault): the two places where Megatron-LM main d98e8a64dd still
  reads parallel_state's GTP group under a caller's collection, mended as repro/FINDINGS.md (J)
  proposes: GPTModel hands its ``pg_collection`` to the word embedding and the output layer
  (``gpt_model.py`` passes them ``tp_group`` only, so ``resolve_gtp_remat_group`` falls back to
  parallel_state's group), and ``param_is_not_gtp_duplicate`` (``tensor_parallel/layers.py``:
  which replicated grads the grad norm counts) takes the rank in the collection's GTP group,
  not parallel_state's. Installed before the model is built (it wraps constructors).
"""

from __future__ import annotations

import inspect

from harness.backends.patching import patch


def _grad_norm_without_gtp(ctx) -> None:
    pgc = ctx.saved.get("pg_collection")
    pgc.mp = pgc.tp  # read by get_megatron_optimizer, which is built after the faults are installed


INSTALLERS = {"pgc-grad-norm-without-gtp": _grad_norm_without_gtp}


def before_build(names, pgc) -> None:
    """The construction-time ones: installed after the collection is made, before the model."""
    if "patch-pgc-gtp-reads" in names and pgc is not None:
        _gpt_model_passes_collection(pgc)
        _gtp_duplicate_by_collection(pgc)


def _gtp_duplicate_by_collection(pgc) -> None:
    from megatron.core.tensor_parallel import layers

    patch(layers, "get_gtp_weight_remat_rank", pgc.gtp_remat.rank)


def _gpt_model_passes_collection(pgc) -> None:
    from megatron.core import tensor_parallel
    from megatron.core.models.common.embeddings import language_model_embedding as lme
    from megatron.core.models.gpt import gpt_model

    if "pg_collection" not in inspect.signature(lme.LanguageModelEmbedding.__init__).parameters:
        raise RuntimeError("patch-pgc-gtp-reads: this megatron-core's LanguageModelEmbedding takes no "
                           "pg_collection (Megatron-LM 9f3fe8c925 added it)")
    building = []  # inside GPTModel.__init__: its embedding and output layer take the collection

    def within(cls, attr):
        original = getattr(cls, attr)

        def wrapped(self, *args, **kwargs):
            if building and kwargs.get("pg_collection") is None:
                kwargs["pg_collection"] = building[-1]
            return original(self, *args, **kwargs)

        patch(cls, attr, wrapped)

    within(lme.LanguageModelEmbedding, "__init__")
    within(tensor_parallel.ColumnParallelLinear, "__init__")
    build = gpt_model.GPTModel.__init__

    def gpt_init(self, *args, **kwargs):
        building.append(kwargs.get("pg_collection") or pgc)
        try:
            return build(self, *args, **kwargs)
        finally:
            building.pop()

    patch(gpt_model.GPTModel, "__init__", gpt_init)
