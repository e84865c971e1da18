"""The pages' size and scope: README.md stays a newcomer's page (at most 12 KB, with the two
quick-start commands, each a script that exists), and docs/architecture.md's package list names
every module of ``harness/`` and no module that is gone.
"""

from __future__ import annotations

import re
from pathlib import Path

from test_docs import ROOT, split_lines

README_MAX_BYTES = 12 * 1024
QUICK_START = ("bash scripts/main.sh", "bash scripts/test.sh")
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def test_readme_is_a_newcomers_page():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    size = len(text.encode("utf-8"))
    assert size <= README_MAX_BYTES, (f"README.md is {size} bytes, over {README_MAX_BYTES}: move findings, "
                                      "figures and tables into docs/ and link them")
    code = [line.text.split("#", 1)[0].strip() for line in split_lines(text) if line.in_code]
    for command in QUICK_START:
        assert command in code, f"README.md: the quick-start command `{command}` is not in a code block"
        script = ROOT / command.split()[1]
        assert script.is_file(), f"README.md: `{command}` names {script.relative_to(ROOT)}: no such file"


_ENTRY = re.compile(r"^(?P<header>[\w./-]+/|[\w./-]+\.py)(?:\s|$)")
_MODULE_TOKEN = re.compile(r"(?<![\w./-])(?:(?P<scope>[A-Za-z_]\w*)/\s*\(|(?P<module>[A-Za-z_][\w/]*\.py)\b)|"
                           r"(?P<paren>[()])")


def named_modules(text: str) -> set[str]:
    """The module paths the package list (the code block of "## The packages") names: an entry
    starts at column 0 with its folder (or file); a ``name.py`` in it is that folder's module,
    ``sub/ (... name.py ...)`` a module of its subfolder, and a path from ``harness/`` is itself."""
    section = text.split("## The packages", 1)[1]
    lines = [line.text for line in split_lines(section) if line.in_code]
    lines = lines[1:lines.index("```", 1)] if "```" in lines[1:] else lines[1:]
    entries: list[list[str]] = []  # [header, its text], the text of an entry's lines joined
    for line in lines:
        m = None if line.startswith(" ") else _ENTRY.match(line)
        if m:
            entries.append([m.group("header"), line[m.end():]])
        elif entries:
            entries[-1][1] += " " + line.strip()
    named = set()
    for header, body in entries:
        folder = "" if header.endswith(".py") else header
        if header.endswith(".py"):
            named.add(header)
        scopes, depth = [], 0
        for t in _MODULE_TOKEN.finditer(body):
            if t.group("scope"):
                scopes.append((t.group("scope"), depth))
                depth += 1
            elif t.group("paren") == "(":
                depth += 1
            elif t.group("paren") == ")":
                depth -= 1
                if scopes and scopes[-1][1] == depth:
                    scopes.pop()
            elif (module := t.group("module")).startswith("harness/"):
                named.add(module)
            else:
                named.add(folder + "".join(f"{name}/" for name, _ in scopes) + module)
    return named


def architecture_problems(text: str, root: Path = ROOT) -> list[str]:
    """Modules of harness/ the package list does not name (a package's __init__ and __main__
    are the package), and modules it names that do not exist."""
    named = named_modules(text)
    modules = {p.relative_to(root).as_posix() for p in (root / "harness").rglob("*.py")}
    missing = sorted(m for m in modules - named if Path(m).name not in ("__init__.py", "__main__.py"))
    gone = sorted(m for m in named if not (root / m).is_file())
    return ([f"docs/architecture.md does not name {m}" for m in missing]
            + [f"docs/architecture.md names {m}, which does not exist" for m in gone])


def test_architecture_names_every_module():
    problems = architecture_problems(ARCHITECTURE.read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)


def test_architecture_check_can_fail(tmp_path):
    for module in ("harness/a/__init__.py", "harness/a/x.py", "harness/a/sub/y.py", "harness/a/sub/z.py",
                   "harness/b.py"):
        (tmp_path / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / module).write_text("", encoding="utf-8")
    page = ("## The packages\n\n```\nharness/a/     x.py (one), sub/\n  (y.py (two)), z.py, gone.py\n"
            "harness/b.py  the file itself\n```\n")
    named = {"harness/a/x.py", "harness/a/sub/y.py", "harness/a/z.py", "harness/a/gone.py", "harness/b.py"}
    assert named_modules(page) == named
    assert architecture_problems(page, tmp_path) == [
        "docs/architecture.md does not name harness/a/sub/z.py",
        "docs/architecture.md names harness/a/gone.py, which does not exist",
        "docs/architecture.md names harness/a/z.py, which does not exist",
    ]
