"""The public API holds still: ``gtp_parity`` exports what docs/capture-api.md lists, a script
made of that page's code blocks runs, and an import of a module that moved names its new place.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gtp_parity
import harness
from test_docs import split_lines

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "capture-api.md"
NOT_RUN = "<!-- not run"
"""A comment right above a code block that cannot run on its own (it needs a model on its ranks)."""


def python_blocks(text: str) -> list[tuple[int, str, bool]]:
    """(first line, code, whether it runs) for each fenced ```python block of a page."""
    blocks, current, start, previous = [], None, 0, ""
    for line in split_lines(text):
        if current is None and line.in_code and line.text.strip() == "```python":
            current, start, runs = [], line.number, not previous.startswith(NOT_RUN)
        elif current is not None and line.in_code and line.text.strip() != "```":
            current.append(line.text)
        elif current is not None:
            blocks.append((start, "\n".join(current) + "\n", runs))
            current = None
        if line.text.strip():
            previous = line.text.strip()
    return blocks


def public_names(text: str) -> set[str]:
    """The names in the first column of the page's "Public API" table."""
    section = text.split("## Public API", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in section.splitlines() if r.startswith("| `")]
    return {name for r in rows for name in re.findall(r"`([A-Za-z_]+)`", r.split("|")[1])}


def _env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def test_block_extraction():
    text = ("# P\n```python\na = 1\n```\ntext\n<!-- not run: needs ranks -->\n```python\nrank\n```\n"
            "```bash\nls\n```\n```python\nb = a\n```\n")
    assert python_blocks(text) == [(2, "a = 1\n", True), (7, "rank\n", False), (13, "b = a\n", True)]


def test_exports_are_the_documented_names():
    documented, exported = public_names(PAGE.read_text(encoding="utf-8")), set(gtp_parity.__all__)
    assert documented == exported, ("docs/capture-api.md's Public API table and gtp_parity.__all__ differ: "
                                    f"only in the docs {sorted(documented - exported)}, "
                                    f"only in __all__ {sorted(exported - documented)}")
    missing = [n for n in gtp_parity.__all__ if not hasattr(gtp_parity, n)]
    assert not missing, f"gtp_parity.__all__ names what it does not define: {missing}"


@pytest.mark.slow
def test_a_script_from_the_docs_runs(tmp_path):
    """The page's runnable blocks, in order, as one script in an empty folder: two captures, the
    offline compare (whose verdict and signature the page states), the placements."""
    blocks = python_blocks(PAGE.read_text(encoding="utf-8"))
    runnable = [code for _, code, runs in blocks if runs]
    assert len(runnable) >= 3 and len(runnable) < len(blocks), blocks  # and the multi-rank sketch is left out
    script = tmp_path / "from_the_docs.py"
    script.write_text("\n".join(runnable), encoding="utf-8")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "fail 1 optimizer 0.bias update-term" in proc.stdout, proc.stdout[-3000:]
    summary = json.loads((tmp_path / "runs" / "compare" / "summary.json").read_text())
    fd = summary["first_divergence"]
    assert summary["verdict"] == "fail" and fd["signature"] == "update-term", fd
    assert fd["update"]["text"] == "update scaled by 0.5", fd  # the learning rate the candidate halved
    assert (tmp_path / "runs" / "compare" / "results.csv").is_file()
    assert (tmp_path / "traces" / "reference" / "manifest.json").is_file()


@pytest.mark.parametrize("old", sorted(harness.MOVED))
def test_a_moved_module_names_its_new_place(old):
    new = harness.MOVED[old]
    importlib.import_module(new)  # the table points at modules that exist
    here = (ROOT / Path(*old.split("."))).with_suffix(".py")
    assert not here.exists(), f"{old} exists again: drop it from MOVED"
    leaf = old.rsplit(".", 1)[1]
    for statement in (f"import {old}", f"from {old} import x", f"from harness import {leaf}"):
        with pytest.raises(ModuleNotFoundError) as info:
            exec(statement, {})
        assert info.value.name == old, statement
        assert new in str(info.value) and "gtp_parity" in str(info.value), (statement, str(info.value))


def test_an_unknown_module_fails_as_usual():
    with pytest.raises(ModuleNotFoundError, match=r"^No module named 'harness.no_such_module'$"):
        importlib.import_module("harness.no_such_module")
    assert not hasattr(harness, "no_such_module")


def test_a_script_of_the_old_docs_says_where_to_look(tmp_path):
    """The capture page's import before the package move, in a fresh interpreter: the harness
    package itself, imported by that statement, installs what names the new place."""
    script = tmp_path / "old.py"
    script.write_text("from harness.layout import from_mcore_param\n")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: No module named 'harness.layout': it moved to "
                           "harness.common.layout. Import the public API from gtp_parity"), last
