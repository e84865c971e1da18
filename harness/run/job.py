"""A job: one side of one scenario as a rank runs it, and its JSON wire format.

The launcher writes a launch's jobs into a plan file (:func:`Job.to_json`); every rank reads
them back (:func:`Job.from_json`). Nothing pickled crosses the process boundary.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from harness.scenario import CapturePolicy, DataConfig, ModelConfig, Side


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
    """What computes this side (:func:`harness.run.provenance.code_identity`), part of its key."""
    checkpoint_dir: str = ""
    """Where a saving side writes its checkpoint, or a resuming side reads it ("": neither)."""
    megatron_root: str = ""
    """The folder holding the side's megatron-core tree, first on its ranks' PYTHONPATH
    ("": the installed one; :mod:`harness.run.trees`)."""
    lines: tuple[str, ...] = ()
    """Modules whose executed lines the side records beside its trace (a mutation campaign's clean
    sides); not part of the key: it changes what is recorded, not what is computed."""

    def to_json(self) -> dict:
        return {
            "key": self.key,
            "model": asdict(self.model),
            "data": asdict(self.data),
            "side": asdict(self.side),
            "capture": asdict(self.capture),
            "trace_dir": self.trace_dir,
            "provenance": self.provenance,
            "checkpoint_dir": self.checkpoint_dir,
            "megatron_root": self.megatron_root,
            "lines": list(self.lines),
        }

    @classmethod
    def from_json(cls, doc: dict) -> Job:
        side = dict(doc["side"])
        side["inject"] = tuple(side.get("inject", ()))
        side["args"] = tuple(side.get("args", ()))
        capture = dict(doc["capture"])
        capture["kinds"] = tuple(capture["kinds"])
        capture["tensors"] = tuple(capture["tensors"])
        capture["steps"] = tuple(capture["steps"]) if capture.get("steps") is not None else None
        return cls(
            key=doc["key"],
            model=ModelConfig(**doc["model"]),
            data=DataConfig(**doc["data"]),
            side=Side(**side),
            capture=CapturePolicy(**capture),
            trace_dir=doc["trace_dir"],
            provenance=doc.get("provenance", {}),
            checkpoint_dir=doc.get("checkpoint_dir", ""),
            megatron_root=doc.get("megatron_root", ""),
            lines=tuple(doc.get("lines", ())),
        )
