"""Backends: the implementations under test. Each has ``run(job, capture)`` training one side
on the calling rank (the process group is already initialized) and recording into ``capture``."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from harness.capture import Capture
from harness.scenario import CapturePolicy, DataConfig, ModelConfig, Side

BACKENDS = {"megatron": "harness.backends.megatron.run", "torch": "harness.backends.torch.run",
            "mlm": "harness.backends.mlm.run"}


@dataclass(frozen=True, kw_only=True)
class Job:
    """One side of one scenario, as a worker runs it."""

    key: str
    model: ModelConfig
    data: DataConfig
    side: Side
    capture: CapturePolicy
    trace_dir: str
    provenance: dict = field(default_factory=dict)
    """What computes this side (:func:`harness.provenance.code_identity`), part of its key."""
    checkpoint_dir: str = ""
    """Where a saving side writes its checkpoint, or a resuming side reads it ("": neither)."""


def run(job: Job, capture: Capture) -> None:
    importlib.import_module(BACKENDS[job.side.backend]).run(job, capture)
