"""The pytest plugins, xdist-style: the hooks of ``gtp_parity`` in :mod:`.plugin` (its entry
point), the rest beside it: scenarios and the ``parity`` fixture (:mod:`.runs`),
``--parity-matrix`` (:mod:`.matrix`), torchrun rank agreement (:mod:`.ranks`), options and
their ini twins (:mod:`.options`), and the conformance kit's plugin (:mod:`.conformance`,
:mod:`.conformance_session`)."""
