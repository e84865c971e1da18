"""Tree specs in scenarios: which megatron-core (and Megatron-Bridge) each side imports.

A side's ``megatron_core`` (and a bridge side's ``bridge``) is a *tree spec*; its form is read
here (:func:`parse_spec`) and checked by ``validate`` without the repository it names, which is
resolved to a tree before launch (:mod:`harness.run.trees`, :mod:`harness.run.repos`):

- ``installed``: the venv's package;
- a folder: a checkout, or any folder holding the package;
- ``git:<repository>@<rev>``: that revision's tree, the repository being
  - a *name* (``git:megatron-lm@14346b65a``): lowercase letters, digits, ``.``, ``_`` and ``-``,
    configured once per machine, so a scenario that names it runs on any machine;
  - a git *URL* (``git:https://github.com/NVIDIA/Megatron-LM@<rev>``, ``file://`` too), cloned
    into the tree cache on first use; a URL names its revision;
  - a *folder* of this machine (``git:~/Megatron-LM@main``, ``git:./Megatron-LM``); a bare word
    is a name, so a folder in the current one is written ``./<folder>``.

On the command line ``--megatron-core SPEC`` sets every megatron-core side's tree,
``--reference-code`` and ``--candidate-code`` one side's (:func:`with_code`). Given both, and
different, the scenario becomes a *code comparison*: the scenario's candidate configuration run
on each tree, judged ``exact``: the same computation on the same values, so any difference is
the code's.
"""

from __future__ import annotations

import dataclasses
import re

from harness.scenario.schema import Scenario, Side

INSTALLED = "installed"
GIT_PREFIX = "git:"
USES_MEGATRON = ("megatron", "mlm", "bridge")
NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/\s]*/\S+")
FORMS = ("'installed', a folder, or git:<repository>@<rev>, the repository a configured name, a git URL or "
         "a folder")


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    """A tree spec's parts, as written."""

    text: str
    kind: str
    """installed, path or git."""
    repo: str = ""
    """git: the repository's name, URL or folder; path: the folder."""
    names: str = ""
    """What a git spec's repository is: name, url or folder."""
    rev: str = "HEAD"


def parse_spec(text: str) -> TreeSpec:
    """The spec's parts; a ValueError says what is wrong with its form."""
    if text == INSTALLED:
        return TreeSpec(text, "installed")
    if not text.strip():
        raise ValueError(f"an empty spec: give {FORMS}")
    if not text.startswith(GIT_PREFIX):
        return TreeSpec(text, "path", repo=text)
    repo, at, rev = text[len(GIT_PREFIX):].rpartition("@")
    if not at:
        repo, rev = rev, "HEAD"
    if not repo.strip():
        raise ValueError(f"{text!r} names no repository: give {FORMS}")
    if not rev.strip():
        raise ValueError(f"{text!r} names no revision after its '@'")
    if _SCHEME.match(repo):
        if not at or not _URL.fullmatch(repo):
            raise ValueError(f"{text!r}: a URL names its revision, git:<scheme>://<host>/<path>@<rev>")
        return TreeSpec(text, "git", repo, "url", rev)
    if "/" in repo or repo.startswith(("~", ".")):
        return TreeSpec(text, "git", repo, "folder", rev)
    if NAME.fullmatch(repo):
        return TreeSpec(text, "git", repo, "name", rev)
    raise ValueError(f"{text!r}: {repo!r} is neither a repository name (lowercase letters, digits, '.', '_', "
                     f"'-') nor a folder (a folder in the current one: git:./{repo})")


def is_url(text: str) -> bool:
    """Whether a repository is named by a URL (``<scheme>://...``) rather than a folder."""
    return bool(_SCHEME.match(text))


def spec_problem(text: str) -> str | None:
    """What is wrong with the spec's form (None: nothing); the repository is not looked at."""
    try:
        parse_spec(text)
    except ValueError as e:
        return str(e)
    return None


def is_code_comparison(reference: Side, candidate: Side) -> bool:
    """Whether the two sides differ in their megatron-core tree and in nothing else."""
    same_code = dataclasses.replace(reference, megatron_core=candidate.megatron_core)
    return reference.megatron_core != candidate.megatron_core and same_code == candidate


def _on(side: Side | None, spec: str | None) -> Side | None:
    if side is None or spec is None or side.backend not in USES_MEGATRON:
        return side
    return dataclasses.replace(side, megatron_core=spec)


def _on_bridge(side: Side | None, spec: str | None) -> Side | None:
    if side is None or spec is None or side.backend != "bridge":
        return side
    return dataclasses.replace(side, bridge=spec)


def with_code(scenarios: list[Scenario], every: str | None = None, reference: str | None = None,
              candidate: str | None = None, bridge: str | None = None) -> list[Scenario]:
    """The scenarios with the trees the command line names (None: as the file says); ``bridge``:
    the Megatron-Bridge every bridge side runs."""
    out = []
    for s in scenarios:
        s = dataclasses.replace(s, reference=_on_bridge(s.reference, bridge),
                                candidate=_on_bridge(s.candidate, bridge))
        s = dataclasses.replace(s, reference=_on(s.reference, every), candidate=_on(s.candidate, every),
                                saver=_on(s.saver, every))
        if reference is not None and candidate is not None and reference != candidate:
            ref, cand = _on(s.candidate, reference), _on(s.candidate, candidate)
            s = dataclasses.replace(
                s, reference=ref, candidate=cand, expect=None,
                compare=dataclasses.replace(s.compare, policy="exact"),
                description=f"code comparison: {s.name}'s candidate on {reference} vs {candidate}")
        else:
            s = dataclasses.replace(s, reference=_on(s.reference, reference),
                                    candidate=_on(s.candidate, candidate))
        out.append(s)
    return out


def code_axes(s: Scenario) -> dict[str, str]:
    """Role -> spec of every side that does not run the installed megatron-core."""
    return {role: side.megatron_core for role, side in s.sides.items() if side.megatron_core != INSTALLED}
