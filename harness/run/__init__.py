"""Stage 3, run: sides become :class:`Job` s (:mod:`.plan`: one per distinct side, keyed by its
configuration and code identity, :mod:`.provenance`), grouped into launches by world size and
started under torchrun (:mod:`.launch`: per-side timeouts, crash and hang diagnosis naming the
rank and step), here or, one node's share at a time, over several nodes (:mod:`.nodes`: c10d
rendezvous, SLURM's variables). Each rank runs ``python -m harness.backends.worker PLAN``."""

from harness.run.job import Job

__all__ = ["Job"]
