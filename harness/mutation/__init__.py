"""Mutation campaign over megatron-core's GTP code: how much of a broken GTP does a matrix see?

Mutants are made of the installed source with operators that model real bugs
(:mod:`harness.scenario.mutants`: a side names one by id) and applied in a worker at run time
(:mod:`harness.backends.faults.mutant`: installed files are never edited); :mod:`.campaign` runs
them against a matrix and scores the harness, :mod:`.page` draws it, :mod:`.command` is
``gtp-parity mutate``; :file:`triage.toml` records the survivors no scenario can kill.
"""
