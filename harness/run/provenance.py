"""Provenance: what code and environment compute a side, so a trace is reused only by its twin.

A trace is reused by a later run into the same folder only when its side key is equal, and the
key includes :func:`code_identity`: the versions of Python, torch, megatron-core, Transformer
Engine and the harness; a content hash of the code the workers will import (megatron-core's
package wherever it resolves, PYTHONPATH included, Transformer Engine's if present, the
harness's own source, ``sitecustomize``/``usercustomize``, every ``.py`` file under the
PYTHONPATH entries); the CPU kernels torch dispatches to; and the environment variables the
numerics read. Editing one file of megatron-core therefore changes the key of every side.

File hashes are cached by (path, size, mtime, ctime, inode) in a JSON file under the user's
cache folder, so recomputing the identity of an unchanged tree costs a ``stat`` per file.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from importlib import metadata
from importlib.machinery import PathFinder
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The folder holding the ``harness`` package: the launcher puts it first on PYTHONPATH."""

# Variables the numerics or the code under test read (TE's recipes read NVTE_*; OpenBLAS and
# OpenMP pick kernels and thread counts; torch and megatron-core read their own).
ENV_PREFIXES = ("NVTE_", "TORCH_", "MEGATRON_", "GTP_", "OMP_", "MKL_", "OPENBLAS_", "ATEN_", "CUBLAS_")
ENV_NAMES = ("PYTHONPATH", "PYTHONHASHSEED")
SUFFIXES = (".py", ".so")
# A PYTHONPATH entry with more files than this is identified by its file list and stats alone.
MAX_FILES_HASHED = 20_000


def _cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gtp-parity" / "file-hashes.json"


class _FileHashes:
    """sha256 of files, remembered by their stat signature across processes (JSON, no pickle)."""

    def __init__(self):
        self.path = _cache_path()
        try:
            doc = json.loads(self.path.read_text())
            self.known = doc if isinstance(doc, dict) else {}
        except (OSError, ValueError):
            self.known = {}
        self.dirty = False

    def digest(self, path: str) -> str:
        st = os.stat(path)
        sig = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        hit = self.known.get(path)
        if isinstance(hit, list) and hit[:4] == sig:
            return hit[4]
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        self.known[path] = [*sig, h.hexdigest()]
        self.dirty = True
        return h.hexdigest()

    def save(self) -> None:
        if not self.dirty:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")
            tmp.write_text(json.dumps(self.known))
            os.replace(tmp, self.path)
        except OSError:
            pass  # a read-only cache folder only costs speed


def tree_hash(roots: list[Path], hashes: _FileHashes, limit: int | None = None) -> str:
    """One hash over the relative paths and contents of the code files under ``roots``."""
    h = hashlib.sha256()
    for root in roots:
        if root.is_file():
            h.update(f"{root.name}\0{hashes.digest(str(root))}\n".encode())
            continue
        files = sorted(
            p for p in root.rglob("*")
            if p.suffix in SUFFIXES and p.is_file()
            and not any(part == "__pycache__" or part.startswith(".") for part in p.relative_to(root).parts)
        )
        if limit is not None and len(files) > limit:
            for p in files:
                st = p.stat()
                h.update(f"{p.relative_to(root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
            continue
        for p in files:
            h.update(f"{p.relative_to(root)}\0{hashes.digest(str(p))}\n".encode())
    return h.hexdigest()


def worker_path(env: dict[str, str] | None = None) -> list[str]:
    """The import path a worker sees: the harness root, PYTHONPATH, then this interpreter's
    site folders (the launcher builds the worker's environment the same way)."""
    env = os.environ if env is None else env
    user = _user_path(env)
    site = [p for p in sys.path if p and p not in user and Path(p).resolve() != ROOT]
    return [str(ROOT), *user, *site]


def _user_path(env: dict[str, str]) -> list[str]:
    """PYTHONPATH's entries other than the harness root (which the launcher adds anyway)."""
    entries = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return [p for p in entries if Path(p).resolve() != ROOT]


def _package_roots(name: str, path: list[str]) -> list[Path]:
    spec = PathFinder.find_spec(name, path)
    if spec is None:
        return []
    if spec.submodule_search_locations:
        return [Path(p) for p in spec.submodule_search_locations]
    return [Path(spec.origin)] if spec.origin else []


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cpu_capability() -> str:
    try:
        import torch

        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # an old torch without it: the machine's name still separates machines
        return "unknown"


def code_identity(env: dict[str, str] | None = None, tree=None) -> dict:
    """What computes a side, as recorded in its trace's manifest. ``digest`` sums it up.

    ``tree``: the side's megatron-core (:class:`harness.run.trees.CodeTree`); one other than the
    installed wheel is named (spec, commit, dirty state, the version its own package_info.py
    says) and its version replaces the wheel's."""
    env = dict(os.environ if env is None else env)
    path = worker_path(env)
    hashes = _FileHashes()
    user = _user_path(env)
    env["PYTHONPATH"] = os.pathsep.join(user)
    roots = {n: _package_roots(n, path)
             for n in ("megatron", "transformer_engine", "sitecustomize", "usercustomize")}
    code = {
        "megatron": tree_hash(roots["megatron"], hashes),
        "transformer_engine": tree_hash(roots["transformer_engine"], hashes),
        "harness": tree_hash([ROOT / "harness"], hashes),
        "site_customize": tree_hash([*roots["sitecustomize"], *roots["usercustomize"]], hashes),
        "pythonpath": tree_hash([Path(p) for p in user if Path(p).exists()], hashes, limit=MAX_FILES_HASHED),
    }
    hashes.save()
    where = {n: [str(p) for p in roots[n]] for n in ("megatron", "transformer_engine")}
    doc = {
        "versions": {
            "python": platform.python_version(),
            "torch": _version("torch"),
            "megatron-core": _version("megatron-core"),
            "transformer-engine": _version("transformer-engine"),
            "gtp-parity": _version("gtp-parity"),
        },
        "code": code,
        "imported_from": where,
        "cpu": {"machine": platform.machine(), "capability": _cpu_capability()},
        "env": {k: v for k, v in sorted(env.items()) if k in ENV_NAMES or k.startswith(ENV_PREFIXES)},
    }
    if tree is not None and tree.kind != "installed":
        doc["versions"]["megatron-core"] = tree.version
        doc["megatron_core"] = tree.to_json()
    doc["digest"] = _digest(doc)
    return doc


def _digest(doc: dict) -> str:
    # Where the code was imported from does not change what it computes; its content does.
    blob = {k: v for k, v in doc.items() if k not in ("digest", "imported_from")}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:12]


def differences(a: dict | None, b: dict | None) -> list[str]:
    """What differs between two identities, as short phrases (empty: same code)."""
    if (a or {}).get("digest") == (b or {}).get("digest"):
        return []
    if not a or not b:
        return ["one trace records no provenance"]
    out = []
    for part in ("versions", "code", "megatron_core", "cpu", "env"):
        pa, pb = a.get(part, {}), b.get(part, {})
        for key in sorted(set(pa) | set(pb)):
            if pa.get(key) != pb.get(key):
                out.append(f"{part}.{key}: {_short(pa.get(key))} vs {_short(pb.get(key))}")
    return out or ["digest differs"]


def _short(v) -> str:
    s = str(v)
    return s[:12] if len(s) == 64 else s
