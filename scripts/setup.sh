#!/usr/bin/env bash
# Create .venv with Python 3.12 and install the project with its test extras. Idempotent: a
# stamp of pyproject.toml's hash skips the install when nothing changed.
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
