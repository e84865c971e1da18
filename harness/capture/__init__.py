"""Stage 2, capture: what a rank records (:class:`Capture`, the API every backend's loop and a
user's own loop call) and the on-disk trace it writes (:class:`Trace`, read back by
:func:`read`). Fingerprint mode's record of a tensor is :mod:`.fingerprint`.

The trace format comes before the run stage because the launcher reads the trace folders'
state (complete, interrupted) to reuse and diagnose them."""

from harness.capture.api import Capture
from harness.capture.trace import Trace, is_complete, read

__all__ = ["Capture", "Trace", "is_complete", "read"]
