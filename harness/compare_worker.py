"""One worker process of ``gtp-parity compare --jobs N`` (see :mod:`harness.parallel`).

    python -m harness.compare_worker SPEC PART RESULT
"""

from __future__ import annotations

import sys

from harness.compare import part_of
from harness.parallel import run_worker

if __name__ == "__main__":
    sys.exit(run_worker(sys.argv[1:], part_of))
