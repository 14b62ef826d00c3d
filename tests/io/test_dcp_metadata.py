"""dcp_metadata against torch's own classes: ``pickle.load`` under torch gives what torch would build.

The expected objects are constructed with torch's classes directly (as
``create_default_global_save_plan`` and ``FileSystemWriter.finish`` do); the
comparison covers every attribute, including ``MetadataIndex.index`` which
dataclass equality skips. Also: the globals named, big offsets (LONG1 ints),
hundreds of tensors (memo indexes past 255) and FileSystemReader.read_metadata.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import subprocess
import sys
from pathlib import Path, PosixPath
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from reshard.io.dcp_metadata import DCP_VERSION, ChunkEntry, TensorEntry, encode_metadata
from reshard.torch_ops import torch_dtype


def state(obj: Any) -> Any:
    """Every attribute (``MetadataIndex.index`` too); attribute order differs between
    a constructed and an unpickled ``TensorProperties`` (``__setstate__``), so sorted."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        attrs = sorted((k, state(v)) for k, v in vars(obj).items())
        return (type(obj).__module__, type(obj).__qualname__, attrs)
    if isinstance(obj, dict):
        return ("dict", [(state(k), state(v)) for k, v in obj.items()])
    if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        return (type(obj).__name__, [state(x) for x in obj])
    return (type(obj).__qualname__, obj)


def expected(tensors: list[TensorEntry], checkpoint_id: str | None, save_id: str) -> Metadata:
    """What torch builds for these tensors from its classes, through its own pickle round trip
    (``_StorageInfo.__getstate__`` drops ``transform_descriptors=None``)."""
    sdm = {}
    storage = {}
    for t in tensors:
        chunks = [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in t.chunks]
        props = TensorProperties(dtype=torch_dtype(t.dtype))
        sdm[t.fqn] = TensorStorageMetadata(props, torch.Size(t.shape), chunks)
    flat = [(t.fqn, i, c) for t in tensors for i, c in enumerate(t.chunks)]
    for fqn, i, c in sorted(flat, key=lambda x: (x[2].relative_path, x[2].offset)):
        storage[MetadataIndex(fqn, c.offsets, i)] = _StorageInfo(c.relative_path, c.offset, c.length)
    meta = StorageMeta(PosixPath(checkpoint_id) if checkpoint_id else None, save_id)
    md = Metadata(sdm, {t.fqn: (t.fqn,) for t in tensors}, storage, meta, DCP_VERSION)
    return pickle.loads(pickle.dumps(md))


def entries() -> list[TensorEntry]:
    return [
        TensorEntry(
            "model.layers.0.w",
            "BF16",
            (8, 4),
            (
                ChunkEntry((0, 0), (4, 4), "__0_0.distcp", 0, 1577),
                ChunkEntry((4, 0), (4, 4), "__1_0.distcp", 5_000_000_000, 1577),  # > 4 GiB offset
            ),
        ),
        TensorEntry("f8", "F8_E4M3", (3,), (ChunkEntry((0,), (3,), "__0_0.distcp", 1577, 1641),)),
        TensorEntry("u64", "U64", (2, 0), (ChunkEntry((0, 0), (2, 0), "__1_0.distcp", 9, 1513),)),
        TensorEntry("step", "F32", (), (ChunkEntry((), (), "__0_0.distcp", 3218, 1577),)),
    ]


def test_equals_what_torch_builds(tmp_path: Path) -> None:
    tensors = entries()
    data = encode_metadata(tensors, checkpoint_id=str(tmp_path), save_id="abc")
    got = pickle.loads(data)
    want = expected(tensors, str(tmp_path), "abc")
    assert got == want
    assert state(got) == state(want)
    # and through torch's reader, as dcp.load reads it
    (tmp_path / ".metadata").write_bytes(data)
    read = FileSystemReader(str(tmp_path)).read_metadata()
    assert read.state_dict_metadata == want.state_dict_metadata
    assert read.storage_data == want.storage_data


def test_globals_are_torchs_own() -> None:
    seen: set[tuple[str, str]] = set()

    class Spy(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            seen.add((module, name))
            return super().find_class(module, name)

    Spy(io.BytesIO(encode_metadata(entries(), checkpoint_id="/x/y"))).load()
    md = "torch.distributed.checkpoint.metadata"
    assert seen == {
        (md, "Metadata"),
        (md, "TensorStorageMetadata"),
        (md, "TensorProperties"),
        (md, "ChunkStorageMetadata"),
        (md, "MetadataIndex"),
        (md, "StorageMeta"),
        (md, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch", "bfloat16"),
        ("torch", "float8_e4m3fn"),
        ("torch", "uint64"),
        ("torch", "float32"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
    }


def test_many_tensors_use_long_memo_indexes() -> None:
    tensors = [
        TensorEntry(
            f"layers.{i}.w", "F16", (2, 2), (ChunkEntry((0, 0), (2, 2), "__0_0.distcp", i * 1577, 1577),)
        )
        for i in range(400)
    ]
    data = encode_metadata(tensors, save_id="s")
    assert b"r" in data  # LONG_BINPUT
    assert state(pickle.loads(data)) == state(expected(tensors, None, "s"))


def test_fresh_save_id_and_duplicate_keys() -> None:
    a = pickle.loads(encode_metadata(entries())).storage_meta.save_id
    b = pickle.loads(encode_metadata(entries())).storage_meta.save_id
    assert a != b and len(a) == 36
    t = entries()[1]
    with pytest.raises(ValueError, match="duplicate tensor keys"):
        encode_metadata([t, t])
    with pytest.raises(ValueError, match="does not fit"):
        TensorEntry("x", "F32", (2,), (ChunkEntry((0, 0), (1, 1), "f", 0, 1),))
    with pytest.raises(ValueError, match="no torch equivalent"):
        TensorEntry("x", "F4", (2,), ())


def test_pure_modules_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import reshard.io.dcp_metadata as m, reshard.io.torchzip_write, reshard.formats.dcp_boxes\n"
        "m.encode_metadata([m.TensorEntry('w', 'BF16', (2,), (m.ChunkEntry((0,), (2,), 'f', 0, 1),))])\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
