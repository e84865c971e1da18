"""Conformance kit for Transformer Engine's DistributedWeight protocol.

The kit checks, rank by rank and numerically, that a weight implementing the protocol does what
TE's modules rely on: forward and backward materialization return the logical weights bitwise,
``finalize_group_grads`` leaves exactly this rank's rows of the GTP-group mean (or sum) in
``main_grad``, in place (pad rows zero, accumulating over micro-batches), one leader call serves a
whole group, and the prefetch chain / async reduction change nothing. See
:data:`harness.conformance.registry.CLAUSES` for the clause list.

Every clause is driven through TE's own dispatchers: the pinned release's
``transformer_engine/pytorch/distributed_weight.py`` (TE 2.20.2), which set-up fetches from the
registry's wheel, hash-checks and caches outside site-packages (TE itself is never installed),
loaded on its own. Where that file was never fetched the kit runs on its mirror of it and says
so. The report names the file and its sha256, which clauses went through a dispatcher, what only
TE's modules (CUDA and the TE torch extension) would exercise, and where TE's code corrected the
kit's earlier reading of the contract.

Modules: :mod:`.layout` (shard layout, seeded data), :mod:`.protocol` (dispatchers, collective
recorder), :mod:`.te_source` (fetching, verifying and loading TE's file), :mod:`.te_contract`
(TE's side: the dispatcher probes, routes, disagreements, coverage), :mod:`.drive` (cases, the
protocol walk), :mod:`.clauses` and :mod:`.te_clauses` (the checks), :mod:`.kit` (all ranks,
merged results, JSON), :mod:`.worker` (torchrun entry), :mod:`.cli` (``gtp-parity
conformance``), :mod:`.pytest_plugin`, :mod:`.reference` (known-good and faulty implementers)
and :mod:`.mcore` (megatron-core's ``GTPShardedParam``).

Factory contract
----------------
An implementer is named ``module:factory``. The kit creates the logical weights itself (seeded,
identical on every rank of a TP slot) and calls, on every rank::

    factory(
        logical_weights=[...],   # full TP-local weights, forward order, group members adjacent
        shapes=[...],            # their shapes
        dtype=torch.bfloat16,    # parameter dtype (logical_weights already have it)
        main_grad_dtype=torch.float32,
        tp_group=..., gtp_group=...,  # torch.distributed groups built by the kit
        pad_for_alignment=16,    # pad dim 0 to a multiple of this times G (0: no padding)
        per_token_loss=False,    # True: finalize sums over the GTP group instead of averaging
        overlap=True,            # prefetch chain and async reduction on (False: both off)
        group_size=1,            # weights per protocol group (N for a GroupedLinear)
    ) -> list[weight]

Accept ``**kwargs`` to stay compatible with new keywords. Return one weight per logical weight,
same order; the first of each group is the leader. Each weight must

- be a ``torch.Tensor`` subclass with ``is_distributed_weight = True`` whose own data is this
  rank's shard: rows ``[g*S, (g+1)*S)`` of the logical weight zero-padded at the tail of dim 0
  (the kit updates shards in place through ``weight.data`` to emulate an optimizer step);
- carry a zero ``main_grad`` of the shard's shape and ``main_grad_dtype``, and update that very
  tensor in place (TE's grouped ops discard ``finalize_group_grads``' return);
- for TE's fused grouped MLP (``group_size > 1``): carry a truthy ``is_routed_expert`` and, on
  the leader, a ``weight_list`` that is not None (attributes outside the protocol that
  ``ops/fused/grouped_mlp.py`` asserts on).

The kit calls the dispatchers as TE's modules do: a bare weight for a group of one (Linear,
LayerNormLinear), the group's list otherwise (GroupedLinear).

Optional attributes on the factory: ``drain()`` (called after each backward walk, e.g. to wait
for async reductions) and ``cases(tp, gtp) -> list[Case]`` (narrows the case matrix). Raise
:class:`harness.conformance.drive.Unsupported` for a case the implementer does not support; it
is reported as skipped with the message as reason.
"""
