#!/usr/bin/env bash
# The main job: set up, run the default scenario matrix (megatron-core GTP) and the FP8/FP4
# matrix (emulated recipes) on CPU; reports/index.html and reports/fp8/index.html.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit $?
.venv/bin/gtp-parity matrix scenarios/default.toml --out runs/default --report reports "$@"
main=$?
.venv/bin/gtp-parity matrix scenarios/fp8.toml --out runs/fp8 --report reports/fp8 "$@"
fp8=$?
exit $(( main > fp8 ? main : fp8 ))
