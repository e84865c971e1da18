"""The scenario's policies: what each rank captures (``[capture]``), how tensors are judged
(``[compare]``) and the divergence a scenario is known to show (``[expect]``). Part of the
schema (:mod:`harness.scenario.schema` re-exports them); nothing here imports torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

CaptureKind = Literal["input", "activation", "logits", "loss", "param", "main_grad", "optimizer", "scalar"]
CaptureMode = Literal["full", "fingerprint"]
PolicyName = Literal["exact", "dtype", "noise-floor"]
Expected = Literal["known-divergence"]

CAPTURE_KINDS = frozenset(get_args(CaptureKind))
CAPTURE_MODES = frozenset(get_args(CaptureMode))
POLICIES = frozenset(get_args(PolicyName))


@dataclass(frozen=True, kw_only=True, slots=True)
class CapturePolicy:
    """What each rank records into its trace."""

    kinds: tuple[CaptureKind, ...] = tuple(sorted(CAPTURE_KINDS))
    """Kinds to capture: input, activation, logits, loss, param, main_grad, optimizer, scalar."""
    tensors: tuple[str, ...] = ("*",)
    """fnmatch patterns over canonical names."""
    steps: tuple[int, ...] | None = None
    """Steps to capture (1-based); None captures every step."""
    mode: CaptureMode = "full"
    """``full`` stores tensors; ``fingerprint`` stores statistics, a hash and block checksums."""
    fingerprint_async: bool = False
    """``fingerprint``: copy each tensor on the step and fingerprint the copy in the writer
    thread (the step waits for the copy only, memory holds the queued steps' copies)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ComparePolicy:
    """How a candidate tensor is judged against the reference (see harness.compare.judge)."""

    policy: PolicyName = "noise-floor"
    k: float = 4.0
    """noise-floor: candidate error vs golden may be k x the reference's error vs golden ..."""
    floor: float = 8.0
    """... plus this absolute floor (in units of the compared dtype's eps x max|golden|)."""
    k_first_step: float | None = None
    """noise-floor: k at step 1, the one step at which both sides read the same weights and
    inputs in every precision; later steps use ``k``. None: ``k`` throughout."""
    exact_steps: tuple[int, ...] = ()
    """Steps whose tensors are judged bitwise whatever the policy (a checkpoint's load step)."""
    derived: bool = True
    """Judge a tensor by what its computation allows where a rule derives it
    (harness.compare.expectations)."""

    def k_at(self, step: int) -> float:
        return self.k_first_step if step == 1 and self.k_first_step is not None else self.k



@dataclass(frozen=True, kw_only=True, slots=True)
class KnownDivergence:
    """A divergence the scenario is known to show: megatron-core's, with its root cause.

    A matching failure is reported as ``known-divergence`` (its own verdict, never a pass, and
    no failing exit code); a scenario that passes, or fails differently, fails: the gate is on
    the divergence changing, not on it existing."""

    verdict: Expected = "known-divergence"
    reason: str = ""
    """The root cause (file:function:line), shown in the report."""
    signature: str | None = None
    """The first divergence's signature it must have (None: any)."""
    step: int | None = None
    """The step of the first divergence it must have (None: any)."""
    fixed_in: str | None = None
    """The commit that fixed it upstream (a Megatron-LM commit id): on a candidate tree whose
    history holds it (``git merge-base --is-ancestor``), parity is expected instead and its
    return reads "fixed in <commit>"."""
    fixed_in_version: str | None = None
    """The first megatron-core version holding the fix, for trees without a commit (the
    installed wheel): a tree of that version or later is expected to hold parity."""
    diverges_after_fix: str | None = None
    """The signature a tree holding the fix shows instead of parity (the fix changed it)."""
    introduced_in: str | None = None
    """The commit that brought it: a tree without it (the installed wheel too) holds parity."""
    raises: str | None = None
    """A known failure to run: the candidate raises an error whose message holds this text (no
    first divergence: ``signature`` and ``step`` stay unset); it runs in a launch of its own."""
