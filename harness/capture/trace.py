"""The on-disk trace: what one side recorded on every rank.

A trace is a folder::

    manifest.json                 written last, by rank 0, once every rank has closed
    rank{r}/step{s}.safetensors   that rank's tensors of step s (step 0: initial weights)
    rank{r}/index.json            per tensor: kind, canonical name, step, micro-batch,
                                  sample ids, dtype, local shape, layout, content hash;
                                  and the scalars
    rank{r}/progress.json         heartbeat: the last step and phase reached

Every file is written to a temporary name and renamed, so a reader never sees half a file;
a trace without ``manifest.json`` (or with ``complete: false``) is incomplete. Tensors are
safetensors and metadata JSON: loading a trace never executes code. Each tensor's content
digest (:data:`DIGEST`, named in the index beside it; traces written before it carry sha256)
is recorded when it is captured and checked when it is read, so a tensor altered or swapped
with another of the same shape is refused, not compared.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path


import torch
import xxhash
from safetensors import SafetensorError
from safetensors import safe_open
from safetensors.torch import save_file

from harness.common.errors import BadInput
from harness.common.layout import Layout

FORMAT = "gtp-parity-trace"
FORMAT_VERSION = 1
READ_BUDGET = 64 << 20
"""Bytes read through a trace's open file handles before they are closed (see Trace.tensor)."""


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Atomically write a safetensors file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)


DIGESTS = {
    "sha256": lambda buf: hashlib.sha256(buf).hexdigest(),
    "xxh3_128": xxhash.xxh3_128_hexdigest,  # ~30x sha256's speed: integrity, not adversaries
}
DIGEST = "xxh3_128"
"""The content digest new traces record (a non-cryptographic 128-bit hash: it guards against
altered or swapped files, which is all the trace needs)."""


def tensor_bytes(t: torch.Tensor):
    """A contiguous tensor's bytes as a buffer, without a copy."""
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""


def content_hash(t: torch.Tensor, alg: str = DIGEST) -> str:
    """Digest ``alg`` of a tensor's bytes, read in place (no copy of a contiguous tensor)."""
    return DIGESTS[alg](tensor_bytes(t.detach().contiguous()))


def is_complete(path: str | Path) -> bool:
    """True when the trace at ``path`` has a manifest that says it is complete."""
    try:
        doc = json.loads((Path(path) / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and doc.get("complete") is True


def tensor_key(kind: str, name: str, micro_batch: int | None) -> str:
    return f"{kind}|{name}" + ("" if micro_batch is None else f"|mb{micro_batch}")


@dataclass(slots=True)
class Entry:
    """One recorded tensor of one rank."""

    rank: int
    step: int
    kind: str
    name: str
    key: str
    dtype: str
    local_shape: tuple[int, ...]
    layout: Layout | None
    micro_batch: int | None = None
    sample_ids: tuple[int, ...] | None = None
    fingerprint: dict | None = None
    digest: str | None = None
    """Content digest recorded at capture (None: a fingerprint-mode entry, or an older trace)."""
    digest_alg: str = DIGEST
    """Its algorithm, one of :data:`DIGESTS` (an index without it holds sha256)."""

    def to_json(self) -> dict:
        return {
            "step": self.step, "kind": self.kind, "name": self.name, "key": self.key,
            "dtype": self.dtype, "local_shape": list(self.local_shape),
            "layout": self.layout.to_json() if self.layout else None,
            "micro_batch": self.micro_batch,
            "sample_ids": list(self.sample_ids) if self.sample_ids is not None else None,
            "fingerprint": self.fingerprint,
            "digest": self.digest, "digest_alg": self.digest_alg,
        }


@dataclass
class Trace:
    """A trace read back from disk (tensors are loaded on demand)."""

    path: Path
    manifest: dict
    entries: list[Entry]
    scalars: list[dict]
    infos: dict = field(default_factory=dict)
    """rank -> the free-form facts the rank recorded."""
    verify: bool = True
    """Check each tensor against its recorded content hash when it is first read."""
    _verified: set = field(default_factory=set, repr=False)
    _files: dict = field(default_factory=dict, repr=False)
    _read: int = field(default=0, repr=False)

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    @property
    def world_size(self) -> int:
        return int(self.manifest["world_size"])

    def coords(self) -> dict[int, dict[str, int]]:
        return {int(r): c for r, c in self.manifest["coords"].items()}

    def tensor(self, entry: Entry) -> torch.Tensor:
        path = f"{self.path}/rank{entry.rank}/step{entry.step}.safetensors"
        # Files are memory-mapped and each tensor read when asked for. An open handle keeps
        # every page read through it resident, after the tensors are gone: the handles are
        # dropped once READ_BUDGET bytes have been read through them, so a streaming compare
        # holds its live tensors plus at most that much per trace, whatever the traces' size.
        if self._read > READ_BUDGET:
            self._files.clear()
            self._read = 0
        if (opened := self._files.get(path)) is None:
            try:
                handle = safe_open(path, framework="pt")
            except FileNotFoundError:
                raise BadInput(path, "missing tensor file listed in the rank index") from None
            except (SafetensorError, OSError, ValueError) as e:
                raise BadInput(path, f"corrupt or truncated safetensors file ({e})") from None
            # the handle and its keys (``keys()`` builds a fresh list on every call)
            opened = self._files[path] = (handle, frozenset(handle.keys()))
        handle, keys = opened
        if entry.key not in keys:
            raise BadInput(path, f"tensor {entry.key!r} listed in the index is missing")
        try:
            t = handle.get_tensor(entry.key)
        except (SafetensorError, OSError, ValueError) as e:
            raise BadInput(path, f"corrupt or truncated safetensors file ({e})") from None
        self._read += t.numel() * t.element_size()
        if tuple(t.shape) != tuple(entry.local_shape):
            raise BadInput(
                path, f"tensor {entry.key!r} has shape {tuple(t.shape)}, index says {entry.local_shape}"
            )
        if self.verify and entry.digest and (path, entry.key) not in self._verified:
            if content_hash(t, entry.digest_alg) != entry.digest:
                raise BadInput(path, f"tensor {entry.key!r} does not match the content hash recorded "
                                   "when it was written (altered, or swapped with another tensor)")
            self._verified.add((path, entry.key))
        return t


def read(path: str | Path, allow_incomplete: bool = False, verify: bool = True) -> Trace:
    """Read a trace's manifest and indexes; raise BadInput naming the file on any problem.
    ``verify``: check tensors against their recorded content hashes as they are read."""
    path = Path(path)
    manifest_path = path / "manifest.json"
    if not path.is_dir():
        raise BadInput(str(path), "not a trace folder")
    if not manifest_path.exists():
        if not any(path.glob("rank*/index.json")) and not any(path.glob("rank*/progress.json")):
            raise BadInput(str(path), "not a trace: no manifest.json and no rank*/ records")
        if not allow_incomplete:
            raise BadInput(str(manifest_path), "missing: the run did not finish (incomplete trace)")
        manifest = {"complete": False, "world_size": len(list(path.glob("rank*"))), "coords": {}}
    else:
        manifest = _read_json(manifest_path)
        if manifest.get("format") != FORMAT:
            raise BadInput(str(manifest_path), f"not a {FORMAT} manifest")
        if manifest.get("version") != FORMAT_VERSION:
            raise BadInput(
                str(manifest_path),
                f"unknown trace format version {manifest.get('version')!r}; this reader knows "
                f"{FORMAT_VERSION}",
            )
        if not manifest.get("complete") and not allow_incomplete:
            raise BadInput(str(manifest_path), "the trace is marked incomplete")
    entries, scalars, infos = [], [], {}
    for rank in range(int(manifest["world_size"])):
        index_path = path / f"rank{rank}" / "index.json"
        if not index_path.exists():
            if allow_incomplete:
                continue
            raise BadInput(str(index_path), f"missing index of rank {rank}")
        index = _read_json(index_path)
        for e in index.get("tensors", []):
            try:
                entries.append(
                    Entry(
                        rank=rank, step=int(e["step"]), kind=e["kind"], name=e["name"], key=e["key"],
                        dtype=e["dtype"], local_shape=tuple(e["local_shape"]),
                        layout=Layout.from_json(e["layout"]) if e.get("layout") else None,
                        micro_batch=e.get("micro_batch"),
                        sample_ids=tuple(e["sample_ids"]) if e.get("sample_ids") is not None else None,
                        fingerprint=e.get("fingerprint"), digest=e.get("digest", e.get("sha256")),
                        digest_alg=e.get("digest_alg", "sha256"),
                    )
                )
            except (KeyError, TypeError, ValueError) as err:
                raise BadInput(str(index_path), f"malformed tensor entry {e!r}: {err}") from None
            if entries[-1].digest_alg not in DIGESTS:
                raise BadInput(str(index_path), f"tensor {e['key']!r}: unknown digest_alg "
                                                f"{entries[-1].digest_alg!r}; one of {sorted(DIGESTS)}")
        infos[rank] = index.get("info", {})
        for s in index.get("scalars", []):
            scalars.append({**s, "rank": rank})
    if not allow_incomplete:
        _check_shapes(path, entries)
    return Trace(path=path, manifest=manifest, entries=entries, scalars=scalars, infos=infos, verify=verify)


def model_shapes(t: Trace) -> dict[str, tuple[int, ...]]:
    """Logical shape of every weight the trace recorded at its first recorded step."""
    steps = [e.step for e in t.entries if e.kind == "param"]
    return {e.name: tuple(e.layout.logical_shape) if e.layout else tuple(e.local_shape)
            for e in t.entries if e.kind == "param" and e.step == min(steps)}


def check_same_model(traces: dict[str, Trace]) -> None:
    """Traces of two different models (other tensors, other shapes) are a bad input to a
    comparison, not a parity failure: raise BadInput naming the first difference."""
    ref = traces["reference"]
    want = model_shapes(ref)
    for role, t in traces.items():
        got = model_shapes(t)
        if role == "reference" or not want or not got:
            continue  # a trace that captured no weights cannot be checked this way
        for name in sorted(set(want) | set(got)):
            if want.get(name) != got.get(name):
                raise BadInput(
                    f"{t.path}", f"not the same model as the reference {ref.path}: weight {name} is "
                    f"{_shape_text(got.get(name))} here and {_shape_text(want.get(name))} in the reference",
                )


def _shape_text(shape: tuple[int, ...] | None) -> str:
    return "absent" if shape is None else str(list(shape))


def _check_shapes(path: Path, entries: list[Entry]) -> None:
    for e in entries:
        if e.layout is not None and tuple(e.layout.local_shape()) != tuple(e.local_shape):
            raise BadInput(
                str(path / f"rank{e.rank}" / "index.json"),
                f"{e.key} at step {e.step}: local shape {e.local_shape} does not match its layout "
                f"(logical {e.layout.logical_shape} gives {e.layout.local_shape()})",
            )


def _read_json(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise BadInput(str(path), f"invalid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise BadInput(str(path), "expected a JSON object")
    return doc
