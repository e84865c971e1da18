"""The command line's argument types and shared options: a bad value is exit 2 naming it."""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.common.errors import EXIT_BAD_INPUT, BadInput


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse exits 2 on bad arguments, which is our bad-input code
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def out_dir(path: str, flag: str) -> Path:
    """An output folder: it may exist (runs are resumed), but must not be a file."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise BadInput(flag, f"{path} exists and is not a folder")
    for parent in out.parents:
        if parent.exists() and not parent.is_dir():
            raise BadInput(flag, f"{parent} is not a folder")
    return out


def non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def int_at_least(low: int):
    """An argparse type: an integer >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        return value

    return parse


positive_int, count = int_at_least(1), int_at_least(0)


def limits_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-limits", action="store_true",
                   help="lift the size limits on models, steps and world sizes (see README: Reliability)")
