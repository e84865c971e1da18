"""gtp-parity's public API: what a script of one's own imports, from one place that holds still
while the harness's modules move (docs/capture-api.md, "Public API").

- capture, from any training loop: :class:`Capture` and what it keeps, :class:`CapturePolicy`;
- placements, DTensor's vocabulary: :class:`Layout` over ``Shard``, ``Replicate`` and
  ``Partial``, :func:`from_mcore_param` (a megatron-core parameter's layout), :func:`replicated`,
  :func:`gtp_pad`, and :func:`shard` / :func:`assemble` (a logical tensor to a rank's shard and
  back);
- traces read back: :func:`read_trace`, :class:`Trace`;
- the offline compare of two traces, in this process (no torch.distributed): :func:`compare`,
  judged under a :class:`ComparePolicy`, into a :class:`ScenarioSummary` (its :class:`Verdict`
  and :class:`FirstDivergence`);
- :class:`BadInput`, raised with the file and what is wrong for a trace that cannot be read.

A facade only: each name is the harness's own object, re-exported; nothing of the harness
imports this package.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from torch.distributed.tensor import Partial, Replicate, Shard

from harness.capture.api import Capture
from harness.capture.trace import Trace
from harness.capture.trace import read as read_trace
from harness.common.errors import BadInput
from harness.common.layout import Layout, assemble, from_mcore_param, gtp_pad, replicated, shard
from harness.compare.summary import FirstDivergence, ScenarioSummary, Verdict
from harness.scenario import CapturePolicy, ComparePolicy, Role

__all__ = [
    "BadInput", "Capture", "CapturePolicy", "ComparePolicy", "FirstDivergence", "Layout", "Partial",
    "Replicate", "ScenarioSummary", "Shard", "Trace", "Verdict", "assemble", "compare", "from_mcore_param",
    "gtp_pad", "read_trace", "replicated", "shard",
]


def compare(reference: str | Path, candidate: str | Path, out: str | Path, *,
            golden: str | Path | None = None, policy: ComparePolicy | None = None, verify: bool = True,
            jobs: int = 1, say: Callable[[str], object] = print) -> ScenarioSummary:
    """Compare two complete traces (and a golden's, when given) as ``gtp-parity compare`` does,
    in this process: write ``steps.csv``, ``results.csv`` and ``summary.json`` into ``out`` and
    return the summary. ``policy``: the default noise floor unless given; ``verify``: check each
    tensor against its recorded content hash; ``jobs``: compare processes; ``say``: where the
    step table and the verdict line go."""
    from harness.compare.outcome import compare_scenario  # the compare's modules load on first use

    paths = {Role.REFERENCE: Path(reference), Role.CANDIDATE: Path(candidate),
             Role.GOLDEN: Path(golden) if golden is not None else None}
    return compare_scenario(None, paths, Path(out), say, policy=policy, verify=verify, jobs=jobs)
