"""Errors that reach the user, each with the exit code the CLI returns for it."""

from __future__ import annotations

from typing import Any

EXIT_PASS = 0
EXIT_PARITY_FAIL = 1
EXIT_BAD_INPUT = 2
EXIT_RUN_FAILED = 3


class HarnessError(Exception):
    """Base class: ``exit_code`` is what ``gtp-parity`` exits with."""

    exit_code = EXIT_RUN_FAILED


class BadInput(HarnessError):
    """A scenario, trace or argument is invalid. The message names what, where and the rule."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, where: str, message: str):
        self.where = where
        super().__init__(f"{where}: {message}")


class RunFailed(HarnessError):
    """A launched run crashed, hung or timed out. The message names the rank and the step."""

    exit_code = EXIT_RUN_FAILED


def shown(value: Any, width: int = 60) -> str:
    """A value as a message quotes it: its repr, cut to ``width`` characters."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."
