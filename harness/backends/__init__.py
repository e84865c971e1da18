"""Backends: the implementations under test. Each has ``run(job, capture)`` training one side
on the calling rank (the process group is already initialized) and recording into ``capture``."""

from __future__ import annotations

import importlib

from harness.capture.api import Capture
from harness.run.job import Job

BACKENDS = {"megatron": "harness.backends.megatron.run", "torch": "harness.backends.torch.run",
            "mlm": "harness.backends.mlm.run", "bridge": "harness.backends.bridge.run"}


def run(job: Job, capture: Capture) -> None:
    importlib.import_module(BACKENDS[job.side.backend]).run(job, capture)
