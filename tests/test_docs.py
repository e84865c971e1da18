"""The documentation's links and commands stay true to the tree and to the command line.

README.md and docs/*.md are checked for two things, each message naming the file, the line and
what is wrong:

- every relative Markdown link ``[text](path)`` / ``[text](path#anchor)`` resolves to a file or
  folder relative to the page holding it, an ``#anchor`` into a Markdown file names one of its
  headings (GitHub's slugs), and no link points into ``harness/`` (its modules are named in
  backticks, not linked);
- every command in a fenced code block that invokes the command line (``gtp-parity ...``,
  ``.venv/bin/gtp-parity ...``, ``python -m harness ...``, ``torchrun ... -m harness ...``)
  names a real subcommand and only flags that subcommand accepts, read off
  ``harness.cli.build_parser()``.

The last tests feed a broken link, a broken anchor, an unknown flag and an unknown subcommand
through the same functions, so the checks are known to be able to fail.

Their size and scope are checked in tests/test_docs_scope.py.
"""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Subcommands that hand their arguments to another parser (argparse.REMAINDER): whose parser.
DELEGATES = {"conformance": "harness.conformance.cli:build_parser"}

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"!?\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]*)(?:\s+\"[^\"]*\")?\)")
_CODE_SPAN = re.compile(r"(`+)(?:.+?)\1")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_PLACEHOLDER = re.compile(r"<[^<>]*>")


@dataclass(frozen=True)
class Line:
    number: int  # 1-based
    text: str
    in_code: bool  # inside a fenced code block (the fences themselves count as code)


def split_lines(text: str) -> list[Line]:
    """The page's lines, each marked as prose or fenced code."""
    lines, fence = [], None
    for number, raw in enumerate(text.splitlines(), 1):
        m = _FENCE.match(raw)
        if fence is None and m:
            fence = m.group(1)
            lines.append(Line(number, raw, True))
        elif fence is not None:
            lines.append(Line(number, raw, True))
            closing = m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence)
            if closing and not raw.strip()[len(m.group(1)):]:  # a closing fence has no info string
                fence = None
        else:
            lines.append(Line(number, raw, False))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: links reduced to their text, lowercase, punctuation other
    than '-' and '_' dropped, each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a Markdown page (repeated headings get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for line in split_lines(text):
        m = None if line.in_code else _HEADING.match(line.text)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def _shown_path(path: Path, root: Path) -> Path:
    return path.relative_to(root) if path.is_relative_to(root) else path


def link_problems(page: Path, text: str, root: Path = ROOT) -> list[str]:
    """What is wrong with the page's relative links, one 'FILE:LINE: ...' message each."""
    problems = []
    where = _shown_path(page, root)
    for line in split_lines(text):
        if line.in_code:
            continue
        prose = _CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line.text)  # `[x](y)` is not a link
        for m in _LINK.finditer(prose):
            target = m.group("target")
            if not target or _SCHEME.match(target):
                continue
            path_part, _, anchor = target.partition("#")
            shown = f"[{m.group('text')}]({target})"
            dest = (page.parent / path_part).resolve() if path_part else page.resolve()
            if path_part and not dest.exists():
                problems.append(f"{where}:{line.number}: link {shown}: no such file or folder "
                                f"{_shown_path(dest, root)}")
                continue
            if dest.is_relative_to(root / "harness"):
                problems.append(f"{where}:{line.number}: link {shown} points into harness/ (code is being "
                                "moved: name modules in backticks instead of linking them)")
                continue
            if anchor and dest.suffix == ".md":
                if anchor not in anchors(dest.read_text(encoding="utf-8")):
                    problems.append(f"{where}:{line.number}: link {shown}: no heading with anchor "
                                    f"#{anchor} in {_shown_path(dest, root)}")
    return problems


def commands(text: str) -> list[tuple[int, list[str]]]:
    """Shell commands in the page's fenced code blocks: (line number, words), continuations
    joined, comments and <placeholders> dropped."""
    out, pending, start = [], "", 0
    for line in split_lines(text):
        if not line.in_code or _FENCE.match(line.text):
            pending = ""
            continue
        body = line.text
        if not pending:
            start = line.number
        body = re.sub(r"^\s*\$\s+", "", body) if not pending else body  # a shell prompt
        if body.rstrip().endswith("\\"):
            pending += body.rstrip()[:-1] + " "
            continue
        logical, pending = pending + body, ""
        logical = re.sub(r"(^|\s)#.*$", "", _PLACEHOLDER.sub(" PLACEHOLDER ", logical))
        for segment in re.split(r"&&|\|\||[;|]", logical):
            try:
                words = shlex.split(segment)
            except ValueError:
                words = segment.split()
            if words:
                out.append((start, words))
    return out


def _program(word: str) -> str:
    return word.rsplit("/", 1)[-1]


def cli_arguments(words: list[str]) -> list[str] | None:
    """The arguments given to the harness's command line, or None if the words do not invoke it."""
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):  # VAR=value cmd
        words = words[1:]
    if not words:
        return None
    prog = _program(words[0])
    if prog == "gtp-parity":
        return words[1:]
    if prog == "torchrun" or re.fullmatch(r"python(3(\.\d+)?)?", prog):
        for i, w in enumerate(words[1:-1], 1):
            if w == "-m":
                return words[i + 2:] if words[i + 1] == "harness" else None
    return None


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def _is_passthrough(parser: argparse.ArgumentParser) -> bool:
    return not _options(parser) and any(a.nargs == argparse.REMAINDER for a in parser._actions)


def _delegate(name: str) -> argparse.ArgumentParser | None:
    spec = DELEGATES.get(name)
    if spec is None:
        return None
    module, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)()
    except (ImportError, AttributeError) as e:
        raise AssertionError(f"DELEGATES[{name!r}] = {spec!r}: cannot build that parser ({e}); "
                             "point it at the subcommand's own build_parser") from e


def cli_problems(page: Path, text: str, parser: argparse.ArgumentParser, root: Path = ROOT) -> list[str]:
    """What is wrong with the page's command lines: unknown subcommands and flags."""
    problems = []
    where = _shown_path(page, root)
    subs = _subparsers(parser)
    for number, words in commands(text):
        args = cli_arguments(words)
        if args is None:
            continue
        if "--" in args:
            args = args[: args.index("--")]
        shown = " ".join(words)
        if not args or args[0].startswith("-"):
            target, name = parser, "gtp-parity"
        elif args[0] in subs:
            target, name, args = subs[args[0]], f"gtp-parity {args[0]}", args[1:]
            if _is_passthrough(target):
                target = _delegate(name.split()[1])
                if target is None:  # its own parser reads the rest: nothing to check here
                    continue
        else:
            problems.append(f"{where}:{number}: unknown subcommand {args[0]!r} in `{shown}` "
                            f"(gtp-parity has: {', '.join(sorted(subs))})")
            continue
        accepted = _options(target)
        for w in args:
            flag = w.strip("[]").split("=", 1)[0]
            is_flag = flag.startswith("-") and flag != "-" and not re.fullmatch(r"-\d.*", flag)  # not -1
            if is_flag and flag not in accepted:
                problems.append(f"{where}:{number}: {name} has no flag {flag!r} in `{shown}` "
                                f"(it accepts: {', '.join(sorted(accepted))})")
    return problems


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    from harness.cli import build_parser

    return build_parser()


def test_pages_exist():
    assert (ROOT / "docs").is_dir(), "docs/ is missing"
    assert len(PAGES) > 1, "no docs/*.md pages found"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(page):
    problems = link_problems(page, page.read_text(encoding="utf-8"))
    assert not problems, f"{len(problems)} broken link(s):\n" + "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_commands_match_cli(page, parser):
    problems = cli_problems(page, page.read_text(encoding="utf-8"), parser)
    assert not problems, f"{len(problems)} command line(s) the CLI would refuse:\n" + "\n".join(problems)


def test_slugs_follow_github():
    assert slug("GTP's other code paths") == "gtps-other-code-paths"
    assert slug("Expert GTP (MoE)") == "expert-gtp-moe"
    assert slug("`gtp-parity run`, step by step") == "gtp-parity-run-step-by-step"
    assert slug("per_token_loss and [data](x.md)") == "per_token_loss-and-data"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


def test_command_extraction():
    text = ("```bash\n"
            ".venv/bin/gtp-parity compare <ref> <cand> \\\n"
            "    --golden <golden> --jobs 2   # two processes\n"
            ".venv/bin/torchrun --nproc-per-node 2 -m harness compare A B\n"
            "python -m harness.backends.worker PLAN\n"
            "torchrun --nproc-per-node 2 -m pytest -k x\n"
            "```\n")
    found = [(n, cli_arguments(w)) for n, w in commands(text)]
    assert found == [(2, ["compare", "PLACEHOLDER", "PLACEHOLDER", "--golden", "PLACEHOLDER", "--jobs", "2"]),
                     (4, ["compare", "A", "B"]), (5, None), (6, None)]


def test_checks_can_fail(tmp_path, parser):
    """A broken link, a broken anchor, an unknown flag and an unknown subcommand are reported,
    each naming the file and line."""
    (tmp_path / "other.md").write_text("# Present heading\n", encoding="utf-8")
    page = tmp_path / "page.md"
    text = ("# Title\n"
            "See [missing](no/such/file.md) and [anchor](other.md#absent-heading).\n"
            "Fine: [here](#title), [there](other.md#present-heading), `[code](nowhere.md)`.\n"
            "```bash\n"
            ".venv/bin/gtp-parity run tests/assets/tiny.toml --bogus-flag 3\n"
            "gtp-parity frobnicate x\n"
            "gtp-parity mlm --nproc 2 -- --not-ours   # after --: pretrain_gpt.py's flags\n"
            "gtp-parity conformance --impl m:f --nproc 4 --no-such-kit-flag\n"
            "```\n")
    page.write_text(text, encoding="utf-8")
    links = link_problems(page, text, root=tmp_path)
    assert len(links) == 2, links
    assert links[0].startswith("page.md:2: link [missing](no/such/file.md): no such file"), links
    assert links[1].startswith("page.md:2: link [anchor](other.md#absent-heading): no heading"), links
    flags = cli_problems(page, text, parser, root=tmp_path)
    assert len(flags) == 3, flags
    assert flags[0].startswith("page.md:5: gtp-parity run has no flag '--bogus-flag'"), flags
    assert flags[1].startswith("page.md:6: unknown subcommand 'frobnicate'"), flags
    assert flags[2].startswith("page.md:8: gtp-parity conformance has no flag '--no-such-kit-flag'"), flags


def test_no_link_into_harness(tmp_path):
    (tmp_path / "harness").mkdir()
    (tmp_path / "harness" / "cli.py").write_text("", encoding="utf-8")
    page = tmp_path / "page.md"
    text = "The [cli](harness/cli.py).\n"
    problems = link_problems(page, text, root=tmp_path)
    assert problems, "a link into harness/ was not reported"
    assert problems[0].startswith("page.md:1: link [cli](harness/cli.py) points into harness/"), problems
