"""Where a pytest option's value comes from: the command line wins over the ini file.

Shared by the ``gtp_parity`` and conformance plugins, so both name the source of a bad value
the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Setting:
    value: str | None
    where: str
    """The option or ini key it came from, for error messages."""
    base: Path
    """The folder a relative path in it is relative to."""


def resolve(config, name: str) -> Setting:
    """Option ``name`` (its dest) from the command line, else its ini twin (empty -> None)."""
    value = config.getoption(name)
    if value:
        return Setting(value, "--" + name.replace("_", "-"), Path(config.invocation_params.dir))
    value = config.getini(name)
    where = f"ini option {name} in {config.inipath or 'no ini file'}"
    return Setting(value or None, where, Path(config.inipath).parent if config.inipath
                   else Path(config.rootpath))
