#!/usr/bin/env bash
# Create .venv with Python 3.12, install the project with its test extras, and cache TE's
# distributed_weight.py for the conformance kit. Idempotent: a stamp of pyproject.toml's hash
# skips the install when nothing changed, and a cached, hash-verified TE file skips the download.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
    for cand in python3.12 "$(command -v pyenv >/dev/null && echo "$(pyenv root)/versions/3.12"*/bin/python3.12)"; do
        for py in $cand; do
            if [ -x "$(command -v "$py" 2>/dev/null || echo "$py")" ] && "$py" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
                echo "$py"; return 0
            fi
        done
    done
    for py in /usr/bin/python3.12 /usr/local/bin/python3.12 /root/.pyenv/versions/3.12*/bin/python3.12; do
        if [ -x "$py" ]; then echo "$py"; return 0; fi
    done
    echo "gtp-parity: Python 3.12 not found (megatron-core >= 0.17 needs it)" >&2
    return 1
}

if [ ! -x .venv/bin/python ]; then
    "$(find_python)" -m venv .venv
fi
stamp=.venv/.gtp-parity-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    .venv/bin/python -m pip install --quiet -e '.[test]'
    echo "$want" > "$stamp"
fi

# --bridge (or GTP_PARITY_BRIDGE=1): the bridge backend's import set (the `bridge` extra) and
# Megatron-Bridge itself, without its declared dependencies (CUDA-only wheels, none imported).
# A stamp of its own: the default set-up stays as it was; re-run only when pyproject changes.
if [ "${1:-}" = "--bridge" ] || [ "${GTP_PARITY_BRIDGE:-0}" = "1" ]; then
    bridge_stamp=.venv/.gtp-parity-bridge-installed
    if [ "$(cat "$bridge_stamp" 2>/dev/null)" != "$want" ]; then
        .venv/bin/python -m pip install --quiet -e '.[test,bridge]'
        .venv/bin/python -m pip install --quiet --no-deps megatron-bridge==0.6.2
        echo "$want" > "$bridge_stamp"
    fi
fi

# Transformer Engine's distributed_weight.py for the conformance kit: the pinned wheel's one file,
# hash-checked, into ~/.cache/gtp-parity (never installed; a partial TE breaks megatron.core).
# Cached and verified means no network. A failed download leaves the kit on its own mirror of
# TE's dispatchers (it says so); a hash that does not match the pin fails the set-up.
te_status=0
.venv/bin/python -m harness.conformance.te_source || te_status=$?
if [ "$te_status" -eq 1 ]; then
    echo "gtp-parity: TE's distributed_weight.py not fetched; the conformance kit runs on its mirror" >&2
elif [ "$te_status" -ne 0 ]; then
    exit "$te_status"
fi
