"""Test configuration shared by the whole suite."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
# Ranks and tests share two cores: one thread each keeps runs deterministic and fast.
os.environ.setdefault("OMP_NUM_THREADS", "1")
