"""The configured linter runs: ruff (pyproject.toml's [tool.ruff]) passes on the project's Python,
and no marker switches a formatter or a whole line's checks off."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.helpers import ROOT

# Blanket markers: a formatter switched off, or every check of a line (a bare noqa) silenced.
BLANKET = re.compile(r"#\s*(fmt:\s*(skip|off)|noqa(?!:))")


def test_ruff_passes():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_no_blanket_markers():
    folders = ("harness", "gtp_parity", "repro", "benchmarks", "scripts", "tests")
    found = [f"{p.relative_to(ROOT)}:{i}" for folder in folders for p in sorted((ROOT / folder).rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if BLANKET.search(line)]
    assert not found, f"blanket markers: {found[:10]}"
