"""Transformer Engine's ``distributed_weight.py``, taken from the pinned release and loaded alone.

The conformance kit drives TE's own dispatchers (``is_distributed_weight``,
``materialize_weight_for_forward``, ``materialize_weight_for_backward``,
``finalize_weight_grads``). TE cannot be imported on a CPU machine, and any partial TE on the
path breaks ``import megatron.core``, so TE is never installed: set-up downloads the pinned
``transformer-engine`` wheel (pure Python) with pip, checks its sha256 against :data:`WHEEL_SHA256`,
and extracts that one file, with TE's license, into a cache folder outside site-packages::

    $XDG_CACHE_HOME/gtp-parity/transformer-engine/2.20.2/   (default ~/.cache/...)
        distributed_weight.py   LICENSE   SOURCE.json

The folder is written under a temporary name and renamed, so a half-written cache never exists;
a cached file whose sha256 matches :data:`FILE_SHA256` means no network. :func:`load` checks the
hash of the very bytes it executes and runs them as a private module (never as
``transformer_engine``). The file imports only ``typing`` and ``torch``.

Command line (``scripts/setup.sh`` runs the first form)::

    python -m harness.conformance.te_source [--wheel PATH]   # fetch unless cached
    python -m harness.conformance.te_source --check          # cached and verified? no network

Exit status: 0 ready, 1 not available (the download failed; the kit then runs on its own mirror
of the dispatchers and says why), 2 refused (a hash does not match the pin).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

TE_VERSION = "2.20.2"
"""The Transformer Engine release whose dispatchers the kit drives."""
PACKAGE = "transformer-engine"
"""The registry's pure-Python TE wheel (the CUDA builds are transformer-engine-cu12/-cu13)."""
WHEEL = f"transformer_engine-{TE_VERSION}-py3-none-any.whl"
WHEEL_SHA256 = "7dcfad943a1a55b2612db9a0e43697fe98c70f4c42ec391ba3a0f872f6ce2094"
"""sha256 of :data:`WHEEL` as the registry serves it."""
MEMBER = "transformer_engine/pytorch/distributed_weight.py"
FILE_SHA256 = "a885b5442413e0387709cf5583e45f3f3b591e864c0af6c8a5b6511863396fc4"
"""sha256 of :data:`MEMBER` inside that wheel (4,859 bytes)."""
LICENSE_MEMBER = f"transformer_engine-{TE_VERSION}.dist-info/licenses/LICENSE"
MODULE_NAME = "_gtp_parity_te_distributed_weight"
"""The private name the file runs under; ``transformer_engine`` never enters sys.modules."""
DOWNLOAD_TIMEOUT_S = 300


class SourceError(Exception):
    """TE's file cannot be used; :attr:`exit_code` is the command line's status for it."""

    exit_code = 1


class Unavailable(SourceError):
    """Not cached, and fetching it failed (no registry, pip error): the kit falls back."""

    exit_code = 1


class Refused(SourceError):
    """A wheel or cached file whose sha256 is not the pinned one: never used, never cached."""

    exit_code = 2


@dataclass(frozen=True, slots=True)
class TESource:
    """The verified file the kit loaded or will load."""

    version: str
    path: Path
    sha256: str

    @property
    def label(self) -> str:
        """What reports print: ``TE 2.20.2 distributed_weight.py <sha256>``."""
        return f"TE {self.version} distributed_weight.py {self.sha256}"


def cache_dir() -> Path:
    """Where the pinned release's file lives: ``$XDG_CACHE_HOME`` (or ~/.cache)/gtp-parity/..."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gtp-parity" / "transformer-engine" / TE_VERSION


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _verified_bytes(path: Path) -> bytes:
    """The cached file's bytes; Unavailable when absent, Refused when its hash is not the pin."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise Unavailable(
            f"{path} is absent: run `python -m harness.conformance.te_source` (scripts/setup.sh "
            f"does) to fetch TE {TE_VERSION}'s distributed_weight.py"
        ) from None
    got = _sha256(data)
    if got != FILE_SHA256:
        raise Refused(
            f"{path}: sha256 {got}, but TE {TE_VERSION}'s distributed_weight.py is {FILE_SHA256}; "
            f"refusing it (delete {path.parent} and run `python -m harness.conformance.te_source`)"
        )
    return data


def cached() -> TESource:
    """The cached file, verified; raises :class:`Unavailable` or :class:`Refused`."""
    path = cache_dir() / "distributed_weight.py"
    _verified_bytes(path)
    return TESource(TE_VERSION, path, FILE_SHA256)


def _download(dest: Path) -> Path:
    """pip-download the pinned wheel (no dependencies, no install) into ``dest``."""
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
        "--disable-pip-version-check", "--quiet", f"{PACKAGE}=={TE_VERSION}", "-d", str(dest),
    ]
    try:
        proc = subprocess.run(
            command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Unavailable(f"pip download {PACKAGE}=={TE_VERSION} failed: {exc}") from None
    wheel = dest / WHEEL
    if proc.returncode != 0 or not wheel.exists():
        tail = " | ".join((proc.stderr or proc.stdout or "").strip().splitlines()[-3:])
        raise Unavailable(
            f"pip download {PACKAGE}=={TE_VERSION} exited {proc.returncode} without {WHEEL}"
            + (f": {tail}" if tail else "")
        )
    return wheel


def _extract(wheel: Path, into: Path) -> None:
    """Check the wheel's sha256, then write the one file, TE's license and a provenance note."""
    data = wheel.read_bytes()
    got = _sha256(data)
    if got != WHEEL_SHA256:
        raise Refused(
            f"{wheel}: sha256 {got}, but {WHEEL} is pinned at {WHEEL_SHA256}; refusing it"
        )
    with zipfile.ZipFile(wheel) as archive:
        source, notice = archive.read(MEMBER), archive.read(LICENSE_MEMBER)
    if _sha256(source) != FILE_SHA256:  # cannot happen with the pinned wheel; checked anyway
        raise Refused(f"{wheel}: {MEMBER} does not hash to {FILE_SHA256}; refusing it")
    (into / "distributed_weight.py").write_bytes(source)
    (into / "LICENSE").write_bytes(notice)
    provenance = {
        "package": PACKAGE,
        "version": TE_VERSION,
        "wheel": WHEEL,
        "wheel_sha256": WHEEL_SHA256,
        "member": MEMBER,
        "sha256": FILE_SHA256,
        "license": f"Apache-2.0, from {LICENSE_MEMBER} (LICENSE here)",
    }
    (into / "SOURCE.json").write_text(json.dumps(provenance, indent=1) + "\n")


def _install(staging: Path, target: Path) -> None:
    """Rename the complete ``staging`` folder to ``target`` (replacing a refused one)."""
    if target.exists():
        try:
            cached()
            shutil.rmtree(staging)  # someone else finished first
            return
        except SourceError:
            shutil.rmtree(target)
    try:
        os.replace(staging, target)
    except OSError:  # another fetch renamed its folder in between: keep that one if it verifies
        cached()
        shutil.rmtree(staging)


def fetch(wheel: Path | None = None) -> TESource:
    """The pinned file, from the cache when verified (no network), else from ``wheel`` or pip.

    Raises :class:`Unavailable` when the download fails and :class:`Refused` when a hash does
    not match; nothing is cached then.
    """
    try:
        return cached()
    except Unavailable:
        pass
    except Refused as exc:
        print(f"te_source: {exc}; fetching it again", file=sys.stderr)
    target = cache_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{TE_VERSION}-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the cache is a plain folder
    try:
        with tempfile.TemporaryDirectory(prefix="gtp-te-wheel-") as tmp:
            _extract(wheel if wheel is not None else _download(Path(tmp)), staging)
        _install(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return cached()


def load() -> tuple[ModuleType, TESource]:
    """TE's file as a private module, executed from bytes whose sha256 was just checked."""
    source = TESource(TE_VERSION, cache_dir() / "distributed_weight.py", FILE_SHA256)
    data = _verified_bytes(source.path)
    spec = importlib.util.spec_from_file_location(MODULE_NAME, source.path)
    module = importlib.util.module_from_spec(spec)
    exec(compile(data, str(source.path), "exec"), module.__dict__)
    return module, source


def main(argv: list[str] | None = None) -> int:
    """Fetch (or with ``--check`` only verify) the pinned file; print where it is."""
    parser = argparse.ArgumentParser(
        prog="python -m harness.conformance.te_source", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--wheel", type=Path, help=f"use this local {WHEEL} instead of pip")
    parser.add_argument("--check", action="store_true", help="only verify the cache (no network)")
    args = parser.parse_args(argv)
    try:
        source = cached() if args.check else fetch(args.wheel)
    except SourceError as exc:
        print(f"te_source: {exc}", file=sys.stderr)
        if isinstance(exc, Unavailable):
            print(
                "te_source: the conformance kit will run on its own mirror of TE's dispatchers",
                file=sys.stderr,
            )
        return exc.exit_code
    print(f"{source.label} at {source.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
