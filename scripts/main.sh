#!/usr/bin/env bash
# The main job: set up, run the default scenario matrix on CPU, write reports/index.html.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/gtp-parity matrix scenarios/default.toml --out runs/default --report reports "$@"
