"""The ``.metadata`` pickle of a DCP checkpoint, written without torch (pure).

torch reads ``.metadata`` with plain ``pickle.load`` (dcp.md §A.3), so it must name
exactly the classes torch itself writes: ``Metadata``, ``TensorStorageMetadata``,
``TensorProperties`` (tuple state), ``ChunkStorageMetadata``, ``MetadataIndex``,
``StorageMeta``, ``_StorageInfo``, ``torch.Size``, the dtype, ``_get_layout`` and
``_MEM_FORMAT_ENCODING``, plus ``pathlib.PosixPath`` for the checkpoint id. Each
object is ``NEWOBJ`` + ``BUILD`` with the ``__dict__`` torch's own pickle carries, so
``pickle.load`` under torch rebuilds instances equal to the ones ``dcp.save`` makes.
``planner_data`` maps each key to ``(key,)``: a flat state dict, keys as they are.
Non-tensor items copied from a source (``BYTE_IO``: optimizer hyper-parameters) are
``BytesStorageMetadata`` entries after the tensors, their storage items
``MetadataIndex(fqn)`` (no offset) -> ``_StorageInfo`` with their ``transform_descriptors``.

The opcodes and memo numbering are those of :class:`~reshard.io.pickle_emit.PickleEmitter`
on the tree of values torch pickles (``tests/dcp_metadata_ref.py`` keeps that encoder;
the tests check the bytes are the same), but written as they are made, a MiB at a
time (:func:`write_metadata`): a 100k-tensor checkpoint at TP-8 has 800k chunks, and
its ``.metadata`` (165 MB) is never held whole, nor a tree of values for it.

>>> chunk = ChunkEntry((0,), (4,), "__0_0.distcp", 0, 1577)
>>> data = encode_metadata([TensorEntry("w", "BF16", (4,), (chunk,))])
>>> data[:2], b"torch.distributed.checkpoint.metadata" in data
(b'\\x80\\x02', True)
"""

from __future__ import annotations

import re
import struct
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import PurePosixPath
from typing import TypeVar

from ..dtypes import TORCH_NAMES

__all__ = [
    "DCP_VERSION",
    "ChunkEntry",
    "ObjectRecord",
    "StorageRecord",
    "TensorEntry",
    "TensorRecord",
    "encode_metadata",
    "natural_key",
    "write_metadata",
]

T = TypeVar("T")

#: ``Metadata.version`` torch 2.13 writes (``filesystem.CURRENT_DCP_VERSION``).
DCP_VERSION = "1.0.0"

_MD = "torch.distributed.checkpoint.metadata"


@dataclass(frozen=True, slots=True)
class ChunkEntry:
    """One stored chunk: its box in global coordinates and where its archive lies.

    Attributes:
        offsets: global offset of the box, one per tensor dim (``()`` for a scalar).
        sizes: box size per dim; zero sizes are kept, as torch keeps empty shards.
        relative_path: file name in the checkpoint directory (``__0_0.distcp``).
        offset: byte offset of the chunk's ``torch.save`` archive in that file.
        length: the archive's length in bytes.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    relative_path: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.sizes):
            raise ValueError(f"chunk offsets {self.offsets} and sizes {self.sizes} differ in rank")


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """A tensor of the checkpoint: key, safetensors dtype name, global shape and its chunks in order."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[ChunkEntry, ...]

    def __post_init__(self) -> None:
        if self.dtype not in TORCH_NAMES:
            raise ValueError(f'tensor "{self.fqn}": dtype {self.dtype} has no torch equivalent')
        for c in self.chunks:
            if len(c.offsets) != len(self.shape):
                raise ValueError(f'tensor "{self.fqn}": chunk at {c.offsets} does not fit shape {self.shape}')


TensorRecord = tuple[str, str, tuple[int, ...], Iterable[tuple[tuple[int, ...], tuple[int, ...]]]]
"""``(fqn, dtype, shape, chunks)``: a tensor of ``state_dict_metadata``, its chunks as
``(offsets, sizes)`` in order."""

StorageRecord = tuple[str, int, tuple[int, ...], str, int, int]
"""``(fqn, index, offsets, relative_path, offset, length)``: one ``storage_data`` item,
``MetadataIndex(fqn, offsets, index)`` -> ``_StorageInfo(relative_path, offset, length)``."""

ObjectRecord = tuple[str, str, int, int, tuple[str, ...]]
"""``(fqn, relative_path, offset, length, transform_descriptors)``: a non-tensor item,
``BytesStorageMetadata`` in ``state_dict_metadata`` and its bytes' place in ``storage_data``."""

_SIZE = ("torch", "Size")
_BYTES = (_MD, "BytesStorageMetadata")
_CHUNK = (_MD, "ChunkStorageMetadata")
_TENSOR = (_MD, "TensorStorageMetadata")
_PROPS = (_MD, "TensorProperties")
_INDEX = (_MD, "MetadataIndex")
_INFO = ("torch.distributed.checkpoint.filesystem", "_StorageInfo")
_BATCH = 1000  # CPython's pickler batches APPENDS/SETITEMS in groups of this size
_FLUSH = 1 << 20  # bytes gathered before they are handed to ``write``
_U32 = struct.Struct("<I")
_SLOTS2 = struct.Struct("<I2sI")  # a Size's slots after its head: TUPLE1's, REDUCE's
_SLOTS3 = struct.Struct("<I2sI2sI")  # TUPLEn's, TUPLE1's, REDUCE's


def _int(v: int) -> bytes:
    """An int as CPython's protocol-2 pickler writes it (``BININT1/2``, ``BININT``, ``LONG1``)."""
    if 0 <= v <= 0xFF:
        return b"K" + bytes([v])
    if 0 <= v <= 0xFFFF:
        return b"M" + struct.pack("<H", v)
    if -0x80000000 <= v <= 0x7FFFFFFF:
        return b"J" + struct.pack("<i", v)
    raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def _tuple_ops(dims: tuple[int, ...]) -> bytes:
    """A tuple of ints up to its memo slot: ``)`` (no slot), the ints + ``TUPLE1-3``, or ``(`` ints ``t``."""
    if not dims:
        return b")"
    body = b"".join(_int(int(d)) for d in dims)
    if len(dims) <= 3:
        return body + b"\x85\x86\x87"[len(dims) - 1 : len(dims)]
    return b"(" + body + b"t"


class _Template:
    """Bytes with a memo slot (``LONG_BINPUT`` argument) between consecutive ``pieces``, the
    slots numbered on from where it is written: one ``struct`` pack."""

    __slots__ = ("_st", "_args", "slots")

    def __init__(self, pieces: Sequence[bytes]) -> None:
        self.slots = len(pieces) - 1
        self._st = struct.Struct("<" + "I".join(f"{len(x)}s" for x in pieces))
        self._args: list[bytes | int] = [x for piece in pieces for x in (piece, 0)][:-1]

    def at(self, n: int) -> bytes:
        """The bytes, slots numbered from ``n``."""
        args = self._args
        args[1::2] = range(n, n + self.slots)
        return self._st.pack(*args)


class _Pickle:
    """The ``.metadata`` pickle, handed to ``write`` as it is made: the opcodes and memo
    numbering of :class:`~reshard.io.pickle_emit.PickleEmitter` (globals and strings
    memoized by value; every non-empty tuple, list, dict and object takes the next slot),
    without a tree of values.

    Once slots are 4-byte ``LONG_BINPUT`` s, a box's ``torch.Size`` opcodes are made once
    per box (chunks of tensors of one geometry share their boxes), so a chunk costs a
    few byte appends.
    """

    __slots__ = ("out", "write", "memo", "n", "_sizes", "_chunks", "_items", "_lengths", "_head")

    def __init__(self, write: Callable[[bytes], object]) -> None:
        self.out = bytearray(b"\x80\x02")
        self.write = write
        self.memo: dict[tuple[str, str] | str, int] = {}
        self.n = 0
        self._sizes: dict[tuple[int, ...], bytes] = {}
        self._chunks: dict[tuple[tuple[int, ...], tuple[int, ...]], _Template] = {}
        self._items: dict[tuple[tuple[int, ...], str], _Template] = {}
        self._lengths: dict[int, bytes] = {}
        self._head: _Template | None = None

    def warm(self, *keys: tuple[str, str] | str) -> bool:
        """Whether slots are ``LONG_BINPUT`` s from here on and ``keys`` are memoized: what a
        template needs (both stay true once true)."""
        return self.n >= 256 and all(k in self.memo for k in keys)

    def getting(self, key: tuple[str, str] | str) -> bytes:
        """The ``BINGET`` of a memoized key."""
        return self._get(self.memo[key])

    def size_pieces(self, dims: tuple[int, ...]) -> list[bytes]:
        """``torch.Size(dims)`` as template pieces (warm: ``torch.Size`` memoized)."""
        head = self.getting(_SIZE) + _tuple_ops(dims)
        return [head + b"r", b"\x85r", b"Rr"] if dims else [head + b"\x85r", b"Rr"]

    def chunk(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> None:
        """``ChunkStorageMetadata(offsets, sizes)``: once warm, from a template per box."""
        t = self._chunks.get((offsets, sizes))
        if t is None:
            if not self.warm(_CHUNK, _SIZE, "offsets", "sizes"):
                self.new(_CHUNK)
                self.text("offsets")
                self.size(offsets)
                self.text("sizes")
                self.size(sizes)
                self.out += b"ub"
                return
            pieces = [self.getting(_CHUNK) + b")\x81r", b"}r", b"(" + self.getting("offsets")]
            for part, dims in (("offsets", offsets), ("sizes", sizes)):
                size = self.size_pieces(dims)
                if part == "sizes":
                    pieces[-1] += self.getting("sizes")
                pieces[-1] += size[0]
                pieces += size[1:] + [b""]
            pieces[-1] += b"ub"
            t = self._chunks[(offsets, sizes)] = _Template(pieces)
        self.out += t.at(self.n)
        self.n += t.slots

    def storage_item(self, item: StorageRecord) -> None:
        """``MetadataIndex`` -> ``_StorageInfo``: once warm, from templates per box and file."""
        fqn, index, offsets, path, offset, length = item
        t = self._items.get((offsets, path))
        if t is None or fqn not in self.memo:
            keys = (_INDEX, _INFO, _SIZE, "fqn", "index", "offset", "relative_path", "length", path, fqn)
            if not self.warm(*keys):
                _storage_item(self, item)
                return
            size = self.size_pieces(offsets)
            pieces = [self.getting("offset") + size[0], *size[1:], b"ub" + self.getting(_INFO) + b")\x81r"]
            pieces += [b"}r", b"(" + b"".join(map(self.getting, ("relative_path", path, "offset")))]
            t = self._items[(offsets, path)] = _Template(pieces)
            if self._head is None:
                self._head = _Template([self.getting(_INDEX) + b")\x81r", b"}r", b"(" + self.getting("fqn")])
        head = self._head
        assert head is not None
        n = self.n
        tail = self._lengths.get(length)
        if tail is None:
            tail = self._lengths[length] = self.getting("length") + _int(length) + b"ub"
        self.out += b"".join(
            (
                head.at(n),
                self.getting(fqn),
                self.getting("index"),
                _int(index),
                t.at(n + 2),
                _int(offset),
                tail,
            )
        )
        self.n = n + 2 + t.slots

    def flush(self, last: bool = False) -> None:
        """Hand the bytes so far to ``write`` (once there are enough of them, or ``last``)."""
        if last or len(self.out) >= _FLUSH:
            self.write(bytes(self.out))
            self.out.clear()

    def put(self) -> None:
        """The next memo slot (``BINPUT``/``LONG_BINPUT``)."""
        n = self.n
        self.n = n + 1
        self.out += b"q" + bytes([n]) if n < 256 else b"r" + _U32.pack(n)

    @staticmethod
    def _get(idx: int) -> bytes:
        return b"h" + bytes([idx]) if idx < 256 else b"j" + _U32.pack(idx)

    def glob(self, key: tuple[str, str]) -> None:
        """A global: ``GLOBAL`` the first time, ``BINGET`` after."""
        idx = self.memo.get(key)
        if idx is not None:
            self.out += self._get(idx)
            return
        self.out += b"c" + f"{key[0]}\n{key[1]}\n".encode()
        self.memo[key] = self.n
        self.put()

    def text(self, s: str) -> None:
        """A string: ``BINUNICODE`` the first time, ``BINGET`` after."""
        idx = self.memo.get(s)
        if idx is not None:
            self.out += self._get(idx)
            return
        raw = s.encode("utf-8")
        self.out += b"X" + _U32.pack(len(raw)) + raw
        self.memo[s] = self.n
        self.put()

    def dict_field(self, name: str) -> None:
        """A field ``name`` whose value is a new dict (``EMPTY_DICT``, memoized), its items next."""
        self.text(name)
        self.out += b"}"
        self.put()

    def integer(self, v: int) -> None:
        self.out += _int(v)

    def size(self, dims: tuple[int, ...]) -> None:
        """``torch.Size(dims)``, as ``Reduce(torch.Size, (dims,))`` pickles."""
        n = self.n
        if n < 256 or _SIZE not in self.memo:
            self.glob(_SIZE)
            self.out += _tuple_ops(dims)
            if dims:
                self.put()
            self.out += b"\x85"
            self.put()
            self.out += b"R"
            self.put()
            return
        head = self._sizes.get(dims)
        if head is None:  # every slot from here on is a LONG_BINPUT, the global a fixed BINGET
            tail = b"r" if dims else b"\x85r"
            head = self._sizes[dims] = self._get(self.memo[_SIZE]) + _tuple_ops(dims) + tail
        if dims:
            self.out += head + _SLOTS3.pack(n, b"\x85r", n + 1, b"Rr", n + 2)
            self.n = n + 3
        else:
            self.out += head + _SLOTS2.pack(n, b"Rr", n + 1)
            self.n = n + 2

    def new(self, cls: tuple[str, str]) -> None:
        """``cls.__new__(cls)`` (``NEWOBJ``), then ``MARK`` for the state dict's items ``BUILD`` takes."""
        self.glob(cls)
        self.out += b")\x81"
        self.put()
        self.out += b"}"
        self.put()
        self.out += b"("

    def batches(self, items: Iterable[T], one: bytes, many: bytes) -> Iterator[list[T]]:
        """``items`` in CPython's batches of 1000: ``MARK`` ... ``many``, or one item then ``one``."""
        it = iter(items)
        while group := list(islice(it, _BATCH)):
            if len(group) > 1:
                self.out += b"("
            yield group
            self.out += many if len(group) > 1 else one
            self.flush()


def _tensor_md(
    p: _Pickle, dtype: str, shape: tuple[int, ...], chunks: Iterable[tuple[tuple[int, ...], tuple[int, ...]]]
) -> None:
    """``TensorStorageMetadata``: properties (``TensorProperties.__getstate__``: dtype, layout,
    requires_grad, memory format code, pin_memory), size and chunks."""
    p.new(_TENSOR)
    p.text("properties")
    p.glob(_PROPS)
    p.out += b")\x81"
    p.put()
    p.out += b"("
    p.glob(("torch", TORCH_NAMES[dtype]))
    p.glob(("torch.serialization", "_get_layout"))
    p.text("torch.strided")
    p.out += b"\x85"
    p.put()
    p.out += b"R"
    p.put()
    p.out += b"\x89"
    p.glob((_MD, "_MEM_FORMAT_ENCODING"))
    p.out += b"K\x00\x85"
    p.put()
    p.out += b"R"
    p.put()
    p.out += b"\x89t"
    p.put()
    p.out += b"b"
    p.text("size")
    p.size(shape)
    p.text("chunks")
    p.out += b"]"
    p.put()
    for boxes in p.batches(chunks, b"a", b"e"):
        for offsets, sizes in boxes:
            p.chunk(offsets, sizes)
    p.out += b"ub"


def _storage_item(p: _Pickle, item: StorageRecord) -> None:
    fqn, index, offsets, path, offset, length = item
    # MetadataIndex.__init__ sets fqn, index, offset in this order: its __dict__ order.
    p.new(_INDEX)
    p.text("fqn")
    p.text(fqn)
    p.text("index")
    p.integer(index)
    p.text("offset")
    p.size(offsets)
    p.out += b"ub"
    _storage_info(p, path, offset, length)


def _storage_info(p: _Pickle, path: str, offset: int, length: int, descriptors: Sequence[str] = ()) -> None:
    """``_StorageInfo(relative_path, offset, length)``, with ``transform_descriptors`` only when
    there are some (torch's ``__getstate__`` drops None)."""
    p.new(_INFO)
    p.text("relative_path")
    p.text(path)
    p.text("offset")
    p.integer(offset)
    p.text("length")
    p.integer(length)
    if descriptors:
        p.text("transform_descriptors")
        p.out += b"]"
        p.put()
        p.out += b"("
        for d in descriptors:
            p.text(d)
        p.out += b"e"
    p.out += b"ub"


def _object_item(p: _Pickle, item: ObjectRecord) -> None:
    """An object's storage item: ``MetadataIndex(fqn)`` (index None and no offset, as torch
    builds it for a bytes item) -> ``_StorageInfo``, with its descriptors when it has any."""
    fqn, path, offset, length, descriptors = item
    p.new(_INDEX)
    p.text("fqn")
    p.text(fqn)
    p.text("index")
    p.out += b"Nub"
    _storage_info(p, path, offset, length, descriptors)


def _storage_meta(p: _Pickle, checkpoint_id: str | None, save_id: str) -> None:
    p.new((_MD, "StorageMeta"))
    p.text("checkpoint_id")
    if checkpoint_id is None:
        p.out += b"N"
    else:  # PosixPath(*parts)
        p.glob(("pathlib", "PosixPath"))
        parts = PurePosixPath(checkpoint_id).parts
        if len(parts) > 3:
            p.out += b"("
        for part in parts:
            p.text(part)
        p.out += (
            b")" if not parts else b"\x85\x86\x87"[len(parts) - 1 : len(parts)] if len(parts) <= 3 else b"t"
        )
        if parts:
            p.put()
        p.out += b"R"
        p.put()
    p.text("save_id")
    p.text(save_id)
    p.text("load_id")
    p.out += b"N"
    p.text("modules")
    p.out += b"]"
    p.put()
    p.out += b"ub"


def write_metadata(
    write: Callable[[bytes], object],
    tensors: Iterable[TensorRecord],
    storage: Iterable[StorageRecord],
    *,
    checkpoint_id: str | None = None,
    save_id: str,
    objects: Sequence[ObjectRecord] = (),
) -> None:
    """Write the bytes of ``.metadata`` through ``write``, about a MiB at a time, as they are made.

    Args:
        write: takes each piece of the pickle in order (a file's ``write``).
        tensors: every tensor with its chunks, in the order to record them (torch: order
            of first appearance over ranks; chunks by rank). Keys must be unique (the
            caller checks: a duplicate would pickle as one key).
        storage: each chunk's storage item in file order (natural order of the paths,
            then offset); ``index`` is its position among its tensor's chunks.
        checkpoint_id: ``StorageMeta.checkpoint_id`` (a ``PosixPath``); None leaves it unset.
        save_id: ``StorageMeta.save_id``.
        objects: non-tensor items, recorded after the tensors (keys unique, none a tensor's).
    """
    p = _Pickle(write)
    p.new((_MD, "Metadata"))
    p.dict_field("state_dict_metadata")
    fqns: list[str] = []
    for group in p.batches(tensors, b"s", b"u"):
        for fqn, dtype, shape, chunks in group:
            fqns.append(fqn)
            p.text(fqn)
            _tensor_md(p, dtype, shape, chunks)
    for objs in p.batches(objects, b"s", b"u"):  # (more SETITEMS into the same dict)
        for obj in objs:
            fqns.append(obj[0])
            p.text(obj[0])
            p.glob(_BYTES)
            p.out += b")\x81"
            p.put()
    p.dict_field("planner_data")
    for names in p.batches(fqns, b"s", b"u"):
        for fqn in names:
            p.text(fqn)
            p.text(fqn)
            p.out += b"\x85"
            p.put()
    del fqns
    p.dict_field("storage_data")
    for items in p.batches(storage, b"s", b"u"):
        for item in items:
            p.storage_item(item)
    for objs in p.batches(objects, b"s", b"u"):
        for obj in objs:
            _object_item(p, obj)
    p.text("storage_meta")
    _storage_meta(p, checkpoint_id, save_id)
    p.text("version")
    p.text(DCP_VERSION)
    p.out += b"ub."
    p.flush(last=True)


def natural_key(path: str) -> tuple[tuple[int, str], ...]:
    """Sort key putting ``__2_0.distcp`` before ``__10_0.distcp``."""
    return tuple((int(p), "") if p.isdigit() else (-1, p) for p in re.split(r"(\d+)", path))


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
    records = [(t.fqn, t.dtype, t.shape, [(c.offsets, c.sizes) for c in t.chunks]) for t in tensors]
    # storage items in file order then offset, as torch gathers its ranks' write results
    items = [(t.fqn, i, c) for t in tensors for i, c in enumerate(t.chunks)]
    items.sort(key=lambda x: (natural_key(x[2].relative_path), x[2].offset))
    storage = [(fqn, i, c.offsets, c.relative_path, c.offset, c.length) for fqn, i, c in items]
    out: list[bytes] = []
    sid = save_id or str(uuid.uuid4())
    write_metadata(out.append, records, storage, checkpoint_id=checkpoint_id, save_id=sid)
    return b"".join(out)
