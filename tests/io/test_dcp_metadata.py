"""dcp_metadata against torch's own classes: ``pickle.load`` under torch gives what torch would build.

The expected objects are constructed with torch's classes directly (as
``create_default_global_save_plan`` and ``FileSystemWriter.finish`` do); the
comparison covers every attribute, including ``MetadataIndex.index`` which
dataclass equality skips. Also: the globals named, big offsets (LONG1 ints),
hundreds of tensors (memo indexes past 255) and FileSystemReader.read_metadata.
The streaming encoder gives exactly the bytes of the value-tree encoder it replaced
(``tests/dcp_metadata_ref.py``) on random tensor lists, and writes as it goes.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path, PosixPath
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from reshard.io.dcp_metadata import (
    DCP_VERSION,
    ChunkEntry,
    StorageRecord,
    TensorEntry,
    TensorRecord,
    encode_metadata,
    write_metadata,
)
from reshard.torch_ops import torch_dtype
from tests.dcp_metadata_ref import encode_metadata as reference


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


# --------------------------------------------------------------------------- the streaming encoder

KEYS = ["w", "offsets", "sizes", "chunks", "fqn", "index", "torch.strided", "__0_0.distcp", "é.λ"]
PATHS = ["__0_0.distcp", "__10_0.distcp", "__2_1.distcp", "offsets", "w"]
INTS = st.sampled_from([0, 1, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**40, 2**64])


@st.composite
def tensor_lists(draw: st.DrawFn) -> list[TensorEntry]:
    """Tensors with keys that collide with the pickle's own strings, boxes of 0-5 dims with
    every int encoding, zero chunks to 1001 (APPENDS batches), many tensors (SETITEMS batches)."""
    count = draw(st.sampled_from([0, 1, 2, 7, 300, 1001]))
    out = []
    for k in range(count):
        nd = draw(st.integers(0, 5))
        shape = tuple(draw(st.lists(INTS, min_size=nd, max_size=nd)))
        if k < 4:
            nchunks = draw(st.sampled_from([0, 1, 3, 1001]))
        else:
            nchunks = draw(st.integers(0, 2))
        chunks = []
        for _ in range(nchunks):
            offs = tuple(draw(st.lists(INTS, min_size=nd, max_size=nd)))
            sizes = tuple(draw(st.lists(INTS, min_size=nd, max_size=nd)))
            path, at, n = draw(st.sampled_from(PATHS)), draw(INTS), draw(INTS)
            chunks.append(ChunkEntry(offs, sizes, path, at, n))
        fqn = draw(st.sampled_from(KEYS)) + (str(k) if k >= len(KEYS) or draw(st.booleans()) else "")
        if any(t.fqn == fqn for t in out):
            fqn += f".{k}"
        dtype = draw(st.sampled_from(["BF16", "F32", "F8_E4M3", "U16", "I64", "BOOL"]))
        out.append(TensorEntry(fqn, dtype, shape, tuple(chunks)))
    return out


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(tensor_lists(), st.sampled_from([None, "/", "/a", "/a/b/c", "/a/b/c/d", "rel/x"]))
def test_same_bytes_as_the_value_tree_encoder(tensors: list[TensorEntry], checkpoint_id: str | None) -> None:
    assert encode_metadata(tensors, checkpoint_id=checkpoint_id, save_id="s") == reference(
        tensors, checkpoint_id=checkpoint_id, save_id="s"
    )


def test_many_chunks_load_as_torchs_own_structures() -> None:
    """Slots past 255 (a Size's opcodes made once per box), 2-D and scalar boxes, 1000+ items."""
    tensors = [
        TensorEntry(
            f"layers.{i}.w",
            "BF16" if i % 3 else "F32",
            (8, 6) if i % 5 else (),
            tuple(
                ChunkEntry((2 * r, 0), (2, 6), f"__{r}_0.distcp", i * 1577, 1577)
                if i % 5
                else ChunkEntry((), (), f"__{r}_0.distcp", i * 1577, 1577)
                for r in range(4 if i % 5 else 1)
            ),
        )
        for i in range(700)
    ]
    data = encode_metadata(tensors, save_id="s")
    assert data == reference(tensors, save_id="s")
    assert state(pickle.loads(data)) == state(expected(tensors, None, "s"))


def test_written_as_made_in_pieces() -> None:
    """``write_metadata`` hands the pickle out about a MiB at a time while it still reads its
    inputs (nothing holds the whole), and the pieces are ``encode_metadata``'s bytes."""
    n = 20000
    chunk = ((0, 0), (4, 4))
    consumed = []

    def tensors() -> Iterator[TensorRecord]:
        for i in range(n):
            consumed.append(i)
            yield f"t.{i}", "BF16", (8, 4), [chunk, ((4, 0), (4, 4))]

    def storage() -> Iterator[StorageRecord]:
        for r in range(2):
            for i in range(n):
                yield f"t.{i}", r, (4 * r, 0), f"__{r}_0.distcp", i * 1577, 1577

    pieces: list[bytes] = []
    seen_at: list[int] = []

    def write(b: bytes) -> None:
        pieces.append(b)
        seen_at.append(len(consumed))

    write_metadata(write, tensors(), storage(), save_id="s")
    assert len(pieces) > 3 and max(map(len, pieces)) < 2 << 20
    assert seen_at[0] < n  # the first MiB went out before the last tensor was read
    entries = [
        TensorEntry(
            f"t.{i}",
            "BF16",
            (8, 4),
            tuple(ChunkEntry((4 * r, 0), (4, 4), f"__{r}_0.distcp", i * 1577, 1577) for r in range(2)),
        )
        for i in range(n)
    ]
    assert b"".join(pieces) == encode_metadata(entries, save_id="s")


def test_non_tensor_items_are_what_torch_builds(tmp_path: Path) -> None:
    """Items ``--to dcp`` carries over: ``BytesStorageMetadata`` after the tensors, and each
    ``MetadataIndex(fqn)`` -> ``_StorageInfo`` with its transform descriptors (none, or zstd),
    as torch's own pickle of the objects it builds gives them."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    tensors = entries()[1:2]
    objects = [
        ("optimizer.param_groups.0.lr", "__0_1.distcp", 0, 1261, ()),
        ("train.tag", "__0_1.distcp", 1261, 463, ("stream.zstd/1",)),
    ]
    out: list[bytes] = []
    storage: list[StorageRecord] = [("f8", 0, (0,), "__0_0.distcp", 1577, 1641)]
    tensor_records: list[TensorRecord] = [("f8", "F8_E4M3", (3,), [((0,), (3,))])]
    write_metadata(out.append, tensor_records, storage, save_id="s", objects=objects)
    got = pickle.loads(b"".join(out))
    want = expected(tensors, None, "s")
    for fqn, path, offset, length, tds in objects:
        want.state_dict_metadata[fqn] = BytesStorageMetadata()
        want.planner_data[fqn] = (fqn,)
        want.storage_data[MetadataIndex(fqn)] = _StorageInfo(path, offset, length, list(tds) or None)
    want = pickle.loads(pickle.dumps(want))
    assert got == want and state(got) == state(want)
    assert list(got.state_dict_metadata) == ["f8", *(o[0] for o in objects)]
    (tmp_path / ".metadata").write_bytes(b"".join(out))
    read = FileSystemReader(str(tmp_path)).read_metadata()
    assert read.storage_data[MetadataIndex("train.tag")].transform_descriptors == ["stream.zstd/1"]
    assert read.storage_data[MetadataIndex("optimizer.param_groups.0.lr")].transform_descriptors is None
