#!/usr/bin/env bash
# The test suite: set up if needed, then pytest on two workers. `--fast`: the unit tier only
# (no torchrun launches, no slow single-process tests); other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
tier=()
if [ "${1:-}" = "--fast" ]; then
    shift
    tier=(-m "not multirank and not slow")
fi
exec .venv/bin/python -m pytest -n 2 --dist loadfile "${tier[@]}" "$@"
