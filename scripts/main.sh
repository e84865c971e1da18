#!/usr/bin/env bash
# The main job: set up, run the default scenario matrix (megatron-core GTP), the FP8/FP4
# matrix (emulated recipes), GTP's other code paths, GTP with the features users turn on
# alongside it and the architectures they train, on CPU; reports/index.html,
# reports/fp8/index.html, reports/paths/index.html, reports/features/index.html and
# reports/architectures/index.html.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit $?
.venv/bin/gtp-parity matrix scenarios/default.toml --out runs/default --report reports "$@"
main=$?
.venv/bin/gtp-parity matrix scenarios/fp8.toml --out runs/fp8 --report reports/fp8 "$@"
fp8=$?
.venv/bin/gtp-parity matrix scenarios/gtp_paths.toml --out runs/paths --report reports/paths "$@"
paths=$?
.venv/bin/gtp-parity matrix scenarios/features.toml --out runs/features --report reports/features "$@"
features=$?
.venv/bin/gtp-parity matrix scenarios/architectures.toml --out runs/architectures --report reports/architectures "$@"
architectures=$?
worst=0
for code in $main $fp8 $paths $features $architectures; do worst=$(( code > worst ? code : worst )); done
exit $worst
