"""The ``.metadata`` encoder reshard had before the streaming one (tests only, not in the package).

It builds the whole value tree (:mod:`reshard.io.pickle_emit`) and pickles it in one go:
slow and large for 800k chunks, but plainly the structure torch pickles. The tests
check that :func:`reshard.io.dcp_metadata.encode_metadata` gives its bytes exactly.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from pathlib import PurePosixPath

from reshard.dtypes import TORCH_NAMES
from reshard.io.dcp_metadata import DCP_VERSION, TensorEntry
from reshard.io.pickle_emit import Dict, Global, NewObj, PickleEmitter, Reduce, Value

__all__ = ["encode_metadata"]

_MD = "torch.distributed.checkpoint.metadata"


def _size(dims: Sequence[int]) -> Value:
    return Reduce(Global("torch", "Size"), (tuple(int(d) for d in dims),))


def _properties(dtype: str) -> Value:
    """``TensorProperties.__getstate__``: (dtype, layout, requires_grad, memory format code, pin_memory)."""
    layout = Reduce(Global("torch.serialization", "_get_layout"), ("torch.strided",))
    contiguous = Reduce(Global(_MD, "_MEM_FORMAT_ENCODING"), (0,))
    state = (Global("torch", TORCH_NAMES[dtype]), layout, False, contiguous, False)
    return NewObj(Global(_MD, "TensorProperties"), state)


def _tensor_md(t: TensorEntry) -> Value:
    chunks: list[Value] = [
        NewObj(Global(_MD, "ChunkStorageMetadata"), {"offsets": _size(c.offsets), "sizes": _size(c.sizes)})
        for c in t.chunks
    ]
    state: dict[str, Value] = {"properties": _properties(t.dtype), "size": _size(t.shape), "chunks": chunks}
    return NewObj(Global(_MD, "TensorStorageMetadata"), state)


def _natural(path: str) -> tuple[tuple[int, str], ...]:
    """Sort key putting ``__2_0.distcp`` before ``__10_0.distcp``."""
    return tuple((int(p), "") if p.isdigit() else (-1, p) for p in re.split(r"(\d+)", path))


def _storage_data(tensors: Sequence[TensorEntry]) -> Value:
    """``MetadataIndex(fqn, offset, index)`` -> ``_StorageInfo(path, offset, length)`` per chunk.

    In file order then offset, as torch gathers its ranks' write results.
    """
    chunks = [(t.fqn, i, c) for t in tensors for i, c in enumerate(t.chunks)]
    chunks.sort(key=lambda x: (_natural(x[2].relative_path), x[2].offset))
    out: list[tuple[Value, Value]] = []
    for fqn, i, c in chunks:
        # MetadataIndex.__init__ sets fqn, index, offset in this order: its __dict__ order.
        key = NewObj(Global(_MD, "MetadataIndex"), {"fqn": fqn, "index": i, "offset": _size(c.offsets)})
        info: dict[str, Value] = {"relative_path": c.relative_path, "offset": c.offset, "length": c.length}
        out.append((key, NewObj(Global("torch.distributed.checkpoint.filesystem", "_StorageInfo"), info)))
    return Dict(tuple(out))


def _storage_meta(checkpoint_id: str | None, save_id: str) -> Value:
    path: Value = None
    if checkpoint_id is not None:
        path = Reduce(Global("pathlib", "PosixPath"), tuple(PurePosixPath(checkpoint_id).parts))
    state: dict[str, Value] = {"checkpoint_id": path, "save_id": save_id, "load_id": None, "modules": []}
    return NewObj(Global(_MD, "StorageMeta"), state)


def encode_metadata(
    tensors: Sequence[TensorEntry], *, checkpoint_id: str | None = None, save_id: str | None = None
) -> bytes:
    """The bytes of ``.metadata`` for these tensors (keys must be unique).

    Args:
        tensors: every tensor with all of its chunks, in the order to record them
            (torch: order of first appearance over ranks; chunks by rank).
        checkpoint_id: recorded as ``StorageMeta.checkpoint_id`` (a ``PosixPath``), as
            ``FileSystemWriter`` records its directory; None leaves it unset.
        save_id: ``StorageMeta.save_id``; a fresh UUID4 string by default, like torch.

    Raises:
        ValueError: a key appears twice.
    """
    fqns = [t.fqn for t in tensors]
    if len(set(fqns)) != len(fqns):
        dup = sorted({f for f in fqns if fqns.count(f) > 1})
        raise ValueError(f"duplicate tensor keys {dup}")
    state: dict[str, Value] = {
        "state_dict_metadata": {t.fqn: _tensor_md(t) for t in tensors},
        "planner_data": {f: (f,) for f in fqns},
        "storage_data": _storage_data(tensors),
        "storage_meta": _storage_meta(checkpoint_id, save_id or str(uuid.uuid4())),
        "version": DCP_VERSION,
    }
    return PickleEmitter().dumps(NewObj(Global(_MD, "Metadata"), state))
