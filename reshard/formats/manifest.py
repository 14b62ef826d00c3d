"""``reshard.json``: what every output directory says about itself (the one place it is made).

Written last by every writer's ``complete`` (and by :func:`reshard.dist.save_dtensors`),
so its presence marks a finished checkpoint: format, mesh, placement rules, per-tensor
dtype/shape/placements (format version 1; version 2 counts the tensors of files that
describe them themselves), per-file size and checksum.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypedDict

from ..errors import HeaderError
from ..io.safe import expect_object, load_json
from ..io.writer import FileResult, write_atomic
from ..mesh import Mesh
from ..plan import Plan
from ..version import __version__

__all__ = [
    "MANIFEST",
    "complete_with_manifest",
    "complete_self_described",
    "TensorInfo",
    "FileInfo",
    "Manifest",
    "manifest",
    "manifest_for",
    "read_manifest",
    "write_manifest",
]

MANIFEST = "reshard.json"


class TensorInfo(TypedDict):
    dtype: str
    shape: list[int]
    placements: list[str]


class FileInfo(TypedDict):
    size: int
    checksum: str


class _Producer(TypedDict):
    format_version: int
    version: str


class _ManifestCore(TypedDict):
    reshard: _Producer
    format: str
    mesh: dict[str, list[object]]
    rules: list[list[object]]


class Manifest(_ManifestCore, total=False):
    tensors: dict[str, TensorInfo]  # format version 1
    tensor_count: int  # format version 2
    files: dict[str, FileInfo]
    transforms: dict[str, Any]
    """The tensor transforms a conversion applied (``origin``, ``inverse``, ``model_config``, ``spec``)."""


def manifest(
    fmt: str,
    mesh: Mesh,
    rules: list[list[object]],
    tensors: Mapping[str, TensorInfo] | int,
    files: Iterable[tuple[str, int, str]],
) -> Manifest:
    """The ``reshard.json`` document.

    Format version 1 lists every tensor; version 2 (for files that describe their tensors
    themselves: per-rank and Hugging Face safetensors, DCP) only counts them, since listing
    100k tensors again made the manifest as large as a header and every command read it.

    Args:
        fmt: the writer's name.
        mesh: the checkpoint's mesh.
        rules: the placement rules as ``[[pattern, value], ...]`` (layout JSON).
        tensors: per tensor name, in checkpoint order: dtype, global shape, placements
            (version 1); or how many tensors the files describe (version 2).
        files: ``(name, size, checksum)`` per file, in the order to list them.
    """
    listed = not isinstance(tensors, int)
    doc: Manifest = {
        "reshard": {"format_version": 1 if listed else 2, "version": __version__},
        "format": fmt,
        "mesh": mesh.to_json(),
        "rules": rules,
    }
    if isinstance(tensors, int):
        doc["tensor_count"] = tensors
    else:
        doc["tensors"] = dict(tensors)
    doc["files"] = {name: {"size": size, "checksum": cs} for name, size, cs in files}
    return doc


def manifest_for(plan: Plan, results: Sequence[FileResult], *, listed: bool = True) -> Manifest:
    """The ``reshard.json`` of a finished conversion (``results`` in plan order); without
    ``listed``, format version 2 (the files describe their tensors)."""
    rules: list[list[object]] = plan.rules.to_json()["rules"] if plan.rules is not None else [["*", "R"]]
    tensors: dict[str, TensorInfo] | int = len(plan.tensors)
    if listed:
        tensors = {
            t.name: {"dtype": t.dtype, "shape": list(t.shape), "placements": t.layout.placement_strs()}
            for t in plan.tensors
        }
    doc = manifest(plan.format, plan.mesh, rules, tensors, ((r.name, r.size, r.checksum) for r in results))
    if plan.transforms is not None:
        doc["transforms"] = plan.transforms
    return doc


def complete_with_manifest(dst: Path, plan: Plan, results: Sequence[FileResult]) -> None:
    """``Writer.complete`` for formats whose finished directory needs only ``reshard.json``."""
    write_manifest(dst, manifest_for(plan, results))


def complete_self_described(dst: Path, plan: Plan, results: Sequence[FileResult]) -> None:
    """:func:`complete_with_manifest` for formats whose files describe their tensors (dtype and
    shape in each header, and for per-rank files the global shape and placements; DCP's
    ``.metadata``, every tensor's dtype, global shape and chunks): the manifest counts the
    tensors instead of listing them again (format version 2; a DCP write of 100k tensors
    listed them in 11 MB that every later command parsed twice)."""
    write_manifest(dst, manifest_for(plan, results, listed=False))


def write_manifest(directory: Path, doc: Manifest) -> None:
    """Write ``reshard.json`` atomically (a fresh temporary, then rename).

    Indented, but one line per tensor: still readable, a quarter of the size, and written
    by the C encoder (a 100k-tensor manifest indented throughout took seconds and 17 MB).
    """
    if "tensors" not in doc:
        write_atomic(directory / MANIFEST, (json.dumps(doc, indent=2) + "\n").encode())
        return
    mark = "\x00tensors\x00"  # where the tensors go, in their place among the keys
    text = json.dumps({k: (mark if k == "tensors" else v) for k, v in doc.items()}, indent=2)
    compact = (",", ":")
    cache: dict[tuple[str, tuple[int, ...], tuple[str, ...]], str] = {}
    lines = []
    for name, info in doc.get("tensors", {}).items():
        key = (info["dtype"], tuple(info["shape"]), tuple(info["placements"]))
        value = cache.get(key)
        if value is None:
            value = cache[key] = json.dumps(info, separators=compact)
        lines.append(f"    {json.dumps(name, ensure_ascii=False)}: {value}")
    body = "{\n" + ",\n".join(lines) + "\n  }" if lines else "{}"
    text = text.replace(json.dumps(mark), body, 1) + "\n"
    write_atomic(directory / MANIFEST, text.encode())


def read_manifest(directory: Path) -> dict[str, object] | None:
    """The directory's ``reshard.json`` as a JSON object, or None when absent.

    Raises:
        HeaderError: the file is not a JSON object.
    """
    p = directory / MANIFEST
    if not os.path.lexists(p):
        return None
    data = load_json(p, what="reshard.json", error=HeaderError)
    return expect_object(data, path=str(p), field="reshard.json", error=HeaderError)
