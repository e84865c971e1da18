#!/usr/bin/env bash
# The test suite: set up if needed, then pytest on two workers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -n 2 --dist loadfile "$@"
