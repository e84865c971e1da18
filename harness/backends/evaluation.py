"""Evaluation between training steps, as Megatron-LM's ``train()`` runs it: when, on which
samples, and what a rank records.

When: after every ``eval_interval``-th step, and once more after the last step
(``pretrain``'s final validation), each evaluation ``eval_iters`` forward-only iterations of
one global batch (Megatron-LM's ``eval_global_batch_size`` default). Which samples: the
validation split, read in order by the training sampler's rule (data rank ``d`` takes its
micro-batch slice of each chunk of ``micro_batch_size x data ranks`` samples), one iterator
across evaluations. The harness's validation split is the synthetic samples after the
training ones: validation sample ``i`` is global sample ``steps x global_batch_size + i``, so
every side and the golden read the same samples.

Recorded per rank, as scalars of the step whose weights the evaluation read, tagged with the
evaluation's index (``eval``) in run order:

- ``eval_sample_loss``: each micro-batch's token-mean loss, with its sample ids, tokens,
  iteration and micro-batch;
- ``eval_loss``: the loss the evaluation reports (what Megatron-LM's ``evaluate()`` returns
  and prints): the token-weighted mean over the samples of the group it reduces over.
"""

from __future__ import annotations

from harness.capture.api import Capture
from harness.common.mesh import Mesh
from harness.scenario.schema import DataConfig, Side

SAMPLE, REPORTED = "eval_sample_loss", "eval_loss"


def eval_points(side: Side) -> list[int]:
    """The step after which each evaluation runs, in run order (a step may repeat: the final
    validation follows an interval's evaluation at the last step)."""
    if side.eval_interval <= 0:
        return []
    return [*range(side.eval_interval, side.steps + 1, side.eval_interval), side.steps]


def valid_start(side: Side, data: DataConfig) -> int:
    """Global sample id of validation sample 0: the first after the training samples."""
    return side.steps * data.global_batch_size


def eval_sample_ids(index: int, iteration: int, side: Side, data: DataConfig) -> list[int]:
    """Global sample ids of iteration ``iteration`` of evaluation ``index`` (one global batch)."""
    start = valid_start(side, data) + (index * side.eval_iters + iteration) * data.global_batch_size
    return list(range(start, start + data.global_batch_size))


def rank_eval_sample_ids(index: int, iteration: int, rank: int, side: Side,
                         data: DataConfig) -> list[list[int]]:
    """Sample ids ``rank`` reads in that iteration, one list per micro-batch."""
    ids, mbs, d = eval_sample_ids(index, iteration, side, data), data.micro_batch_size, side.data_ranks
    data_rank = Mesh.of_side(side).data_rank(rank)
    return [ids[m * mbs * d + data_rank * mbs:][:mbs] for m in range(side.num_microbatches(data))]


class EvalRecorder:
    """What one rank records of its evaluations (see the module docstring)."""

    def __init__(self, cap: Capture):
        self.cap = cap
        self.index = -1

    def begin(self) -> int:
        """The next evaluation starts; returns its index."""
        self.index += 1
        return self.index

    def sample(self, value: float, sample_ids: list[int], tokens: float, iteration: int,
               micro_batch: int) -> None:
        self.cap.scalar(SAMPLE, value, eval=self.index, iteration=iteration, micro_batch=micro_batch,
                        sample_ids=[int(i) for i in sample_ids], tokens=float(tokens))

    def report(self, value: float) -> None:
        self.cap.scalar(REPORTED, value, eval=self.index)
