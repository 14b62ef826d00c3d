"""The tensors of a ``torch.save`` object, located in its archive (pure: nothing of the pickle runs).

:func:`reshard.io.unpickle.load_torch_save` gives the object with tensors as
:class:`~reshard.io.unpickle.StoredTensor`; :func:`leaves` walks its dicts and lists (keys
joined with ``.``, bounded in depth and count) and :func:`locate` finds each tensor's bytes in
the archive's stored ``data/N`` record. The ``pt`` reader reads whole files this way, the
``dcp`` reader the objects ``dcp.save(..., DefaultSavePlanner(flatten_state_dict=False))``
stores at an offset of a ``.distcp`` file.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

from ..dtypes import DTYPE_SIZES
from ..errors import HeaderError, LayoutError
from ..intervals import row_major_strides
from .header import TensorEntry
from .torchzip import STORED, TorchZip, ZipRecord
from .unpickle import SAFETENSORS_DTYPES, StoredTensor

__all__ = ["MAX_DEPTH", "MAX_NODES", "geometry_of", "leaves", "locate", "stored_record"]

#: Containers nested deeper than this (a state dict needs a handful) are refused: the pickle can
#: nest lists past Python's recursion limit, or hold a list that contains itself.
MAX_DEPTH = 256
#: Containers and leaves visited in one file: a pickle can refer to one list from many places
#: (``[L1, L1]``, ``L1 = [L2, L2]``, ...), so a small file can name 2**60 leaves.
MAX_NODES = 5_000_000


def _containers(obj: Any) -> Iterator[tuple[Any, Any]] | None:
    if isinstance(obj, Mapping):
        return iter(obj.items())
    if isinstance(obj, (list, tuple)):
        return enumerate(obj)
    return None


def leaves(
    obj: Any, path: str | os.PathLike[str], *, max_depth: int = MAX_DEPTH, max_nodes: int = MAX_NODES
) -> Iterator[tuple[str, Any]]:
    """Leaves of nested dicts and lists, their keys joined with ``.``, depth first in order.

    Raises:
        HeaderError: containers nested deeper than ``max_depth`` (or a cycle), or more
            than ``max_nodes`` of them and their leaves.
    """
    top = _containers(obj)
    if top is None:
        yield "", obj
        return
    stack: list[tuple[str, Iterator[tuple[Any, Any]]]] = [("", top)]
    nodes = 0
    while stack:
        prefix, items = stack[-1]
        item = next(items, None)
        if item is None:
            stack.pop()
            continue
        nodes += 1
        if nodes > max_nodes:
            raise HeaderError(
                f"{path}: the torch.save pickle names more than {max_nodes:,} containers and "
                "values (MAX_PT_NODES); a state dict has one per tensor and a few more, so this "
                "looks like a file built to exhaust memory",
                path=str(path),
            )
        k, v = item
        name = f"{prefix}.{k}" if prefix else str(k)
        inner = _containers(v)
        if inner is None:
            yield name, v
        elif len(stack) >= max_depth:
            raise HeaderError(
                f"{path}: the torch.save pickle nests dicts and lists more than {max_depth} deep "
                f"(MAX_PT_DEPTH), or holds a list that contains itself, under {name[:80]!r}; a "
                "state dict is a few levels deep",
                path=str(path),
            )
        else:
            stack.append((name, inner))


_Geometry = tuple[str, int, bool]  # safetensors dtype, element count, row-major


def _geometry(st: StoredTensor) -> _Geometry | str:
    """The local tensor's safetensors dtype, element count and whether it is row-major; or the
    name of its torch dtype safetensors cannot hold."""
    dtype = SAFETENSORS_DTYPES.get(st.dtype)
    if dtype is None:
        return st.dtype
    numel = 1
    for s in st.size:
        numel *= s
    want = row_major_strides(st.size)
    rows = not numel or all(n == 1 or a == b for n, a, b in zip(st.size, st.stride, want))
    return dtype, numel, rows


def geometry_of(st: StoredTensor, geometries: dict[Any, _Geometry | str] | None = None) -> _Geometry | str:
    """:func:`_geometry` of ``st``, remembered in ``geometries`` by (dtype, size, stride)."""
    if geometries is None:
        return _geometry(st)
    key = (st.dtype, st.size, st.stride)
    g = geometries.get(key)
    if g is None:
        g = geometries[key] = _geometry(st)
    return g


def stored_record(
    name: str, st: StoredTensor, tz: TorchZip, path: str | os.PathLike[str], isz: int, nbytes: int
) -> tuple[ZipRecord, int]:
    """The ``data/N`` record of ``st``'s storage and where the tensor's bytes start in it
    (``isz``-byte items), checked: stored (not compressed), of the storage's size, holding the
    ``nbytes`` the tensor spans.

    Raises:
        HeaderError: naming the file, the tensor and the record.
    """
    rec = tz.records.get(f"{tz.prefix}/data/{st.key}") or tz.record(f"data/{st.key}")
    first = st.storage_offset * isz
    if rec.compress_type != STORED or rec.size != st.storage_nbytes or first + nbytes > rec.size:
        raise HeaderError(
            f'{path}: tensor "{name}": data record {rec.name} is {rec.size} bytes (zip method '
            f"{rec.compress_type}); the tensor needs {nbytes} stored bytes at {first} of a "
            f"{st.storage_nbytes}-byte storage",
            path=str(path),
            tensor=name,
        )
    return rec, first


def locate(
    name: str,
    st: StoredTensor,
    tz: TorchZip,
    path: str | os.PathLike[str],
    geometries: dict[Any, _Geometry | str] | None = None,
) -> tuple[TensorEntry, int | None]:
    """Where a tensor of a ``torch.save`` archive lies in its file (absolute offsets, as a header
    entry), and the record's CRC32 when the record holds exactly its bytes. ``geometries``: the
    checks of each (dtype, size, stride) made once (a file of 100k tensors has a few).

    Raises:
        HeaderError: a dtype safetensors has no name for; a record compressed, or too short.
        LayoutError: strides that are not row-major.
    """
    g = geometry_of(st, geometries)
    q = f'{path}: tensor "{name}"'
    if isinstance(g, str):
        raise HeaderError(f"{q} has dtype {g}, which safetensors cannot hold", path=str(path), tensor=name)
    dtype, numel, rows = g
    if not rows:
        raise LayoutError(
            f"{q} of shape {list(st.size)} is stored with strides {list(st.stride)}, not row-major; "
            "re-save the state dict with .contiguous() tensors",
            path=str(path),
            tensor=name,
        )
    isz = DTYPE_SIZES[dtype]
    nbytes = numel * isz
    rec, first = stored_record(name, st, tz, path, isz, nbytes)
    crc = rec.crc32 if first == 0 and nbytes == rec.size else None
    return TensorEntry(name, dtype, st.size, rec.offset + first, rec.offset + first + nbytes), crc
