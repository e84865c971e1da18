"""One compare process of ``gtp-parity compare --jobs N`` (see :mod:`harness.compare.split`).

    python -m harness.compare SPEC PART RESULT
"""

from __future__ import annotations

import sys

from harness.compare.judge import part_of
from harness.compare.split import run_process

if __name__ == "__main__":
    sys.exit(run_process(sys.argv[1:], part_of))
