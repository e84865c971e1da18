"""Mutation campaign over megatron-core's GTP code: how much of a broken GTP does a matrix see?

:mod:`.generate` makes mutants of the installed source with operators that model real bugs,
:mod:`.apply` applies one in a worker at run time (installed files are never edited),
:mod:`.campaign` runs them against a matrix and scores the harness, :mod:`.page` draws it.
"""
