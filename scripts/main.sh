#!/usr/bin/env bash
# The main job: set up, run the default scenario matrix (megatron-core GTP), the FP8/FP4
# matrix (emulated recipes) and GTP's other code paths on CPU; reports/index.html,
# reports/fp8/index.html and reports/paths/index.html.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit $?
.venv/bin/gtp-parity matrix scenarios/default.toml --out runs/default --report reports "$@"
main=$?
.venv/bin/gtp-parity matrix scenarios/fp8.toml --out runs/fp8 --report reports/fp8 "$@"
fp8=$?
.venv/bin/gtp-parity matrix scenarios/gtp_paths.toml --out runs/paths --report reports/paths "$@"
paths=$?
worst=$(( main > fp8 ? main : fp8 ))
exit $(( worst > paths ? worst : paths ))
